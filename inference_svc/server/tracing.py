"""OpenTelemetry traces for the gRPC servers: a server span per RPC (health checks excluded) and,
under Generate, a span per engine request with GenAI attributes and phase events. No torch here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import grpc
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import (
    aio_server_interceptor,
    filters,
    server_interceptor,
)
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.util.types import AttributeValue

if TYPE_CHECKING:
    from inference_svc.engine.outputs import RequestOutput

    OutputT = TypeVar("OutputT", bound=RequestOutput)
else:
    OutputT = TypeVar("OutputT")

EXPORTERS = ("none", "console", "otlp")
# Span and attribute names from the OpenTelemetry GenAI semantic conventions.
OPERATION = "text_completion"


@dataclass(frozen=True)
class TracingConfig:
    """Which exporter (`OTEL_TRACES_EXPORTER` style) and the service name spans carry."""

    exporter: str = "none"
    service_name: str = "inference-svc"

    def __post_init__(self) -> None:
        if self.exporter not in EXPORTERS:
            raise ValueError(
                f"traces exporter must be one of {', '.join(EXPORTERS)}, got {self.exporter!r}"
            )

    @classmethod
    def from_env(cls, default_service_name: str, exporter: str | None = None) -> TracingConfig:
        """`exporter` (a flag) wins over OTEL_TRACES_EXPORTER; unset means none, not OTLP:
        nothing is sent anywhere unless asked. OTEL_SDK_DISABLED=true turns tracing off and
        OTEL_SERVICE_NAME names the service."""
        name = exporter or os.environ.get("OTEL_TRACES_EXPORTER") or "none"
        if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            name = "none"
        return cls(
            exporter=name.strip().lower(),
            service_name=os.environ.get("OTEL_SERVICE_NAME") or default_service_name,
        )


def _make_exporter(name: str) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    try:  # optional: reads OTEL_EXPORTER_OTLP_ENDPOINT itself
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise ValueError(
            "traces exporter otlp needs the opentelemetry-exporter-otlp-proto-grpc package"
        ) from None
    return OTLPSpanExporter()  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Tracing:
    """One server's TracerProvider (never the global one, so servers in one process are apart).

    `provider` None means tracing is off: no interceptor, no per-request work at all.
    """

    provider: TracerProvider | None = None

    @classmethod
    def from_config(cls, cfg: TracingConfig) -> Tracing:
        if cfg.exporter == "none":
            return cls()
        # Batched: exporting never runs on the event loop or a handler thread.
        return cls.with_exporter(_make_exporter(cfg.exporter), cfg.service_name, batch=True)

    @classmethod
    def with_exporter(
        cls, exporter: SpanExporter, service_name: str, *, batch: bool = False
    ) -> Tracing:
        """Spans go to `exporter`; tests pass an InMemorySpanExporter (unbatched: seen at once)."""
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        provider.add_span_processor(processor)
        return cls(provider)

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def aio_interceptors(self) -> Sequence[grpc.aio.ServerInterceptor]:
        """For `grpc.aio.server(interceptors=...)`; empty when tracing is off."""
        if self.provider is None:
            return ()
        # The filter says which calls get spans: all but grpc.health.v1 (kubelet probes).
        return (aio_server_interceptor(self.provider, filters.negate(filters.health_check())),)

    def interceptors(self) -> Sequence[grpc.ServerInterceptor]:
        """For the sync `grpc.server(interceptors=...)`; empty when tracing is off."""
        if self.provider is None:
            return ()
        return (server_interceptor(self.provider, filters.negate(filters.health_check())),)

    def shutdown(self) -> None:
        """Flush batched spans and stop the exporter."""
        if self.provider is not None:
            self.provider.shutdown()

    def generation(
        self, outputs: AsyncIterator[OutputT], prompt_tokens: int, max_tokens: int, model: str
    ) -> AsyncIterator[OutputT]:
        """One engine request's outputs, passed through a child span of the current RPC span.

        Returns `outputs` itself when the RPC span is not recorded (tracing off, sampled out).
        """
        if self.provider is None or not trace.get_current_span().is_recording():
            return outputs
        attrs: dict[str, AttributeValue] = {
            "gen_ai.operation.name": OPERATION,
            "gen_ai.request.model": model,
            "gen_ai.request.max_tokens": max_tokens,
            "gen_ai.usage.input_tokens": prompt_tokens,
        }
        tracer = self.provider.get_tracer(__name__)
        return _traced(outputs, tracer, f"{OPERATION} {model}".strip(), attrs)


async def _traced(
    outputs: AsyncIterator[OutputT],
    tracer: trace.Tracer,
    name: str,
    attrs: dict[str, AttributeValue],
) -> AsyncIterator[OutputT]:
    # Not made current: between yields the caller's context must stay the RPC span's.
    span = tracer.start_span(name, kind=trace.SpanKind.INTERNAL, attributes=attrs)
    queued_ns = time.time_ns()
    span.add_event("queued", timestamp=queued_ns)
    first, done = True, False
    try:
        # Closing this generator early must close the engine stream too (that aborts it).
        async with contextlib.aclosing(outputs):  # type: ignore[type-var]
            async for out in outputs:
                if first and out.new_token_ids:
                    first = False
                    span.add_event("first_token")
                if out.finished:
                    done = True
                    _finished(span, out, queued_ns)
                yield out
    except (asyncio.CancelledError, GeneratorExit):
        # Client gone or deadline: the engine aborts it. Not an error of this server; gRPC's
        # own cancellation ends the RPC span without a code, so this span says what happened.
        if not done:
            span.set_attribute("gen_ai.response.finish_reasons", ("aborted",))
            span.add_event("aborted")
        raise
    except Exception as e:  # refused (queue full, engine gone): the RPC span has the code
        span.record_exception(e)
        span.set_status(trace.StatusCode.ERROR, str(e))
        raise
    finally:
        span.end()


def _finished(span: trace.Span, out: RequestOutput, queued_ns: int) -> None:
    reason = out.stop_reason.value if out.stop_reason is not None else "error"
    t = out.timing
    if t is not None and t.queue_s is not None:
        # When the scheduler first ran it, known only now: an event back-dated to then.
        span.add_event("scheduled", timestamp=queued_ns + int(t.queue_s * 1e9))
    attrs: dict[str, AttributeValue] = {
        "gen_ai.response.id": out.request_id,
        "gen_ai.usage.input_tokens": out.usage.prompt_tokens,
        "gen_ai.usage.output_tokens": out.usage.completion_tokens,
        "gen_ai.usage.cache_read.input_tokens": out.usage.cached_prompt_tokens,
        "gen_ai.response.finish_reasons": (reason,),
    }
    span.set_attributes(attrs)
    span.add_event("finished")
