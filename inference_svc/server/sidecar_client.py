"""Waiting on the weight-cache sidecar: Ensure until READY, check what it reports, hold a lease.

The service never downloads weights itself; it reads the snapshot the sidecar published, and
its lease (Pin with a lease_holder) keeps that revision from eviction while it is served.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from protos.weightcache.v1 import cache_pb2, cache_pb2_grpc

log = logging.getLogger(__name__)

_REF_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)@([0-9a-f]{40})$")
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
# Sidecar answers worth waiting through: it is starting, restarting, or the mirror is away.
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
# FAILED states that may clear by themselves (the mirror returns, eviction frees space); the
# others (not found, checksum mismatch, unsafe repository, offline) will not, so fail fast.
_RETRYABLE_FAILURES = {cache_pb2.MIRROR_UNREACHABLE, cache_pb2.DISK_FULL, cache_pb2.INTERNAL}


class SidecarError(RuntimeError):
    """The sidecar could not provide the revision; the message says why and what to check."""


@dataclass(frozen=True)
class SidecarModel:
    repo: str
    commit: str
    local_path: Path
    manifest_digest: str


def parse_model_ref(text: str) -> tuple[str, str]:
    """'org/name@<40-hex commit>' -> (repo, commit). The service serves pinned commits only."""
    m = _REF_RE.match(text.strip())
    if not m:
        raise ValueError(
            f"--model {text!r}: expected 'org/name@<40-hex commit>' (branches are resolved by "
            "the sidecar's operator, never followed by the service)"
        )
    return m.group(1), m.group(2)


def check_ready(status: cache_pb2.RevisionStatus, repo: str, commit: str) -> SidecarModel:
    """Refuse a READY status that does not name the commit asked for, a digest and a snapshot."""
    where = f"{repo}@{commit}"
    if status.commit != commit:
        raise SidecarError(f"{where}: the sidecar reports commit {status.commit!r}")
    if not _DIGEST_RE.match(status.manifest_digest):
        raise SidecarError(
            f"{where}: the sidecar reports no manifest digest ({status.manifest_digest!r}); "
            "the revision is not verified"
        )
    path = Path(status.local_path)
    if not (path / "config.json").is_file():
        raise SidecarError(f"{where}: local_path {str(path)!r} has no config.json")
    return SidecarModel(repo, commit, path, status.manifest_digest)


class SidecarClient:
    def __init__(self, address: str, lease_holder: str) -> None:
        self.address = address
        self.lease_holder = lease_holder
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = cache_pb2_grpc.WeightCacheStub(self._channel)

    async def ensure(self, repo: str, commit: str, timeout_s: float) -> SidecarModel:
        """Stream Ensure until READY; retry while the sidecar is unreachable, up to timeout_s."""
        ref = cache_pb2.ModelRef(repo=repo, revision=commit)
        deadline = time.monotonic() + timeout_s
        backoff = 0.2
        last = "no answer"
        while True:
            try:
                async for status in self._stub.Ensure(
                    cache_pb2.EnsureRequest(model=ref),
                    timeout=max(deadline - time.monotonic(), 0.1),
                    wait_for_ready=True,
                ):
                    log.info(
                        "sidecar %s@%s: %s %d/%d bytes",
                        repo,
                        commit[:12],
                        cache_pb2.State.Name(status.state),
                        status.bytes_done,
                        status.bytes_total,
                    )
                    if status.state == cache_pb2.READY:
                        return check_ready(status, repo, commit)
                    if status.state == cache_pb2.FAILED:
                        last = (
                            f"the sidecar failed to provide it "
                            f"({cache_pb2.ErrorCode.Name(status.error_code)}): "
                            f"{status.error_message}"
                        )
                        if status.error_code not in _RETRYABLE_FAILURES:
                            raise SidecarError(f"{repo}@{commit}: {last}")
                        log.warning("%s@%s: %s; retrying", repo, commit[:12], last)
                        break
            except grpc.aio.AioRpcError as e:
                last = f"sidecar {self.address}: {e.code().name} {e.details()}"
                if e.code() not in _RETRYABLE:
                    raise SidecarError(f"{repo}@{commit}: Ensure failed: {last}") from None
            if time.monotonic() >= deadline:
                raise SidecarError(f"{repo}@{commit}: not READY after {timeout_s:g}s; last: {last}")
            await asyncio.sleep(min(backoff, max(deadline - time.monotonic(), 0.0)))
            backoff = min(backoff * 2, 5.0)

    async def lease(self, model: SidecarModel) -> None:
        status = await self._stub.Pin(
            cache_pb2.PinRequest(
                model=cache_pb2.ModelRef(repo=model.repo, revision=model.commit),
                lease_holder=self.lease_holder,
            ),
            timeout=30,
        )
        # The lease must be on the revision we load; a changed digest means it was republished.
        if status.manifest_digest and status.manifest_digest != model.manifest_digest:
            await self.release(model)  # the Pin took a lease; the caller will not hold it
            raise SidecarError(
                f"{model.repo}@{model.commit}: manifest digest changed from "
                f"{model.manifest_digest} to {status.manifest_digest} while leasing"
            )

    async def release(self, model: SidecarModel) -> None:
        try:
            await self._stub.Unpin(
                cache_pb2.PinRequest(
                    model=cache_pb2.ModelRef(repo=model.repo, revision=model.commit),
                    lease_holder=self.lease_holder,
                ),
                timeout=5,
            )
        except grpc.aio.AioRpcError as e:  # the sidecar may be gone first at pod shutdown
            log.warning("could not release the lease on %s: %s", model.commit, e.code().name)

    async def close(self) -> None:
        await self._channel.close()
