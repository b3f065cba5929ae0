"""What the service accepts from the sidecar: pinned references and READY statuses it can trust."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference_svc.server.sidecar_client import (
    SidecarError,
    SidecarModel,
    check_ready,
    parse_model_ref,
)
from protos.weightcache.v1 import cache_pb2

COMMIT = "0123456789abcdef0123456789abcdef01234567"
DIGEST = "sha256:" + "ab" * 32


def test_parse_model_ref_takes_pinned_commits_only() -> None:
    assert parse_model_ref(f"org/name@{COMMIT}") == ("org/name", COMMIT)
    for bad in ("org/name@main", "org/name", f"name@{COMMIT}", f"org/name@{COMMIT.upper()}"):
        with pytest.raises(ValueError, match="expected 'org/name@<40-hex commit>'"):
            parse_model_ref(bad)


def _status(path: Path, **fields: object) -> cache_pb2.RevisionStatus:
    base: dict[str, object] = {
        "repo": "org/name",
        "commit": COMMIT,
        "state": cache_pb2.READY,
        "local_path": str(path),
        "manifest_digest": DIGEST,
    }
    base.update(fields)
    return cache_pb2.RevisionStatus(**base)  # type: ignore[arg-type]


def test_check_ready_accepts_a_verified_snapshot(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert check_ready(_status(tmp_path), "org/name", COMMIT) == SidecarModel(
        "org/name", COMMIT, tmp_path, DIGEST
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"commit": "f" * 40}, "reports commit 'ffff"),
        ({"manifest_digest": ""}, "reports no manifest digest"),
        ({"manifest_digest": "md5:abc"}, "reports no manifest digest"),
        ({"local_path": "/nonexistent/snapshot"}, "has no config.json"),
    ],
)
def test_check_ready_refuses_what_it_cannot_trust(
    tmp_path: Path, fields: dict[str, object], message: str
) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SidecarError, match=message):
        check_ready(_status(tmp_path, **fields), "org/name", COMMIT)
