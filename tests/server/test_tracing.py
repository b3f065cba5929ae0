"""Traces of the inference server: a real server on loopback with an in-memory span exporter."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from inference_svc.server.app import InferenceServer, ServerConfig
from inference_svc.server.tracing import Tracing, TracingConfig
from protos.fmaas import generation_pb2 as tg
from protos.fmaas import generation_pb2_grpc as tg_grpc
from protos.llm.v1 import inference_pb2 as pb
from protos.llm.v1 import inference_pb2_grpc as pb_grpc

from .conftest import BackgroundServer, long_request, make_config, wait_idle, wait_until

GENERATE = "/llm.v1.Inference/Generate"


class TracedServer(BackgroundServer):
    """The conftest server, built with a given Tracing instead of the environment's."""

    def __init__(self, cfg: ServerConfig, tracing: Tracing) -> None:
        self.tracing = tracing
        super().__init__(cfg)

    async def _make(self, cfg: ServerConfig) -> InferenceServer:  # type: ignore[override]
        return InferenceServer(cfg, tracing=self.tracing)


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def traced(model_dir: Path, exporter: InMemorySpanExporter) -> Iterator[TracedServer]:
    bg = TracedServer(make_config(model_dir), Tracing.with_exporter(exporter, "svc-under-test"))
    try:
        bg.call(bg.server.start())
        bg.call(bg.server.load())
        yield bg
    finally:
        bg.close()


@pytest.fixture(scope="module")
def channel(traced: TracedServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(traced.address) as ch:
        yield ch


def _spans(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def _wait_span(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    # The server ends the span just after the client has its last message.
    wait_until(lambda: bool(_spans(exporter, name)), f"a {name} span")
    (span,) = _spans(exporter, name)
    return span


def _children(exporter: InMemorySpanExporter, parent: ReadableSpan) -> list[ReadableSpan]:
    ctx = parent.get_span_context()
    assert ctx is not None
    return [
        s
        for s in exporter.get_finished_spans()
        if s.parent is not None and s.parent.span_id == ctx.span_id
    ]


def _model_id(channel: grpc.Channel) -> str:
    return pb_grpc.InferenceStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=10).model_id


def test_generate_span_has_a_genai_child_with_phase_events(
    channel: grpc.Channel, exporter: InMemorySpanExporter
) -> None:
    model_id = _model_id(channel)
    exporter.clear()
    request = pb.GenerateRequest(
        request_id="traced-1",
        token_ids=pb.TokenIds(ids=[5, 6, 7, 8, 9]),
        stopping=pb.StoppingParams(max_new_tokens=6, ignore_eos=True),
    )
    events = list(pb_grpc.InferenceStub(channel).Generate(request, timeout=60))
    streamed = sum(len(e.token.token_ids) for e in events if e.HasField("token"))
    assert streamed == 6

    rpc = _wait_span(exporter, GENERATE)
    assert rpc.kind == SpanKind.SERVER
    assert rpc.resource.attributes["service.name"] == "svc-under-test"
    assert (rpc.attributes or {})["rpc.service"] == "llm.v1.Inference"
    assert (rpc.attributes or {})["rpc.method"] == "Generate"
    assert rpc.status.status_code == StatusCode.UNSET

    (gen,) = _children(exporter, rpc)
    assert gen.name == f"text_completion {model_id}"
    assert gen.kind == SpanKind.INTERNAL
    attrs = gen.attributes or {}
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.model"] == model_id
    assert attrs["gen_ai.request.max_tokens"] == 6
    assert attrs["gen_ai.usage.input_tokens"] == 5
    assert attrs["gen_ai.usage.output_tokens"] == 6
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs["gen_ai.response.id"] == "traced-1"
    assert [e.name for e in gen.events] == ["queued", "first_token", "scheduled", "finished"]
    at = {e.name: e.timestamp for e in gen.events}
    # Phases in time order (the scheduled event is back-dated from the engine's timing).
    assert at["queued"] <= at["scheduled"] <= at["first_token"] <= at["finished"]
    assert rpc.start_time is not None and gen.start_time is not None
    assert rpc.end_time is not None and gen.end_time is not None
    assert rpc.start_time <= gen.start_time and gen.end_time <= rpc.end_time


def test_tgis_batch_gets_one_genai_span_per_request(
    channel: grpc.Channel, exporter: InMemorySpanExporter
) -> None:
    exporter.clear()
    req = tg.BatchedGenerationRequest(
        requests=[tg.GenerationRequest(text=t) for t in ("hello world", "a second prompt")],
        params=tg.Parameters(method=tg.GREEDY, stopping=tg.StoppingCriteria(max_new_tokens=3)),
    )
    resp = tg_grpc.GenerationServiceStub(channel).Generate(req, timeout=60)
    rpc = _wait_span(exporter, "/fmaas.GenerationService/Generate")
    children = _children(exporter, rpc)
    assert len(children) == 2
    by_input = sorted((c.attributes or {})["gen_ai.usage.input_tokens"] for c in children)
    assert by_input == sorted(r.input_token_count for r in resp.responses)
    for child, r in zip(
        sorted(children, key=lambda c: (c.attributes or {})["gen_ai.usage.input_tokens"]),
        sorted(resp.responses, key=lambda r: r.input_token_count),
        strict=True,
    ):
        assert (child.attributes or {})["gen_ai.usage.output_tokens"] == r.generated_token_count


def test_refused_generate_span_carries_the_code(
    channel: grpc.Channel, exporter: InMemorySpanExporter
) -> None:
    exporter.clear()
    bad = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5]), sampling=pb.SamplingParams(top_p=7))
    with pytest.raises(grpc.RpcError) as info:
        list(pb_grpc.InferenceStub(channel).Generate(bad, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    rpc = _wait_span(exporter, GENERATE)
    attrs = rpc.attributes or {}
    assert attrs["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    # The RPC conventions: a client's mistake is not a server span error.
    assert rpc.status.status_code == StatusCode.UNSET
    assert _children(exporter, rpc) == []  # it never reached the engine


def test_deadline_ends_the_genai_span_as_aborted_and_frees_the_engine(
    channel: grpc.Channel, exporter: InMemorySpanExporter
) -> None:
    exporter.clear()
    stub = pb_grpc.InferenceStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(long_request("traced-late"), timeout=1.0))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # gRPC's deadline or the server's own timer, whichever fires first, cancels the handler:
    # only the server's sets the RPC span's code, so the GenAI span is what is asserted.
    rpc = _wait_span(exporter, GENERATE)
    # On cancellation the child ends in the stream's cleanup, which may run after the RPC span.
    wait_until(lambda: bool(_children(exporter, rpc)), "the GenAI child span")
    (gen,) = _children(exporter, rpc)
    attrs = gen.attributes or {}
    assert attrs["gen_ai.request.max_tokens"] == 4000
    assert attrs["gen_ai.response.finish_reasons"] == ("aborted",)
    assert "gen_ai.usage.output_tokens" not in attrs  # it never finished
    assert gen.events[0].name == "queued" and gen.events[-1].name == "aborted"
    assert gen.status.status_code == StatusCode.UNSET  # a deadline is not a server fault
    # The traced stream still closes the engine's: the request is aborted, its KV freed.
    wait_idle(stub)


def test_health_checks_make_no_spans(channel: grpc.Channel, exporter: InMemorySpanExporter) -> None:
    exporter.clear()
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "llm.v1.Inference"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    # A traced call after the checks: once its span is in, theirs would be too.
    pb_grpc.InferenceStub(channel).GetLoad(pb.GetLoadRequest(), timeout=5)
    _wait_span(exporter, "/llm.v1.Inference/GetLoad")
    names = [s.name for s in exporter.get_finished_spans()]
    assert not [n for n in names if n.startswith("/grpc.health.v1.Health/")], names


def test_config_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    off = Tracing.from_config(TracingConfig.from_env("inference-svc"))
    assert not off.enabled
    assert off.aio_interceptors() == () and off.interceptors() == ()

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "llm-a")
    assert TracingConfig.from_env("inference-svc") == TracingConfig("console", "llm-a")
    # A flag wins over the environment.
    assert TracingConfig.from_env("inference-svc", "none").exporter == "none"

    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert TracingConfig.from_env("inference-svc").exporter == "none"

    with pytest.raises(ValueError, match="traces exporter must be one of"):
        TracingConfig("jaeger")
    with pytest.raises(ValueError, match="--traces-exporter"):
        make_config(Path("/nonexistent"), traces_exporter="zipkin")


def test_otlp_without_its_package_is_a_clear_error() -> None:
    try:
        import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("the OTLP exporter is installed here")
    with pytest.raises(ValueError, match="needs the opentelemetry-exporter-otlp-proto-grpc"):
        Tracing.from_config(TracingConfig("otlp"))


def test_console_exporter_prints_spans_with_the_service_name() -> None:
    # A fresh process: the console exporter writes to the real stdout, batched, flushed on
    # shutdown, exactly as `serve` would.
    script = (
        "from inference_svc.server.tracing import Tracing, TracingConfig\n"
        "t = Tracing.from_config(TracingConfig.from_env('inference-svc'))\n"
        "assert t.provider is not None\n"
        "with t.provider.get_tracer('t').start_as_current_span('probe-span'):\n"
        "    pass\n"
        "t.shutdown()\n"
    )
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "llm-b"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert '"name": "probe-span"' in out.stdout
    assert '"service.name": "llm-b"' in out.stdout
