"""Server fixtures: a real grpc.aio server on 127.0.0.1:0 in a background event loop thread.

The model has a long context (4096) so "long" requests reliably outlive a cancel or a deadline.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inference_svc.server.app import InferenceServer, ServerConfig
from inference_svc.testing.models import ModelSpec, cached_model
from protos.llm.v1 import inference_pb2 as pb
from protos.llm.v1 import inference_pb2_grpc as pb_grpc

T = TypeVar("T")
SPEC = ModelSpec(family="llama", size="tiny", dtype="float32", max_position_embeddings=4096)
# Enough for every test's sequences at once; small so the engine builds fast.
KV_BYTES = 8 * 4096 * 512


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return cached_model(SPEC)


class BackgroundServer:
    """An InferenceServer on its own event loop in a daemon thread."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server: InferenceServer = self.call(self._make(cfg))
        self.stopped = False

    @staticmethod
    async def _make(cfg: ServerConfig) -> InferenceServer:
        return InferenceServer(cfg)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def close(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.call(self.server.drain(0.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def make_config(model_dir: Path, **overrides: Any) -> ServerConfig:
    options: dict[str, Any] = {
        "model_dir": model_dir,
        "host": "127.0.0.1",
        "port": 0,
        "max_num_seqs": 4,
        "max_waiting": 4,
        "max_num_batched_tokens": 256,
        "kv_cache_memory": KV_BYTES,
        "max_new_tokens": 16,
        "grace_s": 5.0,
    }
    options.update(overrides)
    return ServerConfig(**options)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[BackgroundServer]:
    bg = BackgroundServer(make_config(model_dir))
    try:
        bg.call(bg.server.start())
        bg.call(bg.server.load())
        yield bg
    finally:
        bg.close()


@pytest.fixture(scope="module")
def channel(server: BackgroundServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> pb_grpc.InferenceStub:
    return pb_grpc.InferenceStub(channel)


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Poll until true; the timeout only bounds a hang, it is not what the test asserts."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def wait_idle(stub: pb_grpc.InferenceStub) -> pb.LoadResponse:
    """Wait until nothing runs or waits and no KV block is in use; returns that load."""
    box: list[pb.LoadResponse] = []

    def idle() -> bool:
        load = stub.GetLoad(pb.GetLoadRequest(), timeout=5)
        box[:] = [load]
        return load.running == 0 and load.waiting == 0 and load.kv_usage == 0

    wait_until(idle, "the engine to be idle")
    return box[0]


def long_request(request_id: str = "", max_new_tokens: int = 4000) -> pb.GenerateRequest:
    """A request that runs for seconds: thousands of tokens with EOS ignored."""
    return pb.GenerateRequest(
        request_id=request_id,
        token_ids=pb.TokenIds(ids=[5, 6, 7, 8]),
        stopping=pb.StoppingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
    )


def read_port(path: Path, proc: subprocess.Popen[str], timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        text = path.read_text().strip() if path.exists() else ""
        if text.isdigit():
            return int(text)
        if proc.poll() is not None:
            _, err = proc.communicate()
            raise AssertionError(f"process exited {proc.returncode}:\n{err[-3000:]}")
        assert time.monotonic() < deadline, f"no port in {path}"
        time.sleep(0.05)


def wait_serving(channel: grpc.Channel, proc: subprocess.Popen[str], timeout_s: float = 60) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        if proc.poll() is not None:
            _, err = proc.communicate()
            raise AssertionError(f"process exited {proc.returncode}:\n{err[-3000:]}")
        assert time.monotonic() < deadline, "never SERVING"
        time.sleep(0.1)


def spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts; killed at the end if still running."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in reversed(started):
        if proc.poll() is None:
            proc.kill()
            proc.wait()
