"""The gRPC sidecar in-process and as a process: Ensure/Watch/Status/List/Pin/Evict, health, SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cache_sidecar.refs import ModelRef
from cache_sidecar.server import SERVICE, SidecarServer
from inference_svc.testing.mirror import MirrorFixture
from inference_svc.testing.range_mirror import RangeMirror
from protos.weightcache.v1 import cache_pb2, cache_pb2_grpc

from .conftest import make_cache, small_repo

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _health(channel: grpc.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _wait_health(
    channel: grpc.Channel, want: int, service: str = "", timeout_s: float = 60
) -> None:
    deadline = time.monotonic() + timeout_s
    while _health(channel, service) != want:
        assert time.monotonic() < deadline, f"health({service!r}) never became {want}"
        time.sleep(0.05)


@pytest.fixture
def served(
    olah: MirrorFixture, tiny_model: Path, tmp_path: Path
) -> Iterator[tuple[grpc.Channel, str, SidecarServer]]:
    commit = olah.publish("org/srv", tiny_model)
    server = SidecarServer(make_cache(tmp_path / "vol", olah.url), [ModelRef("org/srv", commit)])
    port = server.start("127.0.0.1:0")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel, commit, server
    finally:
        channel.close()
        server.stop(1.0)


def _model(commit: str, repo: str = "org/srv") -> cache_pb2.ModelRef:
    return cache_pb2.ModelRef(repo=repo, revision=commit)


def test_configured_revision_becomes_ready_via_health_and_watch(
    served: tuple[grpc.Channel, str, SidecarServer], tiny_model: Path
) -> None:
    channel, commit, _ = served
    stub = cache_pb2_grpc.WeightCacheStub(channel)
    states = []
    for status in stub.Watch(cache_pb2.WatchRequest(model=_model(commit)), timeout=60):
        states.append(status.state)
        if status.state == cache_pb2.READY:
            break
    assert states[-1] == cache_pb2.READY
    assert status.commit == commit
    assert status.manifest_digest.startswith("sha256:")
    assert (Path(status.local_path) / "config.json").read_bytes() == (
        tiny_model / "config.json"
    ).read_bytes()
    assert status.files_done == status.files_total > 0
    assert status.bytes_done == status.bytes_total == status.size_bytes > 0
    _wait_health(channel, SERVING)
    assert _health(channel, SERVICE) == SERVING
    assert _health(channel, f"{SERVICE}/org/srv@{commit}") == SERVING
    assert _health(channel, "liveness") == SERVING

    listed = stub.List(cache_pb2.ListRequest(), timeout=5)
    assert [(r.repo, r.commit) for r in listed.revisions] == [("org/srv", commit)]
    assert listed.used_bytes >= status.size_bytes


def test_ensure_streams_progress_and_errors(
    served: tuple[grpc.Channel, str, SidecarServer], olah: MirrorFixture, tiny_model: Path
) -> None:
    channel, commit, _ = served
    stub = cache_pb2_grpc.WeightCacheStub(channel)
    other = olah.publish("org/srv2", tiny_model)
    stream = list(stub.Ensure(cache_pb2.EnsureRequest(model=_model(other, "org/srv2")), timeout=60))
    assert stream[-1].state == cache_pb2.READY and stream[-1].commit == other
    absent = list(
        stub.Ensure(cache_pb2.EnsureRequest(model=_model("b" * 40, "org/nothere")), timeout=60)
    )
    assert absent[-1].state == cache_pb2.FAILED
    assert absent[-1].error_code == cache_pb2.REVISION_NOT_FOUND
    assert "not found" in absent[-1].error_message
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Ensure(cache_pb2.EnsureRequest(model=_model("main")), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "40-hex" in (err.value.details() or "")
    with pytest.raises(grpc.RpcError) as err:
        stub.Status(cache_pb2.StatusRequest(model=_model(commit, "../etc")), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_pin_lease_and_evict(served: tuple[grpc.Channel, str, SidecarServer]) -> None:
    channel, commit, _ = served
    stub = cache_pb2_grpc.WeightCacheStub(channel)
    list(stub.Ensure(cache_pb2.EnsureRequest(model=_model(commit)), timeout=60))
    pinned = stub.Pin(cache_pb2.PinRequest(model=_model(commit)), timeout=5)
    assert pinned.pinned
    leased = stub.Pin(cache_pb2.PinRequest(model=_model(commit), lease_holder="pod-a"), timeout=5)
    assert leased.leases == 1
    refused = stub.Evict(cache_pb2.EvictRequest(model=_model(commit), force=True), timeout=5)
    assert not refused.evicted and "leased by pod-a" in refused.message
    stub.Unpin(cache_pb2.PinRequest(model=_model(commit), lease_holder="pod-a"), timeout=5)
    refused = stub.Evict(cache_pb2.EvictRequest(model=_model(commit)), timeout=5)
    assert not refused.evicted and "pinned" in refused.message
    done = stub.Evict(cache_pb2.EvictRequest(model=_model(commit), force=True), timeout=5)
    assert done.evicted and done.freed_bytes > 0
    status = stub.Status(cache_pb2.StatusRequest(model=_model(commit)), timeout=5)
    assert status.state == cache_pb2.EVICTED
    assert stub.List(cache_pb2.ListRequest(), timeout=5).revisions == []


def test_reflection_lists_the_services(served: tuple[grpc.Channel, str, SidecarServer]) -> None:
    channel, _, _ = served
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    req = reflection_pb2.ServerReflectionRequest(list_services="")
    (resp,) = list(stub.ServerReflectionInfo(iter([req]), timeout=5))
    names = {s.name for s in resp.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names


def test_mirror_down_not_serving_then_ready_when_it_returns(tmp_path: Path) -> None:
    mirror = RangeMirror()
    mirror.start()
    commit = mirror.publish("org/down", small_repo(tmp_path / "src"))
    mirror.stop()  # down before the sidecar starts
    server = SidecarServer(make_cache(tmp_path / "vol", mirror.url), [ModelRef("org/down", commit)])
    server.jobs.retry_max_s = 0.2
    port = server.start("127.0.0.1:0")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = cache_pb2_grpc.WeightCacheStub(channel)
    try:
        deadline = time.monotonic() + 30
        while True:
            status = stub.Status(
                cache_pb2.StatusRequest(model=_model(commit, "org/down")), timeout=5
            )
            if status.error_code == cache_pb2.MIRROR_UNREACHABLE:
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert status.state == cache_pb2.PENDING
        assert (
            "cannot reach the mirror" in status.error_message and "retrying" in status.error_message
        )
        assert _health(channel) == NOT_SERVING
        mirror.start()  # same port
        _wait_health(channel, SERVING, timeout_s=30)
        assert (
            stub.Status(cache_pb2.StatusRequest(model=_model(commit, "org/down")), timeout=5).state
            == cache_pb2.READY
        )
    finally:
        channel.close()
        server.stop(1.0)
        mirror.stop()


def test_serve_process_offline_and_sigterm(
    olah: MirrorFixture, tiny_model: Path, tmp_path: Path
) -> None:
    commit = olah.publish("org/proc", tiny_model)
    vol = tmp_path / "vol"
    make_cache(vol, olah.url).ensure(ModelRef("org/proc", commit))
    port_file = tmp_path / "port"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CACHE_SIDECAR_MODELS": f"org/proc@{commit}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cache_sidecar.cli", "serve", "--cache-dir", str(vol),
         "--port", "0", "--host", "127.0.0.1", "--port-file", str(port_file), "--grace", "1"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        channel = grpc.insecure_channel(f"127.0.0.1:{port_file.read_text()}")
        _wait_health(channel, SERVING)
        stub = cache_pb2_grpc.WeightCacheStub(channel)
        missing = list(
            stub.Ensure(cache_pb2.EnsureRequest(model=_model("c" * 40, "org/proc")), timeout=10)
        )
        assert missing[-1].state == cache_pb2.FAILED and missing[-1].error_code == cache_pb2.OFFLINE
        channel.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_corruption_fails_over_grpc_then_succeeds_once_fixed(tmp_path: Path) -> None:
    from inference_svc.testing.range_mirror import Fault

    with RangeMirror() as mirror:
        commit = mirror.publish("org/corrupt", small_repo(tmp_path / "src"))
        mirror.faults["model.safetensors"] = Fault(corrupt_offset=123_456)
        server = SidecarServer(make_cache(tmp_path / "vol", mirror.url), [])
        port = server.start("127.0.0.1:0")
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = cache_pb2_grpc.WeightCacheStub(channel)
        try:
            req = cache_pb2.EnsureRequest(model=_model(commit, "org/corrupt"))
            failed = list(stub.Ensure(req, timeout=60))[-1]
            assert failed.state == cache_pb2.FAILED
            assert failed.error_code == cache_pb2.CHECKSUM_MISMATCH
            assert failed.error_message.startswith("model.safetensors: sha256 mismatch, expected ")
            assert (
                failed.local_path == ""
                and not (tmp_path / "vol" / "models--org--corrupt" / "snapshots").exists()
            )
            del mirror.faults["model.safetensors"]
            ready = list(stub.Ensure(req, timeout=60))[-1]
            assert ready.state == cache_pb2.READY and ready.error_message == ""
            assert (Path(ready.local_path) / "model.safetensors").read_bytes() == (
                tmp_path / "src" / "model.safetensors"
            ).read_bytes()
        finally:
            channel.close()
            server.stop(1.0)
