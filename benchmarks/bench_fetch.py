"""Cold fetch of the bench model from loopback mirrors: the sidecar (verifying every byte) side by
side with `huggingface_hub.snapshot_download` (no content check) and a raw transfer of the same
bytes. Prints MB/s and ratios; writes benchmarks/results/bench_fetch.json.

    .venv/bin/python -m benchmarks.bench_fetch [--repeats 3] [--quick]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_DISABLE_XET", "1")  # read at import by huggingface_hub
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import argparse
import concurrent.futures
import http.client
import json
import logging
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from huggingface_hub import snapshot_download

from cache_sidecar.cache import CacheConfig, WeightCache
from cache_sidecar.fetch import FetchConfig
from cache_sidecar.refs import ModelRef
from cache_sidecar.sources.hf_mirror import HfMirrorSource
from inference_svc.testing.mirror import MirrorFixture
from inference_svc.testing.models import ModelSpec, cached_model
from inference_svc.testing.range_mirror import RangeMirror

REPO = "bench/llama"
RESULTS = Path(__file__).resolve().parent / "results"


def raw_transfer(url: str, commit: str, paths: list[str], workers: int) -> None:
    """GET every file once, bytes discarded: what loopback and the server allow, nothing more."""
    netloc = urlsplit(url).netloc

    def one(path: str) -> int:
        conn = http.client.HTTPConnection(netloc, timeout=60)
        conn.request(
            "GET", f"/{REPO}/resolve/{commit}/{path}", headers={"Accept-Encoding": "identity"}
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{path}: HTTP {resp.status}")
        buf = bytearray(1 << 20)
        n = 0
        while k := resp.readinto(buf):
            n += k
        conn.close()
        return n

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, paths))


def run_sidecar(url: str, commit: str, out: Path, fsync: bool = True) -> None:
    cache = WeightCache(CacheConfig(cache_dir=out), HfMirrorSource(url), FetchConfig(fsync=fsync))
    cache.ensure(ModelRef(REPO, commit))


def run_snapshot_download(url: str, commit: str, out: Path) -> None:
    snapshot_download(REPO, revision=commit, cache_dir=out, endpoint=url, max_workers=8)


def timed(fn: Callable[[Path], None], scratch: Path) -> float:
    out = scratch / "out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    start = time.perf_counter()
    fn(out)
    elapsed = time.perf_counter() - start
    shutil.rmtree(out, ignore_errors=True)
    return elapsed


def bench_mirror(
    name: str, url: str, commit: str, paths: list[str], total: int, repeats: int, scratch: Path
) -> dict[str, dict[str, object]]:
    tools: dict[str, Callable[[Path], None]] = {
        "raw_transfer": lambda _out: raw_transfer(url, commit, paths, workers=8),
        "snapshot_download": lambda out: run_snapshot_download(url, commit, out),
        "sidecar": lambda out: run_sidecar(url, commit, out),
        # What durability costs: the same fetch without fsync before publishing each blob.
        "sidecar_no_fsync": lambda out: run_sidecar(url, commit, out, fsync=False),
    }
    times: dict[str, list[float]] = {k: [] for k in tools}
    timed(tools["raw_transfer"], scratch)  # warm the server's page cache and code paths
    for rep in range(repeats):
        order = (
            list(tools)[rep % len(tools) :] + list(tools)[: rep % len(tools)]
        )  # rotate to spread drift
        for tool in order:
            times[tool].append(timed(tools[tool], scratch))
    results: dict[str, dict[str, object]] = {}
    for tool, ts in times.items():
        med = statistics.median(ts)
        results[tool] = {"seconds": ts, "median_s": med, "MB_per_s": total / med / 1e6}
        print(
            f"  {name:>12} {tool:>18}: {total / med / 1e6:8.1f} MB/s (median of {len(ts)}: {med:.2f}s)"
        )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--quick", action="store_true", help="tiny model instead of bench, 1 repeat"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    spec = ModelSpec(family="llama", size="tiny" if args.quick else "bench")
    repeats = 1 if args.quick else args.repeats
    model = cached_model(spec)
    paths = sorted(p.relative_to(model).as_posix() for p in model.rglob("*") if p.is_file())
    total = sum((model / p).stat().st_size for p in paths)
    print(f"model {model.name}: {len(paths)} files, {total / 1e6:.1f} MB")
    scratch = Path(tempfile.mkdtemp(prefix="bench-fetch-"))
    report: dict[str, object] = {"model": model.name, "bytes": total, "repeats": repeats}
    try:
        with MirrorFixture() as olah, RangeMirror() as ranged:
            olah_commit = olah.publish(REPO, model)
            ranged_commit = ranged.publish(REPO, model)
            # The listing at each mirror (olah's fixture commits a .gitattributes as well).
            olah_paths = [f.path for f in HfMirrorSource(olah.url).list_files(REPO, olah_commit)]
            mirrors = {
                "olah": bench_mirror(
                    "olah", olah.url, olah_commit, olah_paths, total, repeats, scratch
                ),
                "range_server": bench_mirror(
                    "range_server", ranged.url, ranged_commit, paths, total, repeats, scratch
                ),
            }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    ratios = {}
    for name, res in mirrors.items():
        side = float(res["sidecar"]["MB_per_s"])  # type: ignore[arg-type]
        ratios[name] = {
            "sidecar_vs_snapshot_download": side / float(res["snapshot_download"]["MB_per_s"]),  # type: ignore[arg-type]
            "sidecar_vs_raw_transfer": side / float(res["raw_transfer"]["MB_per_s"]),  # type: ignore[arg-type]
        }
        print(
            f"{name}: sidecar / snapshot_download = {ratios[name]['sidecar_vs_snapshot_download']:.2f}x,"
            f" sidecar / raw transfer = {ratios[name]['sidecar_vs_raw_transfer']:.2f}x"
        )
    report.update(mirrors=mirrors, ratios=ratios)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "bench_fetch.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
