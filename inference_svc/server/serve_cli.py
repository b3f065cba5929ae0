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
from typing import TYPE_CHECKING

from inference_svc.engine.planner import parse_bytes

if TYPE_CHECKING:
    from inference_svc.server.app import ServerConfig


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name) or default


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("weights (one of)")
    src.add_argument("--model-dir", type=Path, help="a local checkpoint directory")
    src.add_argument("--sidecar", help="weight-cache sidecar address host:port")
    src.add_argument("--model", help="with --sidecar: org/name@<40-hex commit>")
    src.add_argument("--lease-holder", default="", help="lease name (default host/pid)")
    src.add_argument(
        "--sidecar-timeout", type=float, default=600.0, help="seconds to wait for READY"
    )
    net = p.add_argument_group("network")
    net.add_argument("--host", default=_env("INFERENCE_SVC_HOST", "[::]"))
    net.add_argument("--port", type=int, default=int(_env("INFERENCE_SVC_PORT", "50051") or 50051))
    net.add_argument("--port-file", type=Path, help="write the bound port here (for --port 0)")
    net.add_argument("--tls-cert", type=Path, help="PEM certificate chain (enables TLS)")
    net.add_argument("--tls-key", type=Path, help="PEM private key for --tls-cert")
    net.add_argument("--tls-client-ca", type=Path, help="PEM CA: require client certs (mTLS)")
    net.add_argument(
        "--health-port", type=int, default=None, help="with TLS: plaintext health-only port"
    )
    net.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port")
    net.add_argument("--grace", type=float, default=30.0, help="drain period on SIGTERM, seconds")
    eng = p.add_argument_group("engine")
    eng.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    eng.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: config)")
    eng.add_argument("--device", default="cpu", help="cpu or cuda")
    eng.add_argument("--kv-cache-memory", default=None, help="explicit KV pool size, e.g. 512MiB")
    eng.add_argument("--max-waiting", type=int, default=1024, help="queue limit; beyond: overload")
    eng.add_argument("--max-num-seqs", type=int, default=64)
    eng.add_argument("--max-num-batched-tokens", type=int, default=2048)
    eng.add_argument("--max-model-len", type=int, default=None)
    eng.add_argument("--block-size", type=int, default=16)
    eng.add_argument("--max-new-tokens", type=int, default=None, help="default per request")
    p.add_argument("--log-level", default=_env("INFERENCE_SVC_LOG_LEVEL", "INFO"))


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
