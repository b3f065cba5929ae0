"""`inference-svc serve` as a process: port file, SERVING, SIGTERM drain and exit 0; bad flags."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.llm.v1 import inference_pb2 as pb
from protos.llm.v1 import inference_pb2_grpc as pb_grpc

from .conftest import long_request, read_port, spawn, wait_serving


def test_serve_local_dir_then_sigterm_drains_and_exits_zero(
    model_dir: Path, tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    port_file = tmp_path / "port"
    proc = spawn(
        ["inference_svc.cli", "serve", "--model-dir", str(model_dir), "--host", "127.0.0.1",
         "--port", "0", "--port-file", str(port_file), "--max-num-seqs", "2",
         "--kv-cache-memory", "8MiB", "--grace", "1"],
        {**os.environ, "INFERENCE_SVC_MAX_WAITING": "8"},  # every flag has an env variable
    )  # fmt: skip
    procs.append(proc)
    with grpc.insecure_channel(f"127.0.0.1:{read_port(port_file, proc)}") as ch:
        wait_serving(ch, proc)
        stub = pb_grpc.InferenceStub(ch)
        load = stub.GetLoad(pb.GetLoadRequest(), timeout=5)
        assert (load.max_waiting, load.draining) == (8, False)
        call = stub.Generate(long_request(max_new_tokens=3000), timeout=60)
        assert next(call).HasField("accepted")
        events: list[pb.GenerateEvent] = []
        reader = threading.Thread(target=lambda: events.extend(call), daemon=True)
        reader.start()
        proc.send_signal(signal.SIGTERM)
        reader.join(30)
        # Not done within the 1 s grace: aborted, and the client still got a Finished event.
        assert events[-1].finished.stop_reason == pb.STOP_REASON_CANCELLED
        assert proc.wait(timeout=30) == 0
        health = health_pb2_grpc.HealthStub(ch)
        try:
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE  # gone: nothing listens any more
        else:
            raise AssertionError(f"health still answers after exit: {status}")


def test_bad_flags_exit_2_with_a_message(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "inference_svc.cli", "serve", "--sidecar", "127.0.0.1:1",
         "--model", "org/name@main"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "expected 'org/name@<40-hex commit>'" in result.stderr


def test_missing_model_dir_exits_1(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "inference_svc.cli", "serve", "--model-dir",
         str(tmp_path / "nope"), "--host", "127.0.0.1", "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert "start-up failed" in result.stderr and "nope" in result.stderr
