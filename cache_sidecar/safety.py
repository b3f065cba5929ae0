"""Checks that keep unsafe or broken repositories off the volume: paths, pickle, LFS pointers, headers."""

from __future__ import annotations

import itertools
import json
import math
import posixpath
import re
import struct
from pathlib import Path

from cache_sidecar.errors import InvalidCheckpoint, UnsafeRepository
from cache_sidecar.sources.base import RemoteFile

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
LFS_POINTER_PREFIX = b"version https://git-lfs.github.com/spec/"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_GIT_OID = re.compile(r"^[0-9a-f]{40}$|^[0-9a-f]{64}$")  # sha1 repos, and sha256 ones
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}  # fmt: skip


def check_path(path: str) -> None:
    """Refuse paths that could escape the snapshot: absolute, `..`, backslashes, empty parts."""
    if (
        not path
        or path.startswith("/")
        or "\\" in path
        or "\x00" in path
        or any(part in ("", ".", "..") for part in path.split("/"))
        or posixpath.normpath(path) != path
    ):
        raise UnsafeRepository(f"refusing listed path {path!r}: it escapes the repository")


def is_pickle(path: str) -> bool:
    return path.lower().endswith(PICKLE_SUFFIXES)


def select_files(files: list[RemoteFile], repo: str) -> list[RemoteFile]:
    """The files to fetch: paths checked, pickle weights dropped, pickle-only repos refused."""
    for f in files:
        check_path(f.path)
        if f.size < 0:
            raise UnsafeRepository(f"{f.path}: negative size in the listing")
        if not (f.sha256 or f.git_oid):
            raise UnsafeRepository(f"{f.path}: the listing gives no hash to verify it against")
        # Hashes name blobs, temps and locks on the volume, and a blob already there is trusted:
        # anything but hex could point outside the repository (`../`).
        if (f.sha256 is not None and not _SHA256.match(f.sha256)) or (
            f.git_oid is not None and not _GIT_OID.match(f.git_oid)
        ):
            raise UnsafeRepository(
                f"{f.path}: the listing gives a malformed hash (sha256 {f.sha256!r},"
                f" git oid {f.git_oid!r})"
            )
    names = {f.path for f in files}
    if len(names) != len(files):
        raise UnsafeRepository(f"{repo}: the listing names a path twice")
    for f in files:
        parent = posixpath.dirname(f.path)
        while parent:
            if parent in names:
                raise UnsafeRepository(f"{repo}: {parent!r} is listed as a file and a directory")
            parent = posixpath.dirname(parent)
    has_safetensors = any(f.path.endswith(".safetensors") for f in files)
    pickles = [f.path for f in files if is_pickle(f.path)]
    if pickles and not has_safetensors:
        raise UnsafeRepository(
            f"{repo}: only pickle weights ({', '.join(sorted(pickles)[:3])}); pickle can run code"
            " when loaded, convert the checkpoint to safetensors"
        )
    return [f for f in files if not is_pickle(f.path)]


def looks_like_lfs_pointer(head: bytes) -> bool:
    return head.startswith(LFS_POINTER_PREFIX)


def validate_safetensors(path: Path, display: str) -> int:
    """Check a safetensors file's header: JSON, dtypes, shapes, offsets in the file, no overlap.

    Returns the number of tensors. Raises `InvalidCheckpoint` naming the file and the problem.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise InvalidCheckpoint(f"{display}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", raw_len)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise InvalidCheckpoint(f"{display}: header length {n} exceeds the file ({size} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidCheckpoint(f"{display}: the header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise InvalidCheckpoint(f"{display}: the header is not a JSON object")
    data_len = size - 8 - n
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise InvalidCheckpoint(f"{display}: __metadata__ must map strings to strings")
            continue
        spans.append(_tensor_span(display, name, info, data_len))
    spans.sort()
    for (_b0, e0, n0), (b1, _e1, n1) in itertools.pairwise(spans):
        if b1 < e0:
            raise InvalidCheckpoint(f"{display}: tensors {n0!r} and {n1!r} overlap")
    return len(spans)


def _tensor_span(display: str, name: str, info: object, data_len: int) -> tuple[int, int, str]:
    if not isinstance(info, dict):
        raise InvalidCheckpoint(f"{display}: tensor {name!r} has no description")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise InvalidCheckpoint(f"{display}: tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise InvalidCheckpoint(f"{display}: tensor {name!r} has an invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
    ):
        raise InvalidCheckpoint(f"{display}: tensor {name!r} has invalid data_offsets")
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise InvalidCheckpoint(
            f"{display}: tensor {name!r} offsets [{begin}, {end}] fall outside the data"
            f" ({data_len} bytes)"
        )
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    if end - begin != expected:
        raise InvalidCheckpoint(
            f"{display}: tensor {name!r} spans {end - begin} bytes, its shape and dtype need {expected}"
        )
    return begin, end, name
