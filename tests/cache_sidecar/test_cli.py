"""`cache-sidecar` as a process: fetch prints the snapshot path last, errors exit non-zero and clearly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cache_sidecar.cli import parse_size
from inference_svc.testing.mirror import MirrorFixture


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cache_sidecar.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_fetch_verify_ls(olah: MirrorFixture, tiny_model: Path, tmp_path: Path) -> None:
    commit = olah.publish("org/cli", tiny_model)
    vol = str(tmp_path / "vol")
    out = _cli("fetch", f"org/cli@{commit}", "--mirror", olah.url, "--cache-dir", vol)
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip().splitlines()[-1])
    assert path == tmp_path / "vol" / "models--org--cli" / "snapshots" / commit
    assert (path / "config.json").read_bytes() == (tiny_model / "config.json").read_bytes()

    # Flags have environment equivalents.
    env = {"CACHE_SIDECAR_CACHE_DIR": vol}
    out = _cli("verify", f"org/cli@{commit}", env=env)
    assert out.returncode == 0 and "intact" in out.stdout, out.stderr
    out = _cli("ls", env=env)
    assert out.returncode == 0 and out.stdout.startswith(f"org/cli@{commit}\t")

    # A flipped byte in the published blob is found by verify.
    blob = (path / "config.json").resolve()
    data = blob.read_bytes()
    blob.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    out = _cli("verify", f"org/cli@{commit}", env=env)
    assert out.returncode == 1 and "config.json: sha256" in out.stderr


def test_fetch_errors_are_clear(olah: MirrorFixture, tiny_model: Path, tmp_path: Path) -> None:
    olah.publish("org/cli-err", tiny_model)
    vol = str(tmp_path / "vol")
    out = _cli("fetch", "org/cli-err@main", "--mirror", olah.url, "--cache-dir", vol)
    assert out.returncode == 1
    assert "BRANCH_NOT_ALLOWED" in out.stderr and "--allow-branch" in out.stderr
    out = _cli("fetch", "org/cli-err", "--mirror", olah.url, "--cache-dir", vol)
    assert out.returncode == 1 and "a revision is required" in out.stderr
    out = _cli("fetch", "org/absent@" + "a" * 40, "--mirror", olah.url, "--cache-dir", vol)
    assert out.returncode == 1 and "REVISION_NOT_FOUND" in out.stderr
    out = _cli("fetch", "org/cli-err@" + "a" * 40, "--cache-dir", vol, "--offline")
    assert out.returncode == 1 and "OFFLINE" in out.stderr
    assert out.stdout == ""


def test_token_is_never_printed(olah: MirrorFixture, tiny_model: Path, tmp_path: Path) -> None:
    commit = olah.publish("org/cli-tok", tiny_model)
    token = tmp_path / "token"
    token.write_text("hf_secretsecretsecret\n")
    out = _cli(
        "fetch", f"org/cli-tok@{commit}", "--mirror", olah.url,
        "--cache-dir", str(tmp_path / "vol"), "--token-file", str(token), "--log-level", "DEBUG",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "secret" not in out.stdout + out.stderr


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1234", 1234), ("1K", 1000), ("500M", 500 * 10**6), ("2GiB", 2 * 2**30), ("1.5G", 1.5e9)],
)
def test_parse_size(text: str, expected: float) -> None:
    assert parse_size(text) == int(expected)


def test_parse_size_rejects_garbage() -> None:
    with pytest.raises(Exception, match="invalid size"):
        parse_size("ten gigs")


def test_serve_refuses_a_branch_model_at_startup(tmp_path: Path) -> None:
    out = _cli(
        "serve", "--cache-dir", str(tmp_path), "--offline", "--port", "0", "--model", "org/x@main"
    )
    assert out.returncode == 1
    assert "BRANCH_NOT_ALLOWED" in out.stderr and "--allow-branch" in out.stderr
