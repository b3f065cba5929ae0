"""`cache-sidecar` command line: fetch, serve, verify, ls, gc. Every flag has an environment variable.

Tokens come from HF_TOKEN or a file (--token-file) and are never printed or logged.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cache_sidecar.cache import CacheConfig, WeightCache
from cache_sidecar.errors import SidecarError
from cache_sidecar.fetch import FetchConfig
from cache_sidecar.progress import RevisionProgress, RevisionView
from cache_sidecar.refs import ModelRef
from cache_sidecar.sources.hf_mirror import HfMirrorSource

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT])?(i)?B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'500M', '10GiB', '1234' -> bytes (K/M/G/T decimal, Ki/Mi/Gi/Ti binary)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (examples: 500M, 10G, 2GiB)")
    power = "KMGT".index(m.group(2).upper()) + 1 if m.group(2) else 0
    return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)


def _env(name: str, *fallbacks: str) -> str | None:
    for key in (name, *fallbacks):
        if os.environ.get(key):
            return os.environ[key]
    return None


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def add_common(p: argparse.ArgumentParser, mirror: bool = True) -> None:
    p.add_argument(
        "--cache-dir",
        default=_env("CACHE_SIDECAR_CACHE_DIR", "HF_HUB_CACHE"),
        help="node volume root, a Hugging Face cache (env CACHE_SIDECAR_CACHE_DIR, HF_HUB_CACHE)",
    )
    p.add_argument(
        "--budget",
        type=parse_size,
        default=_env("CACHE_SIDECAR_BUDGET"),
        help="disk budget, e.g. 50G (env CACHE_SIDECAR_BUDGET)",
    )
    p.add_argument("--log-level", default=_env("CACHE_SIDECAR_LOG_LEVEL") or "INFO")
    if not mirror:
        return
    p.add_argument(
        "--mirror",
        default=_env("CACHE_SIDECAR_MIRROR", "HF_ENDPOINT"),
        help="Hugging Face-compatible mirror URL (env CACHE_SIDECAR_MIRROR, HF_ENDPOINT)",
    )
    p.add_argument(
        "--token-file",
        default=_env("CACHE_SIDECAR_TOKEN_FILE"),
        help="file holding the mirror token (env CACHE_SIDECAR_TOKEN_FILE; or HF_TOKEN)",
    )
    p.add_argument(
        "--offline",
        action="store_true",
        default=_truthy(_env("CACHE_SIDECAR_OFFLINE", "HF_HUB_OFFLINE")),
        help="never contact the mirror (env CACHE_SIDECAR_OFFLINE, HF_HUB_OFFLINE=1)",
    )
    p.add_argument(
        "--allow-branch",
        action="store_true",
        default=_truthy(_env("CACHE_SIDECAR_ALLOW_BRANCH")),
        help="accept a branch or tag, resolved once to a commit that is recorded and reported",
    )
    p.add_argument(
        "--parallel-files", type=int, default=int(_env("CACHE_SIDECAR_PARALLEL_FILES") or 4)
    )
    p.add_argument(
        "--range-connections", type=int, default=int(_env("CACHE_SIDECAR_RANGE_CONNECTIONS") or 4)
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=int(_env("CACHE_SIDECAR_MAX_CONNECTIONS") or 4),
        help="Range connections for all large files together (env CACHE_SIDECAR_MAX_CONNECTIONS)",
    )
    p.add_argument(
        "--chunk-bytes",
        type=parse_size,
        default=parse_size(_env("CACHE_SIDECAR_CHUNK_BYTES") or "8Mi"),
        help="Range request size, also how often resume progress is recorded (env CACHE_SIDECAR_CHUNK_BYTES)",
    )
    p.add_argument(
        "--stall-timeout", type=float, default=float(_env("CACHE_SIDECAR_STALL_TIMEOUT") or 30)
    )
    p.add_argument(
        "--backoff",
        type=float,
        default=float(_env("CACHE_SIDECAR_BACKOFF") or 0.5),
        help="base retry backoff, seconds",
    )
    p.add_argument(
        "--attempts",
        type=int,
        default=int(_env("CACHE_SIDECAR_ATTEMPTS") or 3),
        help="whole-revision attempts when the mirror is unreachable",
    )


def _token(args: argparse.Namespace) -> str | None:
    if getattr(args, "token_file", None):
        return Path(args.token_file).read_text().strip() or None
    return _env("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


def build_cache(args: argparse.Namespace, needs_mirror: bool = True) -> WeightCache:
    if not args.cache_dir:
        raise SidecarError("--cache-dir (or CACHE_SIDECAR_CACHE_DIR / HF_HUB_CACHE) is required")
    offline = bool(getattr(args, "offline", False))
    mirror = getattr(args, "mirror", None)
    if needs_mirror and not offline and not mirror:
        raise SidecarError(
            "--mirror (or CACHE_SIDECAR_MIRROR / HF_ENDPOINT) is required unless --offline"
        )
    source = HfMirrorSource(mirror, token=_token(args)) if mirror and not offline else None
    fetch_cfg = FetchConfig(
        parallel_files=getattr(args, "parallel_files", 4),
        range_connections=getattr(args, "range_connections", 4),
        max_connections=getattr(args, "max_connections", 4),
        stall_timeout_s=getattr(args, "stall_timeout", 30.0),
        chunk_bytes=getattr(args, "chunk_bytes", 8 * 2**20),
        min_ranged_bytes=2 * getattr(args, "chunk_bytes", 8 * 2**20),
        backoff_base_s=getattr(args, "backoff", 0.5),
    )
    cfg = CacheConfig(
        cache_dir=Path(args.cache_dir),
        budget_bytes=args.budget,
        offline=offline,
        attempts=getattr(args, "attempts", 3),
        retry_backoff_s=max(0.05, 4 * getattr(args, "backoff", 0.5)),
    )
    return WeightCache(cfg, source, fetch_cfg)


class _Bar:
    """A tqdm bar on a terminal, nothing otherwise."""

    def __init__(self) -> None:
        self._bar: Any = None
        self._lock = threading.Lock()
        self._enabled = sys.stderr.isatty()

    def __call__(self, view: RevisionView) -> None:
        if not self._enabled or not view.bytes_total:
            return
        with self._lock:
            if self._bar is None:
                from tqdm import tqdm

                self._bar = tqdm(total=view.bytes_total, unit="B", unit_scale=True, desc=view.repo)
            self._bar.update(view.bytes_done - self._bar.n)  # tqdm rate-limits its redraws

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def cmd_fetch(args: argparse.Namespace) -> int:
    ref = ModelRef.parse(args.model, allow_branch=args.allow_branch)
    cache = build_cache(args)
    bar = _Bar()
    progress = RevisionProgress(ref.repo, ref.revision, on_change=bar)
    try:
        pub = cache.ensure(ref, progress)
    finally:
        bar.close()
    if not ref.pinned:
        print(f"{ref} resolved to commit {pub.commit}", file=sys.stderr)
    print(f"manifest {pub.manifest_digest}", file=sys.stderr)
    print(pub.path)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    ref = ModelRef.parse(args.model, allow_branch=True)
    cache = build_cache(args, needs_mirror=False)
    commit = ref.revision if ref.pinned else cache.store.read_ref(ref.repo, ref.revision)
    if commit is None:
        raise SidecarError(f"{ref}: no recorded commit for this branch on this volume")
    problems = cache.verify(ref.repo, commit)
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        return 1
    print(f"{ref.repo}@{commit}: intact")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    cache = build_cache(args, needs_mirror=False)
    for info in cache.revisions():
        flags = ",".join(["pinned"] * info.pinned + [f"leased:{h}" for h in info.leases]) or "-"
        print(f"{info.repo}@{info.commit}\t{info.size_bytes}\t{flags}\t{info.path}")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    cache = build_cache(args, needs_mirror=False)
    print(f"freed {cache.gc()} bytes")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from cache_sidecar.server import run_server

    return run_server(args, build_cache(args, needs_mirror=False))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cache-sidecar", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "fetch", help="fetch, verify and publish one revision; print its snapshot path"
    )
    p.add_argument("model", help="org/name@<40-hex commit>")
    add_common(p)
    p.set_defaults(func=cmd_fetch)
    p = sub.add_parser("serve", help="gRPC WeightCache + health; pre-fetch the --model revisions")
    add_common(p)
    models = _env("CACHE_SIDECAR_MODELS")
    p.add_argument(
        "--model",
        action="append",
        default=[m for m in (models or "").split(",") if m.strip()],
        help="revision to keep READY (repeatable; env CACHE_SIDECAR_MODELS, comma-separated)",
    )
    p.add_argument("--port", type=int, default=int(_env("CACHE_SIDECAR_PORT") or 50070))
    p.add_argument("--host", default=_env("CACHE_SIDECAR_HOST") or "0.0.0.0")
    p.add_argument("--grace", type=float, default=float(_env("CACHE_SIDECAR_GRACE") or 5.0))
    p.add_argument("--port-file", default=None, help="write the bound port here (for --port 0)")
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("verify", help="re-hash a published revision")
    p.add_argument("model")
    add_common(p, mirror=False)
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("ls", help="list published revisions")
    add_common(p, mirror=False)
    p.set_defaults(func=cmd_ls)
    p = sub.add_parser("gc", help="evict to the budget, remove stale temp files")
    add_common(p, mirror=False)
    p.set_defaults(func=cmd_gc)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("httpx", "httpx2", "httpcore", "httpcore2"):  # one line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return int(args.func(args))
    except SidecarError as err:
        print(f"cache-sidecar: error [{err.code.name}]: {err.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
