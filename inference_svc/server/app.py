"""The server process: bind, health NOT_SERVING, get weights (local dir or sidecar), build and
warm the engine, health SERVING; on stop, drain in-flight requests within a grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from inference_svc.engine.async_engine import AsyncEngine
from inference_svc.engine.engine import Engine, EngineConfig
from inference_svc.engine.outputs import EngineStats, RequestOutput
from inference_svc.server.native import InferenceServicer
from inference_svc.server.runtime import LoadedModel, ModelCard, ServingState
from inference_svc.server.sidecar_client import SidecarClient, SidecarModel, parse_model_ref
from inference_svc.server.telemetry import Telemetry
from inference_svc.server.tgis import GenerationServicer
from inference_svc.server.tracing import EXPORTERS, Tracing, TracingConfig
from inference_svc.server.validation import GenerationInput, ModelLimits
from protos.fmaas import generation_pb2, generation_pb2_grpc
from protos.llm.v1 import inference_pb2, inference_pb2_grpc

log = logging.getLogger(__name__)

SERVICES = (
    inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name,
    generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name,
)
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
# gRPC sets SO_REUSEPORT by default: a second replica on the same fixed port would silently
# share it instead of failing to start.
_SERVER_OPTIONS = (("grpc.so_reuseport", 0),)


@dataclass(frozen=True)
class ServerConfig:
    """Everything `inference-svc serve` takes; exactly one of model_dir and sidecar is set."""

    model_dir: Path | None = None
    sidecar: str | None = None  # host:port of the weight-cache sidecar
    model_ref: str | None = None  # org/name@<commit>, with sidecar
    lease_holder: str = ""
    sidecar_timeout_s: float = 600.0
    host: str = "[::]"
    port: int = 50051
    port_file: Path | None = None
    grace_s: float = 30.0
    tensor_parallel_size: int = 1
    dtype: str | None = None
    device: str = "cpu"
    kv_cache_memory: int | None = None
    max_waiting: int = 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    max_new_tokens: int | None = None  # server default; None: generation_config, else 256
    tls_cert: Path | None = None  # PEM certificate chain; with tls_key, the APIs need TLS
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # PEM CA bundle: clients must present a cert it signed
    health_port: int | None = None  # with TLS: a plaintext port serving grpc.health.v1 only
    metrics_port: int | None = None  # Prometheus /metrics over HTTP; None: off
    traces_exporter: str | None = None  # none, console, otlp; None: OTEL_TRACES_EXPORTER or none

    def __post_init__(self) -> None:
        if (self.model_dir is None) == (self.sidecar is None):
            raise ValueError("give exactly one of --model-dir and --sidecar")
        if self.sidecar is not None:
            if not self.model_ref:
                raise ValueError("--sidecar needs --model org/name@<40-hex commit>")
            parse_model_ref(self.model_ref)
        if self.grace_s < 0:
            raise ValueError(f"--grace must be >= 0, got {self.grace_s}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        if self.health_port is not None and self.tls_cert is None:
            raise ValueError("--health-port is for TLS servers; without TLS use --port")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.traces_exporter is not None and self.traces_exporter not in EXPORTERS:
            raise ValueError(
                f"--traces-exporter (OTEL_TRACES_EXPORTER) must be one of {', '.join(EXPORTERS)}, "
                f"got {self.traces_exporter!r}"
            )

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        assert self.tls_cert is not None and self.tls_key is not None
        ca = self.tls_client_ca.read_bytes() if self.tls_client_ca is not None else None
        return grpc.ssl_server_credentials(
            [(self.tls_key.read_bytes(), self.tls_cert.read_bytes())],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )

    @property
    def resolved_lease_holder(self) -> str:
        return self.lease_holder or f"inference-svc/{socket.gethostname()}/{os.getpid()}"


def _shut_down_unused(building: asyncio.Future[LoadedModel]) -> None:
    if building.cancelled() or building.exception() is not None:
        return
    log.info("load finished after start-up was abandoned: shutting the engine down")
    building.result().engine.shutdown()


def load_model(
    model_dir: Path, cfg: ServerConfig, model_id: str, revision: str, digest: str
) -> LoadedModel:
    """Tokenizer, executor, engine (memory plan, KV pool, warm-up): the slow, blocking part."""
    from inference_svc.llm import _torch_dtype
    from inference_svc.loader.tokenizer import load_tokenizer
    from inference_svc.model.executor import create_executor

    t0 = time.monotonic()
    tokenizer = load_tokenizer(model_dir)
    executor = create_executor(
        model_dir,
        tensor_parallel_size=cfg.tensor_parallel_size,
        dtype=_torch_dtype(cfg.dtype),
        device=cfg.device,
    )
    engine_cfg = EngineConfig(
        block_size=cfg.block_size,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len,
        max_waiting=cfg.max_waiting,
        kv_cache_memory=cfg.kv_cache_memory,
    )
    for report in getattr(executor, "load_reports", ()):
        log.info("weights %s", report.summary())
    try:
        engine = Engine(executor, tokenizer, engine_cfg, device=cfg.device)
    except BaseException:
        executor.shutdown()
        raise
    mc = executor.config
    limits = ModelLimits(
        vocab_size=mc.vocab_size,
        max_model_len=engine.max_model_len,
        default_max_new_tokens=cfg.max_new_tokens or tokenizer.generation.max_new_tokens or 256,
    )
    card = ModelCard(
        model_id=model_id,
        architecture=mc.architecture,
        revision=revision,
        manifest_digest=digest,
        dtype=str(getattr(executor, "dtype", None) or mc.dtype).removeprefix("torch."),
        tensor_parallel_size=executor.tp_size,
        kv_block_size=engine_cfg.block_size,
        kv_blocks=engine.plan.num_blocks,
        max_waiting=engine_cfg.max_waiting,
        has_chat_template=tokenizer.chat_template is not None,
        prefix_caching=engine_cfg.enable_prefix_caching,
    )
    log.info(
        "loaded %s (%s, %s) in %.1fs: %d KV blocks of %d tokens",
        model_id,
        card.architecture,
        card.dtype,
        time.monotonic() - t0,
        card.kv_blocks,
        card.kv_block_size,
    )
    return LoadedModel(AsyncEngine(engine), tokenizer, limits, card)


def _write_port_file(path: Path, port: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(str(port))
    tmp.replace(path)  # readers never see a half-written port


class _TracedState(ServingState):
    """Used only when tracing is on: each engine request gets a GenAI span under its RPC's."""

    def __init__(self, telemetry: Telemetry, tracing: Tracing) -> None:
        super().__init__(telemetry)
        self.tracing = tracing

    def stream(
        self, gen: GenerationInput, request_id: str = "", api: str = "llm.v1.Inference"
    ) -> AsyncIterator[RequestOutput]:
        model_id = self.model.card.model_id if self.loaded else ""
        outputs = super().stream(gen, request_id, api)
        prompt, max_tokens = len(gen.prompt_token_ids), gen.params.max_tokens
        return self.tracing.generation(outputs, prompt, max_tokens, model_id)


class InferenceServer:
    """One grpc.aio server with the native and TGIS servicers, health and reflection.

    `tracing` defaults to what cfg.traces_exporter and the OTEL_* environment say.
    """

    def __init__(self, cfg: ServerConfig, tracing: Tracing | None = None) -> None:
        self.cfg = cfg
        self.telemetry = Telemetry(stats=self._stats)
        if tracing is None:
            tracing = Tracing.from_config(
                TracingConfig.from_env("inference-svc", cfg.traces_exporter)
            )
        self.tracing = tracing
        self.state = (
            _TracedState(self.telemetry, tracing)
            if tracing.enabled
            else ServingState(self.telemetry)
        )
        self.metrics_port = 0
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(
            options=_SERVER_OPTIONS, interceptors=tracing.aio_interceptors()
        )
        self.port = 0
        # With TLS, kubelet probes cannot present certificates: health alone goes plaintext.
        self.health_server: grpc.aio.Server | None = None
        self.health_port = 0
        self._sidecar: SidecarClient | None = None
        self._leased: SidecarModel | None = None
        self._health_task: asyncio.Future[None] | None = None  # kept: tasks are weakly held
        inference_pb2_grpc.add_InferenceServicer_to_server(
            InferenceServicer(self.state), self.server
        )
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(
            GenerationServicer(self.state), self.server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)

    def _stats(self) -> EngineStats | None:
        return self.state.model.engine.stats() if self.state.loaded else None

    async def _set_health(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *SERVICES):
            await self.health.set(name, status)

    async def start(self) -> int:
        """Bind and serve health (NOT_SERVING) before the model loads, so probes get answers."""
        await self._set_health(False)
        address = f"{self.cfg.host}:{self.cfg.port}"
        if self.cfg.tls:
            self.port = self.server.add_secure_port(address, self.cfg.server_credentials())
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"could not bind {address}")
        if self.cfg.health_port is not None:
            self.health_server = grpc.aio.server(options=_SERVER_OPTIONS)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = self.health_server.add_insecure_port(
                f"{self.cfg.host}:{self.cfg.health_port}"
            )
            if self.health_port == 0:
                raise OSError(f"could not bind the health port {self.cfg.health_port}")
            await self.health_server.start()
            log.info("plaintext health on port %d", self.health_port)
        if self.cfg.metrics_port is not None:
            self.metrics_port = self.telemetry.serve_http(self.cfg.host, self.cfg.metrics_port)
            log.info("Prometheus metrics on http port %d", self.metrics_port)
        await self.server.start()
        if self.cfg.port_file is not None:
            _write_port_file(self.cfg.port_file, self.port)
        log.info("listening on port %d (NOT_SERVING until the model is warm)", self.port)
        return self.port

    async def load(self) -> None:
        cfg = self.cfg
        if cfg.sidecar is not None and cfg.model_ref is not None:
            repo, commit = parse_model_ref(cfg.model_ref)
            self._sidecar = SidecarClient(cfg.sidecar, cfg.resolved_lease_holder)
            model = await self._sidecar.ensure(repo, commit, cfg.sidecar_timeout_s)
            await self._sidecar.lease(model)
            self._leased = model
            args = (model.local_path, cfg, repo, commit, model.manifest_digest)
        else:
            assert cfg.model_dir is not None  # ServerConfig guarantees one source
            path = cfg.model_dir.resolve()
            # A directory inside a Hugging Face cache is named by its commit.
            revision = path.name if _COMMIT_RE.match(path.name) else ""
            args = (path, cfg, str(cfg.model_dir), revision, "")
        t0 = time.monotonic()
        building = asyncio.get_running_loop().run_in_executor(None, load_model, *args)
        try:
            loaded = await asyncio.shield(building)
        except asyncio.CancelledError:
            # SIGTERM while loading: the thread cannot be interrupted, so whatever it builds
            # (an engine, TP worker processes) is shut down when it is done, not leaked.
            building.add_done_callback(_shut_down_unused)
            raise
        self.telemetry.model_id = loaded.card.model_id
        self.telemetry.load_time_s = time.monotonic() - t0
        self.state.set_model(loaded)
        loop = asyncio.get_running_loop()

        def engine_stopped(error: BaseException | None) -> None:
            # Engine thread. A dead engine refuses every request: probes must see it.
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                loop.call_soon_threadsafe(self._engine_stopped, error)

        loaded.engine.add_stop_callback(engine_stopped)
        if not self.state.draining:
            await self._set_health(True)
        log.info("SERVING on port %d", self.port)

    def _engine_stopped(self, error: BaseException | None) -> None:
        if error is None:  # shut down by drain or stop: health is already down or not served
            return
        log.error("the engine crashed (%s): health NOT_SERVING", error)
        self._health_task = asyncio.ensure_future(self._set_health(False))

    async def drain(self, grace_s: float | None = None) -> bool:
        """Stop taking requests, let in-flight ones finish within the grace period, then stop.

        Returns True when every in-flight request finished in time.
        """
        grace = self.cfg.grace_s if grace_s is None else grace_s
        self.state.draining = True
        await self.health.enter_graceful_shutdown()
        log.info("draining: %d in flight, grace %.1fs", len(self.state.active), grace)
        clean = await self.state.wait_idle(grace)
        if not clean:
            log.warning("grace period over: aborting %d requests", len(self.state.active))
            if self.state.loaded:
                self.state.abort_all()
        await self.stop(1.0)
        return clean

    async def stop(self, grace_s: float) -> None:
        """Stop serving (in-flight RPCs get grace_s), release the engine and the lease."""
        await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(0)
        self.telemetry.shutdown()
        self.tracing.shutdown()
        await self.close()

    async def close(self) -> None:
        if self.state.loaded:
            await asyncio.to_thread(self.state.model.engine.shutdown)
        if self._sidecar is not None:
            if self._leased is not None:
                await self._sidecar.release(self._leased)
            await self._sidecar.close()
            self._sidecar = None
