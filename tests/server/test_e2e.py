"""Across processes: olah mirror -> `cache-sidecar serve` -> `inference-svc serve --sidecar` -> a
streaming Generate; the service leases the revision and releases it when SIGTERM drains it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from inference_svc.testing.mirror import MirrorFixture
from inference_svc.testing.models import ModelSpec, cached_model
from protos.llm.v1 import inference_pb2 as pb
from protos.llm.v1 import inference_pb2_grpc as pb_grpc
from protos.weightcache.v1 import cache_pb2, cache_pb2_grpc

from .conftest import read_port, spawn, wait_serving

REPO = "org/tiny-llama"
# The sidecar's gRPC server is built in parallel; until it exists this test cannot run.
pytest.importorskip("cache_sidecar.server", reason="cache_sidecar.server is not there yet")


@dataclass(frozen=True)
class Stack:
    commit: str
    sidecar_addr: str
    env: dict[str, str]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """olah with the tiny model published, and a `cache-sidecar serve` process pre-fetching it."""
    tmp = tmp_path_factory.mktemp("e2e")
    model = cached_model(ModelSpec(family="llama", size="tiny"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with MirrorFixture() as mirror:
        commit = mirror.publish(REPO, model)
        port_file = tmp / "sidecar.port"
        sidecar = spawn(
            ["cache_sidecar.cli", "serve", "--cache-dir", str(tmp / "vol"),
             "--mirror", mirror.url, "--host", "127.0.0.1", "--port", "0",
             "--port-file", str(port_file), "--model", f"{REPO}@{commit}", "--grace", "1"],
            env,
        )  # fmt: skip
        try:
            yield Stack(commit, f"127.0.0.1:{read_port(port_file, sidecar)}", env)
            sidecar.send_signal(signal.SIGTERM)
            assert sidecar.wait(timeout=30) == 0
        finally:
            if sidecar.poll() is None:
                sidecar.kill()
                sidecar.wait()


@pytest.mark.e2e
def test_mirror_sidecar_service_generate(
    stack: Stack, tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    commit = stack.commit
    port_file = tmp_path / "svc.port"
    # The sidecar pre-fetches the revision; the service's Ensure joins that job or finds it READY.
    service = spawn(
        ["inference_svc.cli", "serve", "--sidecar", stack.sidecar_addr,
         "--model", f"{REPO}@{commit}", "--lease-holder", "pod-a", "--host", "127.0.0.1",
         "--port", "0", "--port-file", str(port_file), "--max-num-seqs", "4",
         "--kv-cache-memory", "4MiB", "--max-new-tokens", "8", "--grace", "5"],
        stack.env,
    )  # fmt: skip
    procs.append(service)
    with grpc.insecure_channel(f"127.0.0.1:{read_port(port_file, service)}") as ch:
        wait_serving(ch, service)
        stub = pb_grpc.InferenceStub(ch)
        info = stub.ModelInfo(pb.ModelInfoRequest(), timeout=5)
        assert (info.model_id, info.revision) == (REPO, commit)
        with grpc.insecure_channel(stack.sidecar_addr) as sc:
            cache = cache_pb2_grpc.WeightCacheStub(sc)
            ref = cache_pb2.ModelRef(repo=REPO, revision=commit)
            status = cache.Status(cache_pb2.StatusRequest(model=ref), timeout=5)
            assert status.state == cache_pb2.READY and status.leases == 1
            assert info.manifest_digest == status.manifest_digest
            assert info.manifest_digest.startswith("sha256:")
            events = list(stub.Generate(pb.GenerateRequest(text="hello world"), timeout=60))
            kinds = [e.WhichOneof("event") for e in events]
            assert kinds[0] == "accepted" and kinds[-1] == "finished"
            assert set(kinds[1:-1]) == {"token"}
            assert events[-1].finished.usage.completion_tokens == len(kinds) - 2
            service.send_signal(signal.SIGTERM)
            assert service.wait(timeout=30) == 0
            # Draining released the lease.
            status = cache.Status(cache_pb2.StatusRequest(model=ref), timeout=5)
            assert status.leases == 0


@pytest.mark.e2e
def test_revision_the_mirror_lacks_fails_start_up_fast(stack: Stack) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "inference_svc.cli", "serve", "--sidecar", stack.sidecar_addr,
         "--model", f"org/absent@{stack.commit}", "--host", "127.0.0.1", "--port", "0",
         "--sidecar-timeout", "60"],
        env=stack.env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert "start-up failed" in result.stderr and "REVISION_NOT_FOUND" in result.stderr
