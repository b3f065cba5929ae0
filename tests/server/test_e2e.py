"""Across processes: olah mirror -> `cache-sidecar serve` -> `inference-svc serve --sidecar` -> a
streaming Generate; the service leases the revision and releases it when SIGTERM drains it."""

from __future__ import annotations

import os
import signal
import subprocess
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


@pytest.mark.e2e
def test_mirror_sidecar_service_generate(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    model = cached_model(ModelSpec(family="llama", size="tiny"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with MirrorFixture() as mirror:
        commit = mirror.publish(REPO, model)
        sidecar_port_file = tmp_path / "sidecar.port"
        sidecar = spawn(
            ["cache_sidecar.cli", "serve", "--cache-dir", str(tmp_path / "vol"),
             "--mirror", mirror.url, "--host", "127.0.0.1", "--port", "0",
             "--port-file", str(sidecar_port_file), "--model", f"{REPO}@{commit}",
             "--grace", "1"],
            env,
        )  # fmt: skip
        # The sidecar pre-fetches --model; the service's Ensure joins that job or finds it READY.
        procs.append(sidecar)
        sidecar_addr = f"127.0.0.1:{read_port(sidecar_port_file, sidecar)}"
        port_file = tmp_path / "svc.port"
        service = spawn(
            ["inference_svc.cli", "serve", "--sidecar", sidecar_addr,
             "--model", f"{REPO}@{commit}", "--lease-holder", "pod-a", "--host", "127.0.0.1",
             "--port", "0", "--port-file", str(port_file), "--max-num-seqs", "4",
             "--kv-cache-memory", "4MiB", "--max-new-tokens", "8", "--grace", "5"],
            env,
        )  # fmt: skip
        procs.append(service)
        with grpc.insecure_channel(f"127.0.0.1:{read_port(port_file, service)}") as ch:
            wait_serving(ch, service)
            stub = pb_grpc.InferenceStub(ch)
            info = stub.ModelInfo(pb.ModelInfoRequest(), timeout=5)
            assert (info.model_id, info.revision) == (REPO, commit)
            with grpc.insecure_channel(sidecar_addr) as sc:
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
        sidecar.send_signal(signal.SIGTERM)
        assert sidecar.wait(timeout=30) == 0
