"""A model directory's shards: index agreement, missing shards, duplicates, pickle refusal."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from inference_svc.loader import errors
from inference_svc.loader.checkpoint import INDEX_NAME, Checkpoint
from inference_svc.testing.models import ModelSpec, cached_model


@pytest.fixture
def model_copy(tmp_path: Path) -> Path:
    src = cached_model(ModelSpec(family="llama"))
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    return dst


def test_reads_every_tensor_of_a_sharded_checkpoint(model_copy: Path) -> None:
    ckpt = Checkpoint(model_copy)
    index = json.loads((model_copy / INDEX_NAME).read_text())
    assert sorted(ckpt.names) == sorted(index["weight_map"])
    assert len(ckpt.files) == 3
    assert ckpt.total_bytes == index["metadata"]["total_size"]


def test_missing_shard_is_named(model_copy: Path) -> None:
    (model_copy / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(errors.CheckpointNotFoundError, match="model-00002-of-00003"):
        Checkpoint(model_copy)


def test_index_that_disagrees_with_the_shards_is_refused(model_copy: Path) -> None:
    index = json.loads((model_copy / INDEX_NAME).read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00003.safetensors"
    index["weight_map"]["model.ghost.weight"] = "model-00001-of-00003.safetensors"
    (model_copy / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(errors.IndexFileError) as info:
        Checkpoint(model_copy)
    assert info.value.tensor in ("model.norm.weight", "model.ghost.weight")


def test_index_pointing_outside_the_directory_is_refused(model_copy: Path) -> None:
    index = {"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}}
    (model_copy / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(errors.IndexFileError, match="not a local"):
        Checkpoint(model_copy)
    (model_copy / INDEX_NAME).write_text("{broken")
    with pytest.raises(errors.IndexFileError, match="JSON"):
        Checkpoint(model_copy)


def test_duplicate_tensor_across_shards_is_refused(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(2)}, str(tmp_path / "one.safetensors"))
    save_file({"a": torch.ones(2)}, str(tmp_path / "two.safetensors"))
    with pytest.raises(errors.IndexFileError, match="duplicate") as info:
        Checkpoint(tmp_path)
    assert info.value.tensor == "a"


def test_pickle_only_directory_is_refused(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(errors.PickleCheckpointError, match=r"pytorch_model\.bin"):
        Checkpoint(tmp_path)


def test_pickle_next_to_safetensors_is_ignored(model_copy: Path) -> None:
    torch.save({"w": torch.zeros(2)}, model_copy / "pytorch_model.bin")
    assert "model.norm.weight" in Checkpoint(model_copy).names


def test_empty_or_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(errors.CheckpointNotFoundError, match=r"no \*\.safetensors"):
        Checkpoint(tmp_path)
    with pytest.raises(errors.CheckpointNotFoundError, match="not a directory"):
        Checkpoint(tmp_path / "nope")


def test_a_corrupt_shard_is_reported_with_its_tensor(model_copy: Path) -> None:
    shard = model_copy / "model-00003-of-00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])  # truncated download
    with pytest.raises(errors.OffsetOutOfRangeError) as info:
        Checkpoint(model_copy)
    assert str(shard) in str(info.value) and info.value.tensor is not None
