"""The server process shape: health NOT_SERVING until warm, reflection, drain on stop."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from inference_svc.server.app import SERVICES, ServerConfig
from protos.llm.v1 import inference_pb2 as pb
from protos.llm.v1 import inference_pb2_grpc as pb_grpc

from .conftest import BackgroundServer, long_request, make_config, wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
NAMES = ("", "llm.v1.Inference", "fmaas.GenerationService")


def _health(channel: grpc.Channel, name: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return int(stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status)


def test_health_not_serving_until_loaded_then_serving(model_dir: Path) -> None:
    bg = BackgroundServer(make_config(model_dir))
    try:
        bg.call(bg.server.start())
        with grpc.insecure_channel(bg.address) as ch:
            assert [_health(ch, n) for n in NAMES] == [NOT_SERVING] * 3
            with pytest.raises(grpc.RpcError) as info:
                list(pb_grpc.InferenceStub(ch).Generate(long_request(), timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "loading" in info.value.details()
            bg.call(bg.server.load())
            assert [_health(ch, n) for n in NAMES] == [SERVING] * 3
            with pytest.raises(grpc.RpcError) as info:
                _health(ch, "no.such.Service")
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        bg.close()


def test_reflection_lists_the_services(model_dir: Path) -> None:
    bg = BackgroundServer(make_config(model_dir))
    try:
        bg.call(bg.server.start())
        with grpc.insecure_channel(bg.address) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            req = reflection_pb2.ServerReflectionRequest(list_services="")
            (resp,) = list(stub.ServerReflectionInfo(iter([req]), timeout=5))
            names = {s.name for s in resp.list_services_response.service}
            assert {*SERVICES, "grpc.health.v1.Health"} <= names
            assert SERVICES == ("llm.v1.Inference", "fmaas.GenerationService")
            # A client can fetch the schema of a service it has no stubs for.
            req = reflection_pb2.ServerReflectionRequest(file_containing_symbol="llm.v1.Inference")
            (resp,) = list(stub.ServerReflectionInfo(iter([req]), timeout=5))
            assert resp.file_descriptor_response.file_descriptor_proto
    finally:
        bg.close()


def test_drain_finishes_in_flight_refuses_new_and_aborts_at_grace(model_dir: Path) -> None:
    bg = BackgroundServer(make_config(model_dir, grace_s=3.0))
    try:
        bg.call(bg.server.start())
        bg.call(bg.server.load())
        with grpc.insecure_channel(bg.address) as ch:
            stub = pb_grpc.InferenceStub(ch)
            short_req = pb.GenerateRequest(
                text="short", stopping=pb.StoppingParams(max_new_tokens=20, ignore_eos=True)
            )
            results: dict[str, list[pb.GenerateEvent]] = {}

            def consume(name: str, call: Any) -> None:
                results[name] = list(call)

            calls = {"long": stub.Generate(long_request(), timeout=60)}
            assert next(calls["long"]).HasField("accepted")
            calls["short"] = stub.Generate(short_req, timeout=60)
            assert next(calls["short"]).HasField("accepted")
            threads = [threading.Thread(target=consume, args=kv) for kv in calls.items()]
            for t in threads:
                t.start()
            drained = bg.submit(bg.server.drain())
            wait_until(lambda: bg.server.state.draining, "draining")
            assert [_health(ch, n) for n in NAMES] == [NOT_SERVING] * 3
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(short_req, timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in info.value.details()
            assert stub.GetLoad(pb.GetLoadRequest(), timeout=5).draining
            for t in threads:
                t.join(60)
            # The short request finished normally; the long one was aborted at the grace period.
            assert results["short"][-1].finished.stop_reason == pb.STOP_REASON_MAX_TOKENS
            assert results["short"][-1].finished.usage.completion_tokens == 20
            assert results["long"][-1].finished.stop_reason == pb.STOP_REASON_CANCELLED
            assert drained.result(30) is False
        bg.stopped = True
    finally:
        bg.close()


def test_config_needs_exactly_one_weight_source(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="exactly one of --model-dir and --sidecar"):
        ServerConfig()
    with pytest.raises(ValueError, match="exactly one"):
        ServerConfig(model_dir=model_dir, sidecar="127.0.0.1:1", model_ref="a/b@" + "0" * 40)
    with pytest.raises(ValueError, match="needs --model"):
        ServerConfig(sidecar="127.0.0.1:1")
    with pytest.raises(ValueError, match="40-hex commit"):
        ServerConfig(sidecar="127.0.0.1:1", model_ref="org/name@main")


def test_a_taken_port_fails_to_bind(model_dir: Path, server: BackgroundServer) -> None:
    second = BackgroundServer(make_config(model_dir, port=server.server.port))
    try:
        with pytest.raises((OSError, RuntimeError)):
            second.call(second.server.start())
    finally:
        second.stopped = True  # never started
        second.close()


def test_health_not_serving_once_the_engine_thread_dies(model_dir: Path) -> None:
    """A replica whose engine crashed refuses everything; probes must take it out."""
    bg = BackgroundServer(make_config(model_dir))
    try:
        bg.call(bg.server.start())
        bg.call(bg.server.load())
        with grpc.insecure_channel(bg.address) as ch:
            assert [_health(ch, n) for n in NAMES] == [SERVING] * 3

            def crash() -> None:
                raise RuntimeError("injected engine failure")

            bg.server.state.model.engine._call(crash)
            wait_until(lambda: _health(ch, "") == NOT_SERVING, "health NOT_SERVING")
            assert [_health(ch, n) for n in NAMES] == [NOT_SERVING] * 3
            with pytest.raises(grpc.RpcError) as info:
                list(pb_grpc.InferenceStub(ch).Generate(long_request(), timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        bg.close()
