"""Fixtures for the cache sidecar: the olah mirror with the tiny model, a Range mirror, fast configs."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from cache_sidecar.cache import CacheConfig, WeightCache
from cache_sidecar.fetch import FetchConfig
from cache_sidecar.sources.hf_mirror import HfMirrorSource
from inference_svc.testing.mirror import MirrorFixture
from inference_svc.testing.models import ModelSpec, cached_model
from inference_svc.testing.range_mirror import RangeMirror

# Short backoffs and timeouts: fault tests retry many times and must stay quick.
FAST = FetchConfig(
    parallel_files=3,
    range_connections=4,
    chunk_bytes=256 * 1024,
    min_ranged_bytes=512 * 1024,
    buffer_bytes=64 * 1024,
    max_attempts=5,
    backoff_base_s=0.01,
    backoff_max_s=0.05,
    stall_timeout_s=1.0,
)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return cached_model(ModelSpec(family="llama", size="tiny"))


@pytest.fixture(scope="module")
def olah() -> Iterator[MirrorFixture]:
    with MirrorFixture() as mirror:
        yield mirror


@pytest.fixture
def range_mirror() -> Iterator[RangeMirror]:
    with RangeMirror() as mirror:
        yield mirror


def make_cache(root: Path, url: str | None, **cfg: object) -> WeightCache:
    source = HfMirrorSource(url, timeout_s=5.0) if url else None
    config = CacheConfig(cache_dir=root, retry_backoff_s=0.05, **cfg)  # type: ignore[arg-type]
    return WeightCache(config, source, FAST)


def write_safetensors(path: Path, n_floats: int, seed: int = 0) -> bytes:
    """A valid one-tensor safetensors file of `n_floats` float32 values (random bytes)."""
    header = b'{"w":{"dtype":"F32","shape":[%d],"data_offsets":[0,%d]}}' % (n_floats, 4 * n_floats)
    header += b" " * (-len(header) % 8)
    data = struct.pack("<Q", len(header)) + header + os.urandom(4 * n_floats)
    path.write_bytes(data)
    return data


def small_repo(root: Path, weight_floats: int = 300_000) -> Path:
    """config.json, tokenizer-ish text and one ~1.2 MB safetensors shard."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text('{"model_type": "llama"}\n')
    (root / "notes.txt").write_text("hello\n" * 100)
    write_safetensors(root / "model.safetensors", weight_floats)
    return root
