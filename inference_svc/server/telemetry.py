"""OpenTelemetry metrics with Prometheus exposition: GenAI request metrics and engine load.

Each server owns its MeterProvider and Prometheus registry (no global state), so several
servers in one process, as in tests, do not collide.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIServer

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, generate_latest, start_http_server

from inference_svc.engine.outputs import EngineStats, RequestOutput

# Bucket boundaries from the OpenTelemetry GenAI semantic conventions.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92)  # fmt: skip


class Telemetry:
    """Instruments for one server; `stats` is read by the gauges at each scrape."""

    def __init__(self, model_id: str = "", stats: Callable[[], EngineStats | None] = lambda: None):
        self.registry = CollectorRegistry()
        self._stats = stats
        self.model_id = model_id
        self.load_time_s: float | None = None
        reader = PrometheusMetricReader(registry=self.registry)
        self.provider = MeterProvider(
            metric_readers=[reader], resource=Resource.create({"service.name": "inference-svc"})
        )
        meter = self.provider.get_meter("inference_svc.server")
        self.ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token",
            unit="s",
            description="Time from arrival to the first generated token",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS,
        )
        self.tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token",
            unit="s",
            description="Decode time per output token after the first",
            explicit_bucket_boundaries_advisory=TPOT_BUCKETS,
        )
        self.duration = meter.create_histogram(
            "gen_ai.server.request.duration",
            unit="s",
            description="Time from arrival to the last token",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self.tokens = meter.create_counter(
            "gen_ai.server.token.usage", unit="{token}", description="Prompt and generated tokens"
        )
        self.refused = meter.create_counter(
            "inference.requests.refused", unit="{request}", description="Requests refused, by code"
        )
        meter.create_observable_gauge("inference.kv_cache.usage", [self._kv], unit="1")
        meter.create_observable_gauge("inference.queue.waiting", [self._waiting], unit="{request}")
        meter.create_observable_gauge("inference.requests.running", [self._running])
        meter.create_observable_gauge("inference.prefix_cache.hit_rate", [self._hits], unit="1")
        meter.create_observable_gauge("inference.model.load_time", [self._load_time], unit="s")
        self._http: WSGIServer | None = None
        self._http_thread: threading.Thread | None = None

    # -- gauges ---------------------------------------------------------------------------------

    def _gauge(self, value: Callable[[EngineStats], float]) -> Iterable[Observation]:
        s = self._stats()
        return [] if s is None else [Observation(value(s), {"gen_ai.request.model": self.model_id})]

    def _kv(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._gauge(lambda s: s.kv_usage)

    def _waiting(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._gauge(lambda s: s.waiting)

    def _running(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._gauge(lambda s: s.running)

    def _hits(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._gauge(lambda s: s.prefix_hit_rate)

    def _load_time(self, options: CallbackOptions) -> Iterable[Observation]:
        return [] if self.load_time_s is None else [Observation(self.load_time_s)]

    # -- events ---------------------------------------------------------------------------------

    def finished(self, out: RequestOutput, api: str) -> None:
        """Record one finished request from its final output."""
        attrs = {
            "gen_ai.request.model": self.model_id,
            "rpc.service": api,
            "stop_reason": out.stop_reason.value if out.stop_reason is not None else "",
        }
        t = out.timing
        if t is not None:
            if t.first_token_s is not None:
                self.ttft.record(t.first_token_s, attrs)
                n = out.usage.completion_tokens
                if t.total_s is not None and n > 1:
                    self.tpot.record((t.total_s - t.first_token_s) / (n - 1), attrs)
            if t.total_s is not None:
                self.duration.record(t.total_s, attrs)
        base = {"gen_ai.request.model": self.model_id, "rpc.service": api}
        self.tokens.add(out.usage.prompt_tokens, {**base, "gen_ai.token.type": "input"})
        self.tokens.add(out.usage.completion_tokens, {**base, "gen_ai.token.type": "output"})
        self.tokens.add(out.usage.cached_prompt_tokens, {**base, "gen_ai.token.type": "cached"})

    def refusal(self, code: str, api: str) -> None:
        self.refused.add(1, {"rpc.grpc.status_code": code, "rpc.service": api})

    # -- exposition -----------------------------------------------------------------------------

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def serve_http(self, host: str, port: int) -> int:
        """Serve /metrics (Prometheus text) on a daemon thread; returns the bound port."""
        addr = host.strip("[]") or "0.0.0.0"
        self._http, self._http_thread = start_http_server(port, addr, registry=self.registry)
        return int(self._http.server_port)

    def shutdown(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        self.provider.shutdown()
