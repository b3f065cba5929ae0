"""Several sidecar processes on one volume: one download, both READY; kill -9 mid-fetch resumes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from inference_svc.testing.range_mirror import Fault, RangeMirror

from .conftest import write_safetensors

FLAGS = ["--chunk-bytes", "256Ki", "--backoff", "0.02", "--stall-timeout", "60"]


def _fetch(mirror: RangeMirror, model: str, vol: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "cache_sidecar.cli", "fetch", model, "--mirror", mirror.url,
         "--cache-dir", str(vol), *FLAGS],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _recorded_prefix(vol: Path) -> int:
    values = [0]
    for p in (vol / ".weightcache" / "tmp").glob("*.prefix"):
        with contextlib.suppress(ValueError, FileNotFoundError):
            values.append(int(p.read_text() or 0))
    return max(values)


def _repo(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "llama"}')
    write_safetensors(src / "model.safetensors", 1_000_000)  # 4 MB
    return src


def test_two_sidecars_download_once_and_both_publish(
    range_mirror: RangeMirror, tmp_path: Path
) -> None:
    src = _repo(tmp_path)
    commit = range_mirror.publish("org/shared", src)
    # A pause mid-file keeps the first fetch busy while the second one arrives.
    range_mirror.faults["model.safetensors"] = Fault(stall_s=1.0, stall_after=1_000_000)
    vol = tmp_path / "vol"
    procs = [_fetch(range_mirror, f"org/shared@{commit}", vol) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    paths = {out.strip().splitlines()[-1] for out, _ in outs}
    assert paths == {str(vol / "models--org--shared" / "snapshots" / commit)}
    size = (src / "model.safetensors").stat().st_size
    assert range_mirror.bytes_served["model.safetensors"] == size  # downloaded once
    assert range_mirror.bytes_served["config.json"] == (src / "config.json").stat().st_size


def test_kill_9_mid_fetch_then_restart_resumes(range_mirror: RangeMirror, tmp_path: Path) -> None:
    src = _repo(tmp_path)
    commit = range_mirror.publish("org/killed", src)
    size = (src / "model.safetensors").stat().st_size
    range_mirror.faults["model.safetensors"] = Fault(stall_s=30.0, stall_after=2_000_000)
    vol = tmp_path / "vol"
    snapshot = vol / "models--org--killed" / "snapshots" / commit
    proc = _fetch(range_mirror, f"org/killed@{commit}", vol)
    try:
        deadline = time.monotonic() + 60
        while range_mirror.bytes_served["model.safetensors"] < 2_000_000:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline
            assert not snapshot.exists()  # nothing visible while fetching
            time.sleep(0.02)
        # Kill once the client has recorded (hashed, written) most of what it received.
        while _recorded_prefix(vol) < 1_500_000:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not snapshot.exists()
    assert not (vol / ".weightcache" / "manifests" / "models--org--killed").exists()
    blobs = vol / "models--org--killed" / "blobs"
    sha = range_mirror.repos["org/killed"].files["model.safetensors"].sha256
    assert not (blobs / sha).exists()
    assert list(
        (vol / ".weightcache" / "tmp").glob(f"*{sha}*.part")
    )  # the partial temp stays hidden

    range_mirror.reset_counters()
    proc = _fetch(range_mirror, f"org/killed@{commit}", vol)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.strip().splitlines()[-1] == str(snapshot)
    assert (snapshot / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert (
        range_mirror.bytes_served["model.safetensors"] <= size - 1_500_000
    )  # resumed, not restarted
    assert list((vol / ".weightcache" / "tmp").glob("*.part")) == []
