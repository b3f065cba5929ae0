"""FileDownload against a real Range-capable loopback server with injected faults."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from pathlib import Path

import pytest

from cache_sidecar.errors import ChecksumMismatch, TransientTransferError, UnsafeRepository
from cache_sidecar.fetch import FetchConfig, FileDownload, prefix_path
from cache_sidecar.sources.base import RemoteFile
from cache_sidecar.sources.hf_mirror import HfMirrorSource
from inference_svc.testing.range_mirror import Fault, RangeMirror

from .conftest import FAST

SIZE = 3 * 1024 * 1024 + 12345  # not a multiple of the chunk size


@pytest.fixture
def served(range_mirror: RangeMirror, tmp_path: Path) -> tuple[RangeMirror, str, bytes]:
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(SIZE)
    (src / "model.safetensors").write_bytes(data)
    (src / "config.json").write_text('{"a": 1}')
    commit = range_mirror.publish("org/m", src)
    return range_mirror, commit, data


def _download(
    mirror: RangeMirror, commit: str, path: str, tmp: Path, cfg: FetchConfig = FAST
) -> tuple[str, list[int]]:
    source = HfMirrorSource(mirror.url)
    rf = next(f for f in source.list_files("org/m", commit) if f.path == path)
    seen: list[int] = []
    lock = threading.Lock()

    def on_bytes(n: int) -> None:
        with lock:
            seen.append(n)

    digest = FileDownload(
        source.target("org/m", commit, path), rf, tmp, cfg, on_bytes, threading.Event()
    ).run()
    return digest.sha256, seen


def test_ranged_download_hashes_in_order(
    served: tuple[RangeMirror, str, bytes], tmp_path: Path
) -> None:
    mirror, commit, data = served
    sha, seen = _download(mirror, commit, "model.safetensors", tmp_path / "f.part")
    assert sha == hashlib.sha256(data).hexdigest()
    assert (tmp_path / "f.part").read_bytes() == data
    chunks = -(-SIZE // FAST.chunk_bytes)
    assert mirror.requests["model.safetensors"] == chunks  # one Range request per chunk
    assert mirror.bytes_served["model.safetensors"] == SIZE  # no byte twice
    assert sum(seen) == SIZE


def test_server_ignoring_range_gets_one_stream(tmp_path: Path) -> None:
    with RangeMirror(honour_range=False) as mirror:
        src = tmp_path / "src"
        src.mkdir()
        data = os.urandom(SIZE)
        (src / "model.safetensors").write_bytes(data)
        commit = mirror.publish("org/m", src)
        sha, _ = _download(mirror, commit, "model.safetensors", tmp_path / "f.part")
        assert sha == hashlib.sha256(data).hexdigest()
        assert mirror.requests["model.safetensors"] == 1
        assert mirror.bytes_served["model.safetensors"] == SIZE


@pytest.mark.parametrize("ranged", [True, False], ids=["ranged", "one-stream"])
def test_dropped_connections_resume(
    served: tuple[RangeMirror, str, bytes], tmp_path: Path, ranged: bool
) -> None:
    mirror, commit, data = served
    cfg = FAST if ranged else dataclasses.replace(FAST, range_connections=1)
    mirror.faults["model.safetensors"] = Fault(drop_after=100_000, drop_times=3)
    sha, seen = _download(mirror, commit, "model.safetensors", tmp_path / "f.part", cfg)
    assert sha == hashlib.sha256(data).hexdigest()
    # Each drop costs at most the bytes it cut short: resumed from the offset, not restarted.
    assert mirror.bytes_served["model.safetensors"] < SIZE + 3 * 100_000
    assert sum(seen) == SIZE


def test_5xx_flapping_then_success(served: tuple[RangeMirror, str, bytes], tmp_path: Path) -> None:
    mirror, commit, data = served
    mirror.faults["model.safetensors"] = Fault(fail_first=3, fail_status=502)
    mirror.faults["config.json"] = Fault(fail_first=2, fail_status=503)
    assert (
        _download(mirror, commit, "model.safetensors", tmp_path / "a")[0]
        == hashlib.sha256(data).hexdigest()
    )
    assert (
        _download(mirror, commit, "config.json", tmp_path / "b")[0]
        == hashlib.sha256(b'{"a": 1}').hexdigest()
    )


def test_persistent_5xx_gives_up_after_bounded_attempts(
    served: tuple[RangeMirror, str, bytes], tmp_path: Path
) -> None:
    mirror, commit, _ = served
    mirror.faults["config.json"] = Fault(fail_first=100)
    with pytest.raises(TransientTransferError, match="HTTP 503"):
        _download(mirror, commit, "config.json", tmp_path / "b")
    assert mirror.requests["config.json"] == FAST.max_attempts


def test_stall_is_detected_and_retried(
    served: tuple[RangeMirror, str, bytes], tmp_path: Path
) -> None:
    mirror, commit, data = served
    mirror.faults["model.safetensors"] = Fault(stall_s=3.0, stall_after=50_000)  # > 1 s watchdog
    sha, _ = _download(mirror, commit, "model.safetensors", tmp_path / "f.part")
    assert sha == hashlib.sha256(data).hexdigest()


def test_corrupted_byte_is_a_checksum_mismatch(
    served: tuple[RangeMirror, str, bytes], tmp_path: Path
) -> None:
    mirror, commit, _ = served
    mirror.faults["model.safetensors"] = Fault(corrupt_offset=SIZE - 7)
    with pytest.raises(ChecksumMismatch, match=r"model\.safetensors: sha256 mismatch, expected"):
        _download(mirror, commit, "model.safetensors", tmp_path / "f.part")


def test_lfs_pointer_served_as_content_is_refused(
    served: tuple[RangeMirror, str, bytes], tmp_path: Path
) -> None:
    mirror, commit, _ = served
    mirror.faults["model.safetensors"] = Fault(lfs_pointer_as_content=True)
    with pytest.raises(UnsafeRepository, match="Git LFS pointer"):
        _download(mirror, commit, "model.safetensors", tmp_path / "f.part")


def test_pointer_listed_as_a_plain_file_is_refused(
    range_mirror: RangeMirror, tmp_path: Path
) -> None:
    pointer = b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"a" * 64 + b"\nsize 9\n"
    commit = range_mirror.put_file("org/m", "model.safetensors", pointer, lfs=False)
    with pytest.raises(UnsafeRepository, match="Git LFS pointer"):
        _download(range_mirror, commit, "model.safetensors", tmp_path / "f.part")


def test_resume_from_a_previous_attempts_temp_file(
    served: tuple[RangeMirror, str, bytes], tmp_path: Path
) -> None:
    mirror, commit, data = served
    tmp = tmp_path / "f.part"
    one_stream = dataclasses.replace(FAST, range_connections=1, max_attempts=1)
    mirror.faults["model.safetensors"] = Fault(drop_after=2_000_000)
    with pytest.raises(TransientTransferError):
        _download(mirror, commit, "model.safetensors", tmp, one_stream)
    assert int(prefix_path(tmp).read_text()) > 0
    mirror.reset_counters()
    sha, seen = _download(mirror, commit, "model.safetensors", tmp, one_stream)
    assert sha == hashlib.sha256(data).hexdigest()
    assert mirror.bytes_served["model.safetensors"] < SIZE  # only the rest was sent
    assert sum(seen) == SIZE  # the resumed prefix is reported as done
    assert not prefix_path(tmp).exists()


def test_size_mismatch_names_both_sizes(range_mirror: RangeMirror, tmp_path: Path) -> None:
    commit = range_mirror.put_file("org/m", "w.safetensors", b"x" * 1000, lfs=True)
    rf = RemoteFile("w.safetensors", 999, None, hashlib.sha256(b"x" * 999).hexdigest())
    source = HfMirrorSource(range_mirror.url)
    with pytest.raises(ChecksumMismatch, match="listing says 999 bytes, the mirror serves 1000"):
        FileDownload(
            source.target("org/m", commit, rf.path), rf, tmp_path / "t", FAST,
            lambda n: None, threading.Event(),
        ).run()  # fmt: skip
