"""Unsafe or broken repositories are refused before anything is published (safety.py)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cache_sidecar.errors import InvalidCheckpoint, UnsafeRepository
from cache_sidecar.refs import ModelRef
from cache_sidecar.safety import check_path, select_files, validate_safetensors
from cache_sidecar.sources.base import RemoteFile
from inference_svc.testing.range_mirror import RangeMirror

from .conftest import make_cache, small_repo


@pytest.mark.parametrize(
    "path", ["../evil.json", "a/../../b", "/etc/passwd", "a//b", "./x", "a\\b", "", "a/."]
)
def test_escaping_paths_are_refused(path: str) -> None:
    with pytest.raises(UnsafeRepository, match="escapes the repository"):
        check_path(path)


@pytest.mark.parametrize("path", ["config.json", "sub/dir/model.safetensors", "a..b.txt"])
def test_plain_paths_pass(path: str) -> None:
    check_path(path)


def test_pickle_only_is_refused_and_pickle_beside_safetensors_is_skipped() -> None:
    cfg = RemoteFile("config.json", 10, "a" * 40)
    pickle = RemoteFile("pytorch_model.bin", 100, "b" * 40, "c" * 64)
    with pytest.raises(UnsafeRepository, match="only pickle weights"):
        select_files([cfg, pickle], "org/p")
    st = RemoteFile("model.safetensors", 100, "d" * 40, "e" * 64)
    assert select_files([cfg, pickle, st], "org/p") == [cfg, st]


def _header_file(tmp_path: Path, header: object, data_len: int, raw: bytes | None = None) -> Path:
    body = raw if raw is not None else json.dumps(header).encode()
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", len(body)) + body + b"\0" * data_len)
    return p


def test_real_safetensors_file_validates(tmp_path: Path) -> None:
    save_file(
        {"a": torch.zeros(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)},
        tmp_path / "ok.safetensors",
        metadata={"format": "pt"},
    )
    assert validate_safetensors(tmp_path / "ok.safetensors", "ok.safetensors") == 2


@pytest.mark.parametrize(
    ("header", "data_len", "message"),
    [
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 8, "fall outside"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}}, 16, "need 8"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "v": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 16, "overlap"),
        ({"w": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, 8, "unknown dtype"),
        ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, 8, "invalid shape"),
        ({"__metadata__": {"k": 1}}, 0, "__metadata__"),
        ([1, 2], 0, "not a JSON object"),
    ],
)  # fmt: skip
def test_invalid_headers_are_named(
    tmp_path: Path, header: object, data_len: int, message: str
) -> None:
    with pytest.raises(InvalidCheckpoint, match=message):
        validate_safetensors(_header_file(tmp_path, header, data_len), "x.safetensors")


def test_header_not_json_or_too_long(tmp_path: Path) -> None:
    with pytest.raises(InvalidCheckpoint, match="not valid JSON"):
        validate_safetensors(_header_file(tmp_path, None, 0, raw=b"{nope"), "x")
    p = tmp_path / "short.safetensors"
    p.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(InvalidCheckpoint, match="exceeds the file"):
        validate_safetensors(p, "x")


# ---- end to end through the cache: nothing is published


def _assert_unpublished(tmp_path: Path, repo: str, commit: str) -> None:
    vol = tmp_path / "vol"
    assert not (vol / f"models--{repo.replace('/', '--')}" / "snapshots").exists()
    assert not (
        vol / ".weightcache" / "manifests" / f"models--{repo.replace('/', '--')}" / f"{commit}.json"
    ).exists()


def test_traversal_in_the_listing_is_refused(range_mirror: RangeMirror, tmp_path: Path) -> None:
    range_mirror.publish("org/t", small_repo(tmp_path / "t"))
    commit = range_mirror.put_file("org/t", "../../outside.json", b"{}")
    cache = make_cache(tmp_path / "vol", range_mirror.url)
    with pytest.raises(UnsafeRepository, match=r"'\.\./\.\./outside\.json'.*escapes"):
        cache.ensure(ModelRef("org/t", commit))
    _assert_unpublished(tmp_path, "org/t", commit)
    assert range_mirror.requests == {}  # refused before any byte was fetched
    assert not (tmp_path / "outside.json").exists()


def test_pickle_only_repo_is_refused(range_mirror: RangeMirror, tmp_path: Path) -> None:
    src = tmp_path / "p"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "pytorch_model.bin").write_bytes(b"\x80\x02pickle")
    commit = range_mirror.publish("org/p", src)
    with pytest.raises(UnsafeRepository, match=r"only pickle weights.*convert"):
        make_cache(tmp_path / "vol", range_mirror.url).ensure(ModelRef("org/p", commit))
    _assert_unpublished(tmp_path, "org/p", commit)


def test_pickle_files_beside_safetensors_are_not_fetched(
    range_mirror: RangeMirror, tmp_path: Path
) -> None:
    src = small_repo(tmp_path / "m")
    (src / "pytorch_model.bin").write_bytes(b"\x80\x02pickle")
    commit = range_mirror.publish("org/m", src)
    pub = make_cache(tmp_path / "vol", range_mirror.url).ensure(ModelRef("org/m", commit))
    assert not (pub.path / "pytorch_model.bin").exists()
    assert range_mirror.requests.get("pytorch_model.bin", 0) == 0


def test_invalid_safetensors_is_never_published(range_mirror: RangeMirror, tmp_path: Path) -> None:
    src = small_repo(tmp_path / "bad")
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated, its sha matches
    commit = range_mirror.publish("org/bad", src)
    with pytest.raises(InvalidCheckpoint, match=r"model\.safetensors: tensor 'w' offsets"):
        make_cache(tmp_path / "vol", range_mirror.url).ensure(ModelRef("org/bad", commit))
    _assert_unpublished(tmp_path, "org/bad", commit)


def test_lfs_pointer_as_content_fails_the_revision(
    range_mirror: RangeMirror, tmp_path: Path
) -> None:
    from inference_svc.testing.range_mirror import Fault

    commit = range_mirror.publish("org/ptr", small_repo(tmp_path / "ptr"))
    range_mirror.faults["model.safetensors"] = Fault(lfs_pointer_as_content=True)
    with pytest.raises(UnsafeRepository, match="Git LFS pointer"):
        make_cache(tmp_path / "vol", range_mirror.url).ensure(ModelRef("org/ptr", commit))
    _assert_unpublished(tmp_path, "org/ptr", commit)


def test_path_listed_as_file_and_directory_is_refused() -> None:
    files = [RemoteFile("a", 1, "a" * 40), RemoteFile("a/b.json", 1, "b" * 40)]
    with pytest.raises(UnsafeRepository, match="listed as a file and a directory"):
        select_files(files, "org/x")


@pytest.mark.parametrize(
    ("git_oid", "sha256"),
    [
        ("a" * 40, "../../../models--other--repo/blobs/" + "e" * 64),  # an existing blob elsewhere
        ("../../../../tmp/evil", None),  # would name a lock file outside the volume
        ("a" * 40, "E" * 64),
        ("a" * 39, None),
    ],
)
def test_malformed_hashes_in_the_listing_are_refused(git_oid: str, sha256: str | None) -> None:
    with pytest.raises(UnsafeRepository, match="malformed hash"):
        select_files([RemoteFile("model.safetensors", 100, git_oid, sha256)], "org/x")


def test_a_hash_naming_a_blob_outside_the_repo_never_publishes_it(
    range_mirror: RangeMirror, tmp_path: Path
) -> None:
    cache = make_cache(tmp_path / "vol", range_mirror.url)
    other = cache.store.root / "secret.txt"
    other.write_text("not weights")
    cache.store.blob_path("org/t", "x").parent.mkdir(parents=True)  # as after an earlier fetch
    commit = range_mirror.put_file("org/t", "config.json", b"{}")
    # The mirror lies: the blob name walks out of the repo to a file that exists on the volume.
    range_mirror.repos["org/t"].trees[commit]["config.json"].git_oid = "../../secret.txt"
    with pytest.raises(UnsafeRepository):
        cache.ensure(ModelRef("org/t", commit))
    assert cache.published("org/t", commit) is None
