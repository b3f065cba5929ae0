"""The safetensors reader: agreement with the safetensors library, zero-copy views, and a
corpus plus a fuzz of malformed headers that must end in typed errors only."""

from __future__ import annotations

import contextlib
import json
import pickle
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from inference_svc.loader import errors
from inference_svc.loader.safetensors_mmap import (
    MAX_HEADER_BYTES,
    SafetensorsFile,
    parse_header,
)


def raw_file(header: object, data: bytes = b"", *, length: int | None = None) -> bytes:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(blob) if length is None else length) + blob + data


def write(tmp_path: Path, content: bytes, name: str = "x.safetensors") -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    return path


def test_matches_safetensors_library_for_every_dtype(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(7, generator=g).bfloat16(),
        "f16": torch.randn(2, 2, 2, generator=g).half(),
        "i64": torch.arange(6).view(2, 3),
        "u8": torch.arange(5, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), {"format": "pt"})
    f = SafetensorsFile(path)
    assert f.metadata == {"format": "pt"}
    assert set(f.tensors) == set(tensors)
    for name, t in tensors.items():
        got = f.view(name)
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got, t), name


def test_view_is_zero_copy_on_the_mapping(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.arange(1024, dtype=torch.float32)}, str(path))
    f = SafetensorsFile(path)
    view = f.view("a")
    import ctypes

    base = ctypes.addressof(ctypes.c_char.from_buffer(f.mapping()))
    assert view.data_ptr() == base + f.tensors["a"].start
    view[0] = 42.0  # a private mapping: writable, the file stays as it was
    assert SafetensorsFile(path).view("a")[0].item() == 0.0
    del base


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}

# (header, data, length override, expected error, tensor named in the error)
CORPUS: list[tuple[str, bytes, type[errors.CheckpointError], str | None]] = [
    ("too short", b"\x01\x02", errors.TruncatedFileError, None),
    (
        "header over limit",
        raw_file(b"{}", length=MAX_HEADER_BYTES + 1),
        errors.HeaderTooLargeError,
        None,
    ),
    ("header past end", raw_file(b"{}", length=1000), errors.TruncatedFileError, None),
    ("bad json", raw_file(b"{not json"), errors.HeaderFormatError, None),
    ("not utf-8", raw_file(b'{"\xff": 1}'), errors.HeaderFormatError, None),
    ("json array", raw_file([1, 2]), errors.HeaderFormatError, None),
    ("deep nesting", raw_file(b"[" * 100000 + b"]" * 100000), errors.HeaderFormatError, None),
    (
        "unknown dtype",
        raw_file({"a": {"dtype": "F7", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)),
        errors.UnsupportedDtypeError,
        "a",
    ),
    (
        "negative dim",
        raw_file({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8)),
        errors.HeaderFormatError,
        "a",
    ),
    (
        "bool dim",
        raw_file({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, bytes(4)),
        errors.HeaderFormatError,
        "a",
    ),
    (
        "missing key",
        raw_file({"a": {"dtype": "F32", "shape": [2]}}, bytes(8)),
        errors.HeaderFormatError,
        "a",
    ),
    (
        "reversed offsets",
        raw_file({"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}}, bytes(8)),
        errors.HeaderFormatError,
        "a",
    ),
    (
        "size mismatch",
        raw_file({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)),
        errors.SizeMismatchError,
        "a",
    ),
    (
        "offset out of range",
        raw_file({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8)),
        errors.OffsetOutOfRangeError,
        "a",
    ),
    ("truncated data", raw_file(GOOD, bytes(5)), errors.OffsetOutOfRangeError, "a"),
    (
        "overlap",
        raw_file(
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            bytes(12),
        ),
        errors.OverlappingTensorsError,
        "b",
    ),
    (
        "gap",
        raw_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)),
        errors.UncoveredBytesError,
        "a",
    ),
    ("trailing bytes", raw_file(GOOD, bytes(12)), errors.UncoveredBytesError, None),
    (
        "bad metadata",
        raw_file({"__metadata__": {"k": 1}, **GOOD}, bytes(8)),
        errors.HeaderFormatError,
        None,
    ),
    ("pickle", pickle.dumps({"a": [1.0, 2.0]}, protocol=4), errors.PickleCheckpointError, None),
    ("torch.save zip", b"PK\x03\x04" + bytes(60), errors.PickleCheckpointError, None),
]


@pytest.mark.parametrize(("case", "content", "error", "tensor"), CORPUS, ids=[c[0] for c in CORPUS])
def test_malformed_corpus_raises_typed_error_naming_file_and_tensor(
    tmp_path: Path,
    case: str,
    content: bytes,
    error: type[errors.CheckpointError],
    tensor: str | None,
) -> None:
    path = write(tmp_path, content)
    with pytest.raises(error) as info:
        SafetensorsFile(path)
    assert str(path) in str(info.value)
    assert info.value.tensor == tensor
    if tensor is not None:
        assert repr(tensor) in str(info.value)


def test_torch_save_file_is_refused_as_pickle(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    torch.save({"w": torch.zeros(2)}, path)
    with pytest.raises(errors.PickleCheckpointError, match="pickle"):
        SafetensorsFile(path)


def test_valid_corpus_entry_parses() -> None:
    content = raw_file(GOOD, bytes(8))
    header = parse_header(content, len(content))
    assert header.tensors["a"].shape == (2,)
    assert header.tensors["a"].nbytes == 8


@st.composite
def mutated_headers(draw: st.DrawFn) -> bytes:
    """A valid file with its header bytes mutated, or a header made from arbitrary JSON."""
    entries = {
        "w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
        "b": {"dtype": "F32", "shape": [3], "data_offsets": [12, 24]},
    }
    base = bytearray(raw_file(entries, bytes(24)))
    choice = draw(st.integers(0, 2))
    if choice == 0:  # flip bytes anywhere in the length or the JSON
        for _ in range(draw(st.integers(1, 6))):
            i = draw(st.integers(0, len(base) - 25))
            base[i] = draw(st.integers(0, 255))
        return bytes(base)
    if choice == 1:  # truncate anywhere
        return bytes(base[: draw(st.integers(0, len(base)))])
    json_values = st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**70), 2**70)
        | st.floats()
        | st.text(max_size=8),
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
        ),
        max_leaves=12,
    )
    header = draw(st.dictionaries(st.sampled_from(["w", "b", "__metadata__", "x"]), json_values))
    return raw_file(header, bytes(draw(st.integers(0, 32))))


@settings(
    max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(content=mutated_headers())
def test_fuzzed_headers_only_raise_typed_errors(content: bytes) -> None:
    try:
        header = parse_header(content, len(content), "fuzz.safetensors")
    except errors.CheckpointError as e:
        assert "fuzz.safetensors" in str(e)
        return
    # Accepted: every tensor then lies inside the file and the byte counts agree.
    for info in header.tensors.values():
        assert header.data_start <= info.start <= info.end <= len(content)
        n = 1
        for dim in info.shape:
            n *= dim
        assert n * info.dtype.itemsize == info.nbytes


@settings(max_examples=200, deadline=None, database=None)
@given(prefix=st.binary(max_size=64))
def test_arbitrary_bytes_only_raise_typed_errors(prefix: bytes) -> None:
    with contextlib.suppress(errors.CheckpointError):
        parse_header(prefix, len(prefix), "raw.safetensors")


def test_header_length_that_looks_like_pickle_magic_is_still_safetensors(tmp_path: Path) -> None:
    entries = {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}
    blob = json.dumps(entries).encode()
    blob += b" " * (0x0280 - len(blob))  # header length 640 = b"\x80\x02\x00..."
    path = write(tmp_path, raw_file(blob, b"\x07"))
    assert path.read_bytes()[:2] == b"\x80\x02"
    assert SafetensorsFile(path).view("a").tolist() == [7]


def test_unaligned_tensor_is_viewed_and_copied_when_installed(tmp_path: Path) -> None:
    from torch import nn

    from inference_svc.model.parallel import materialize, usable_in_place

    blob = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    blob += b" " * (3 - len(blob) % 4 + 4)  # data starts 3 bytes past a 4-byte boundary
    path = write(tmp_path, raw_file(blob, torch.arange(4, dtype=torch.float32).numpy().tobytes()))
    view = SafetensorsFile(path).view("a")
    assert view.data_ptr() % 4 != 0 and view.tolist() == [0.0, 1.0, 2.0, 3.0]
    meta = nn.Parameter(torch.empty(4, device="meta"), requires_grad=False)
    assert not usable_in_place(meta, view)
    installed = materialize(meta, view)
    assert installed.data_ptr() % 4 == 0 and installed.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_file_replaced_after_its_header_was_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.arange(64, dtype=torch.float32)}, str(path))
    f = SafetensorsFile(path)
    # Another file renamed over it (as a cache refresh would): same name, other bytes and size.
    other = tmp_path / "other.safetensors"
    save_file({"a": torch.arange(8, dtype=torch.float32)}, str(other))
    other.replace(path)
    with pytest.raises(errors.FileChangedError, match="replaced or modified"):
        f.view("a")
    assert SafetensorsFile(path).view("a").tolist() == list(range(8))
