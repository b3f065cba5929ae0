"""`inference-svc serve`: the gRPC APIs over a local checkpoint or the weight-cache sidecar.

SIGTERM or SIGINT drains: health NOT_SERVING, new Generate calls UNAVAILABLE, in-flight requests
get `--grace` seconds to finish, then the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inference_svc.engine.planner import parse_bytes

if TYPE_CHECKING:
    from inference_svc.server.app import ServerConfig


ENV_PREFIX = "INFERENCE_SVC_"


def _option(group: Any, flag: str, help: str, default: object = None, **kw: Any) -> None:
    """A flag whose default comes from INFERENCE_SVC_<FLAG> when set (Kubernetes env)."""
    env = ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()
    # argparse converts a string default with `type`, exactly as if it were typed.
    group.add_argument(
        flag, default=os.environ.get(env) or default, help=f"{help} (env {env})", **kw
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("weights (one of --model-dir, --sidecar with --model)")
    _option(src, "--model-dir", "a local checkpoint directory", type=Path)
    _option(src, "--sidecar", "weight-cache sidecar address host:port")
    _option(src, "--model", "with --sidecar: org/name@<40-hex commit>")
    _option(src, "--lease-holder", "lease name on the revision (default host/pid)", "")
    _option(src, "--sidecar-timeout", "seconds to wait for READY", 600.0, type=float)
    net = p.add_argument_group("network")
    _option(net, "--host", "address to bind", "[::]")
    _option(net, "--port", "gRPC port (0: any free one)", 50051, type=int)
    _option(net, "--port-file", "write the bound port here (for --port 0)", type=Path)
    _option(net, "--tls-cert", "PEM certificate chain (enables TLS)", type=Path)
    _option(net, "--tls-key", "PEM private key for --tls-cert", type=Path)
    _option(net, "--tls-client-ca", "PEM CA bundle: require client certificates (mTLS)", type=Path)
    _option(net, "--health-port", "with TLS: plaintext port serving health only", type=int)
    _option(net, "--metrics-port", "Prometheus /metrics HTTP port (default off)", type=int)
    _option(net, "--traces-exporter", "OpenTelemetry traces: none, console or otlp "
            "(default: OTEL_TRACES_EXPORTER, else none)",
            os.environ.get("OTEL_TRACES_EXPORTER"))  # fmt: skip
    _option(net, "--grace", "seconds in-flight requests get on SIGTERM", 30.0, type=float)
    eng = p.add_argument_group("engine")
    _option(eng, "--tp", "tensor parallel size", 1, type=int)
    _option(eng, "--dtype", "float32, bfloat16 or float16 (default: the checkpoint's)")
    _option(eng, "--device", "cpu or cuda", "cpu")
    _option(eng, "--kv-cache-memory", "explicit KV pool size, e.g. 512MiB (default: planned)")
    _option(
        eng, "--max-waiting", "queued requests beyond which: RESOURCE_EXHAUSTED", 1024, type=int
    )
    _option(eng, "--max-num-seqs", "requests running at once", 64, type=int)
    _option(eng, "--max-num-batched-tokens", "token budget per step", 2048, type=int)
    _option(eng, "--max-model-len", "context limit (default: the model's)", type=int)
    _option(eng, "--block-size", "KV block size in tokens", 16, type=int)
    _option(eng, "--max-new-tokens", "default per request (default: generation_config or 256)",
            type=int)  # fmt: skip
    _option(p, "--log-level", "logging level", "INFO")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    from inference_svc.server.app import ServerConfig

    return ServerConfig(
        model_dir=args.model_dir,
        sidecar=args.sidecar,
        model_ref=args.model,
        lease_holder=args.lease_holder,
        sidecar_timeout_s=args.sidecar_timeout,
        host=args.host,
        port=args.port,
        port_file=args.port_file,
        grace_s=args.grace,
        tensor_parallel_size=args.tp,
        dtype=args.dtype,
        device=args.device,
        kv_cache_memory=None if args.kv_cache_memory is None else parse_bytes(args.kv_cache_memory),
        max_waiting=args.max_waiting,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_new_tokens=args.max_new_tokens,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        health_port=args.health_port,
        metrics_port=args.metrics_port,
        traces_exporter=args.traces_exporter,
    )


async def serve(cfg: ServerConfig) -> int:
    from inference_svc.server.app import InferenceServer

    log = logging.getLogger("inference_svc.serve")
    server = InferenceServer(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    load = asyncio.create_task(server.load())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({load, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if load.done() and load.exception() is not None:
        log.error("start-up failed: %s", load.exception())
        await server.stop(0)
        return 1
    await stopped
    if not load.done():
        # The engine is built in a thread that cannot be interrupted; leave without it.
        load.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await load
    clean = await server.drain()
    log.info("drained (%s); exiting", "all requests finished" if clean else "some aborted")
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        logging.getLogger("inference_svc.serve").error("%s", e)
        return 2
    return asyncio.run(serve(cfg))
