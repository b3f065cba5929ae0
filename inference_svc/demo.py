"""The whole local stack in one command: mirror -> sidecar -> service -> a streaming client.

`make demo` runs this. It builds (once, cached under .cache/) a deterministic
random-weight checkpoint, commits it to a git+LFS repo served by a real Hugging
Face mirror (olah) on loopback, starts `cache-sidecar serve` to fetch, verify
and publish that commit into a fresh node volume, starts `inference-svc serve`
against the sidecar, and streams one chat completion over `llm.v1.Inference`.
The weights are random, so the text is gibberish; the plumbing is real.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.llm.v1 import inference_pb2, inference_pb2_grpc
from protos.weightcache.v1 import cache_pb2, cache_pb2_grpc

REPO_ID = "demo-org/demo-llama"


def say(step: str, text: str) -> None:
    print(f"[{step:>8}] {text}", flush=True)


@contextmanager
def process(name: str, argv: list[str], log_dir: Path, env: dict[str, str]) -> Iterator[Path]:
    """Run argv in its own session with a --port-file; yield that file; stop it on exit."""
    port_file = log_dir / f"{name}.port"
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*argv, "--port", "0", "--port-file", str(port_file)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        yield port_file
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc.returncode not in (0, -signal.SIGTERM):
            say(name, f"exited {proc.returncode}; log tail:\n{log_path.read_text()[-3000:]}")


def wait_port(port_file: Path, name: str, log_dir: Path, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_file.exists() and port_file.read_text().strip():
            return int(port_file.read_text())
        time.sleep(0.1)
    log = (log_dir / f"{name}.log").read_text()[-3000:]
    raise SystemExit(f"{name} did not start within {timeout_s:.0f}s; log tail:\n{log}")


def wait_serving(channel: grpc.Channel, timeout_s: float) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"not SERVING after {timeout_s:.0f}s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("tiny", "bench"), default="bench")
    parser.add_argument("--prompt", default="Tell me how the weights reached this process.")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--keep", action="store_true", help="keep the node volume and logs")
    args = parser.parse_args(argv)

    from inference_svc.testing import ModelSpec, cached_model
    from inference_svc.testing.mirror import MirrorFixture

    t0 = time.monotonic()
    model_dir = cached_model(ModelSpec(family="llama", size=args.size))
    size_mb = sum(f.stat().st_size for f in model_dir.iterdir()) / 1e6
    say("model", f"{args.size} checkpoint ({size_mb:.0f} MB) at {model_dir}")

    with ExitStack() as stack:
        work = Path(tempfile.mkdtemp(prefix="llm-demo-"))
        if not args.keep:
            stack.callback(shutil.rmtree, work, ignore_errors=True)
        volume = work / "node-volume"
        mirror = stack.enter_context(MirrorFixture())
        commit = mirror.publish(REPO_ID, model_dir)
        say("mirror", f"olah on {mirror.url} serves {REPO_ID}@{commit}")

        env = {**os.environ, **mirror.env, "PYTHONUNBUFFERED": "1"}
        ref = f"{REPO_ID}@{commit}"
        sidecar_cmd = [sys.executable, "-m", "cache_sidecar.cli", "serve"]
        sidecar_cmd += ["--mirror", mirror.url, "--cache-dir", str(volume), "--model", ref]
        sidecar_port = wait_port(
            stack.enter_context(process("sidecar", sidecar_cmd, work, env)), "sidecar", work, 60
        )
        sidecar = stack.enter_context(grpc.insecure_channel(f"127.0.0.1:{sidecar_port}"))
        say("sidecar", f"listening on 127.0.0.1:{sidecar_port}; watching {ref}")
        cache = cache_pb2_grpc.WeightCacheStub(sidecar)
        model_ref = cache_pb2.ModelRef(repo=REPO_ID, revision=commit)
        last = -1
        for status in cache.Watch(cache_pb2.WatchRequest(model=model_ref), timeout=600):
            state = cache_pb2.State.Name(status.state)
            pct = int(100 * status.bytes_done / status.bytes_total) if status.bytes_total else 0
            if pct // 25 != last // 25 or status.state in (cache_pb2.READY, cache_pb2.FAILED):
                say("sidecar", f"{state:<9} {status.bytes_done / 1e6:7.1f} MB  {pct:3d}%")
                last = pct
            if status.state == cache_pb2.FAILED:
                raise SystemExit(f"sidecar: {status.error_message}")
            if status.state == cache_pb2.READY:
                say("sidecar", f"published {status.local_path} ({status.manifest_digest})")
                break
        wait_serving(sidecar, 30)

        service_cmd = [sys.executable, "-m", "inference_svc.cli", "serve"]
        service_cmd += ["--sidecar", f"127.0.0.1:{sidecar_port}", "--model", ref]
        service_port = wait_port(
            stack.enter_context(process("service", service_cmd, work, env)), "service", work, 300
        )
        service = stack.enter_context(grpc.insecure_channel(f"127.0.0.1:{service_port}"))
        wait_serving(service, 300)
        stub = inference_pb2_grpc.InferenceStub(service)
        info = stub.ModelInfo(inference_pb2.ModelInfoRequest(), timeout=10)
        say(
            "service",
            f"SERVING {info.architecture} rev {info.revision[:12]} on 127.0.0.1:{service_port}, "
            f"{info.kv_blocks} KV blocks x {info.kv_block_size} tokens",
        )

        request = inference_pb2.GenerateRequest(
            chat=inference_pb2.ChatPrompt(
                messages=[inference_pb2.ChatMessage(role="user", content=args.prompt)]
            ),
            stopping=inference_pb2.StoppingParams(
                max_new_tokens=args.max_new_tokens, ignore_eos=True
            ),
        )
        say("client", f"Generate (streaming): {args.prompt!r}")
        print("           ", end="", flush=True)
        for event in stub.Generate(request, timeout=300):
            kind = event.WhichOneof("event")
            if kind == "token":
                print(event.token.text, end="", flush=True)
            elif kind == "finished":
                f = event.finished
                print()
                say(
                    "client",
                    f"{inference_pb2.StopReason.Name(f.stop_reason)}: "
                    f"{f.usage.prompt_tokens} prompt + {f.usage.completion_tokens} completion "
                    f"tokens, first token {f.timing.time_to_first_token_s * 1e3:.0f} ms, "
                    f"decode {f.timing.decode_s * 1e3:.0f} ms",
                )
            elif kind == "error":
                raise SystemExit(f"error {event.error.code}: {event.error.message}")
        if args.keep:
            say("demo", f"kept {work}")
    say("demo", f"done in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
