"""One safetensors file: the header parsed and validated by hand, tensors viewed on an mmap.

Viewing a tensor touches no data bytes; only what a caller slices and copies (or computes
with, for a tensor used in place) is ever paged in. The mapping is private (copy on write), so
tensors built on it are writable and never write back to the file.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inference_svc.loader.errors import (
    FileChangedError,
    HeaderFormatError,
    HeaderTooLargeError,
    OffsetOutOfRangeError,
    OverlappingTensorsError,
    PickleCheckpointError,
    SizeMismatchError,
    TruncatedFileError,
    UncoveredBytesError,
    UnsupportedDtypeError,
)

MAX_HEADER_BYTES = 100 * 1024 * 1024
METADATA_KEY = "__metadata__"

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
# Pickle protocol 2+ starts with 0x80; torch.save's zip container with "PK\x03\x04".
_PICKLE_MAGIC = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05", b"PK\x03\x04")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Header:
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int  # 8 + header length


def parse_header(prefix: bytes, file_size: int, path: str | Path = "<bytes>") -> Header:
    """Validate a safetensors header. `prefix` holds at least the first 8 + header-length bytes.

    Raises a `CheckpointError` subclass naming the file and tensor for every malformation.
    """
    # A header length can start with the same bytes as a pickle; the JSON's "{" tells them apart.
    if prefix[8:9] != b"{" and (prefix[:4] in _PICKLE_MAGIC or prefix[:2] in _PICKLE_MAGIC):
        raise PickleCheckpointError(path, "this is a pickle/torch.save file, not safetensors")
    if file_size < 8 or len(prefix) < 8:
        raise TruncatedFileError(
            path, f"{file_size} bytes is too short for the 8-byte header length"
        )
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise HeaderTooLargeError(path, f"header length {n} exceeds the {MAX_HEADER_BYTES} limit")
    if 8 + n > file_size or len(prefix) < 8 + n:
        raise TruncatedFileError(path, f"header of {n} bytes runs past the end ({file_size} bytes)")
    try:
        raw = json.loads(prefix[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise HeaderFormatError(path, f"header is not valid UTF-8 JSON ({e})") from None
    if not isinstance(raw, dict):
        raise HeaderFormatError(path, f"header is a JSON {type(raw).__name__}, not an object")
    data_start = 8 + n
    data_size = file_size - data_start
    metadata = raw.pop(METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise HeaderFormatError(path, "__metadata__ must map strings to strings")
    tensors = {name: _tensor_info(path, name, entry, data_start) for name, entry in raw.items()}
    _check_layout(path, tensors, data_start, data_size)
    return Header(tensors=tensors, metadata=metadata, data_start=data_start)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _tensor_info(path: str | Path, name: str, entry: Any, data_start: int) -> TensorInfo:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise HeaderFormatError(path, "entry must have exactly dtype, shape, data_offsets", name)
    dtype_name, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise UnsupportedDtypeError(path, f"unknown dtype {dtype_name!r}", name)
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise HeaderFormatError(path, f"shape {shape!r} is not a list of non-negative ints", name)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise HeaderFormatError(path, f"data_offsets {offsets!r} is not [begin, end]", name)
    dtype = DTYPES[dtype_name]
    expected = math.prod(shape) * dtype.itemsize
    if expected != offsets[1] - offsets[0]:
        raise SizeMismatchError(
            path,
            f"{dtype_name}{shape} needs {expected} bytes but data_offsets span "
            f"{offsets[1] - offsets[0]}",
            name,
        )
    return TensorInfo(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def _check_layout(
    path: str | Path, tensors: dict[str, TensorInfo], data_start: int, data_size: int
) -> None:
    """Tensors must tile the data region exactly: in range, no overlap, no gap, no tail."""
    end_of_file = data_start + data_size
    for t in tensors.values():
        if t.end > end_of_file:
            raise OffsetOutOfRangeError(
                path,
                f"data_offsets end at {t.end - data_start}, past the {data_size}-byte data region",
                t.name,
            )
    cursor, prev = data_start, None
    for t in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
        if t.start < cursor:
            other = f" with {prev.name!r}" if prev is not None else ""
            raise OverlappingTensorsError(path, f"bytes overlap{other}", t.name)
        if t.start > cursor:
            raise UncoveredBytesError(
                path, f"{t.start - cursor} bytes before it belong to no tensor", t.name
            )
        cursor, prev = t.end, t
    if cursor != end_of_file:
        raise UncoveredBytesError(
            path, f"{end_of_file - cursor} trailing bytes after the last tensor"
        )


class SafetensorsFile:
    """A validated safetensors file; `view(name)` gives a zero-copy tensor on a private mmap."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb", buffering=0) as f:
            st = os.fstat(f.fileno())
            size = st.st_size
            # Reading the header must not read ahead into tensor data nobody asked for.
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
            prefix = f.read(8)
            if len(prefix) == 8:
                (n,) = struct.unpack("<Q", prefix)
                if n <= MAX_HEADER_BYTES:
                    prefix += f.read(n)
        self.header = parse_header(prefix, size, self.path)
        self.file_size = size
        self._identity = _identity(st)
        self._mmap: mmap.mmap | None = None

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        return self.header.tensors

    @property
    def metadata(self) -> dict[str, str]:
        return self.header.metadata

    def mapping(self) -> mmap.mmap:
        if self._mmap is None:
            with open(self.path, "rb") as f:
                # The path is opened again: it must still be the file whose header was validated,
                # else the offsets would point into another file's bytes (or past its end).
                if _identity(os.fstat(f.fileno())) != self._identity:
                    raise FileChangedError(self.path, "replaced or modified since it was opened")
                # ACCESS_COPY: a private mapping, so views are writable and never touch the file.
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._mmap

    def view(self, name: str) -> torch.Tensor:
        """The whole tensor as a view on the mapping: no data is read until it is used."""
        info = self.tensors[name]
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        flat = torch.frombuffer(
            self.mapping(), dtype=torch.uint8, count=info.nbytes, offset=info.start
        )
        return flat.view(info.dtype).view(info.shape)


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
