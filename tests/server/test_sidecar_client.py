"""What the service accepts from the sidecar: pinned references and READY statuses it can trust."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from inference_svc.server.sidecar_client import (
    SidecarClient,
    SidecarError,
    SidecarModel,
    check_ready,
    parse_model_ref,
)
from protos.weightcache.v1 import cache_pb2, cache_pb2_grpc

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


class _Sidecar(cache_pb2_grpc.WeightCacheServicer):
    """Answers Pin with a republished digest and counts the leases it holds."""

    def __init__(self) -> None:
        self.leases: set[str] = set()

    async def Pin(self, request: cache_pb2.PinRequest, context: Any) -> cache_pb2.RevisionStatus:
        self.leases.add(request.lease_holder)
        return cache_pb2.RevisionStatus(commit=COMMIT, manifest_digest="sha256:" + "cd" * 32)

    async def Unpin(self, request: cache_pb2.PinRequest, context: Any) -> cache_pb2.RevisionStatus:
        self.leases.discard(request.lease_holder)
        return cache_pb2.RevisionStatus(commit=COMMIT)


def test_a_lease_refused_for_a_changed_digest_is_given_back(tmp_path: Path) -> None:
    async def main() -> set[str]:
        sidecar = _Sidecar()
        server = grpc.aio.server()
        cache_pb2_grpc.add_WeightCacheServicer_to_server(sidecar, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = SidecarClient(f"127.0.0.1:{port}", "test-holder")
        try:
            with pytest.raises(SidecarError, match="manifest digest changed"):
                await client.lease(SidecarModel("org/name", COMMIT, tmp_path, DIGEST))
            return sidecar.leases
        finally:
            await client.close()
            await server.stop(0)

    assert asyncio.run(main()) == set()
