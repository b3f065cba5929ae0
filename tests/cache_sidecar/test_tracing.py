"""Traces of the sidecar's gRPC server: a real server on loopback with an in-memory exporter."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from cache_sidecar.server import SidecarServer
from inference_svc.server.tracing import Tracing
from protos.weightcache.v1 import cache_pb2, cache_pb2_grpc

from .conftest import make_cache


@pytest.fixture
def traced(tmp_path: Path) -> Iterator[tuple[grpc.Channel, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    tracing = Tracing.with_exporter(exporter, "sidecar-under-test")
    server = SidecarServer(make_cache(tmp_path / "vol", None), [], tracing=tracing)
    port = server.start("127.0.0.1:0")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel, exporter
    finally:
        channel.close()
        server.stop(1.0)


def _names(exporter: InMemorySpanExporter) -> list[str]:
    return [s.name for s in exporter.get_finished_spans()]


def _only(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    (span,) = [s for s in exporter.get_finished_spans() if s.name == name]
    return span


def test_list_makes_a_server_span_and_health_none(
    traced: tuple[grpc.Channel, InMemorySpanExporter],
) -> None:
    channel, exporter = traced
    health = health_pb2_grpc.HealthStub(channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    listed = cache_pb2_grpc.WeightCacheStub(channel).List(cache_pb2.ListRequest(), timeout=5)
    assert list(listed.revisions) == []

    # The sync server ends a unary span before it sends the response: both are in by now.
    assert _names(exporter) == ["/weightcache.v1.WeightCache/List"]
    span = _only(exporter, "/weightcache.v1.WeightCache/List")
    assert span.kind == SpanKind.SERVER
    assert span.resource.attributes["service.name"] == "sidecar-under-test"
    attrs = span.attributes or {}
    assert attrs["rpc.system"] == "grpc"
    assert attrs["rpc.service"] == "weightcache.v1.WeightCache"
    assert attrs["rpc.method"] == "List"
    assert attrs["rpc.grpc.status_code"] == grpc.StatusCode.OK.value[0]


def test_a_refused_call_records_its_code(
    traced: tuple[grpc.Channel, InMemorySpanExporter],
) -> None:
    channel, exporter = traced
    bad = cache_pb2.StatusRequest(model=cache_pb2.ModelRef(repo="../escape", revision="main"))
    with pytest.raises(grpc.RpcError) as info:
        cache_pb2_grpc.WeightCacheStub(channel).Status(bad, timeout=5)
    span = _only(exporter, "/weightcache.v1.WeightCache/Status")
    assert (span.attributes or {})["rpc.grpc.status_code"] == info.value.code().value[0]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_tracing_is_off_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    server = SidecarServer(make_cache(tmp_path / "vol", None), [])
    try:
        assert not server.tracing.enabled
    finally:
        server.stop(0)
