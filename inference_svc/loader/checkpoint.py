"""A model directory's weights: the safetensors shards (via the index when there is one).

Pickle checkpoints are refused; every shard's header is validated before any weight is used.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from inference_svc.loader.errors import (
    CheckpointNotFoundError,
    IndexFileError,
    PickleCheckpointError,
)
from inference_svc.loader.safetensors_mmap import SafetensorsFile, TensorInfo

INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class Checkpoint:
    """All tensors of a model directory by name, each in the shard that holds it."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.files = [SafetensorsFile(p) for p in self._shard_paths()]
        self._where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for name in f.tensors:
                if name in self._where:
                    raise IndexFileError(
                        f.path, f"also in {self._where[name].path.name}: duplicate tensor", name
                    )
                self._where[name] = f
        self._check_index()

    def _shard_paths(self) -> list[Path]:
        if not self.model_dir.is_dir():
            raise CheckpointNotFoundError(self.model_dir, "not a directory")
        index = self.model_dir / INDEX_NAME
        if index.exists():
            names = sorted(set(self._weight_map(index).values()))
            paths = [self.model_dir / n for n in names]
            for p in paths:
                if not p.is_file():
                    raise CheckpointNotFoundError(p, f"named by {INDEX_NAME} but missing")
            return paths
        paths = sorted(self.model_dir.glob("*.safetensors"))
        if paths:
            return paths
        pickles = sorted(p.name for p in self.model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise PickleCheckpointError(
                self.model_dir,
                f"only pickle checkpoints ({', '.join(pickles)}); convert them to safetensors",
            )
        raise CheckpointNotFoundError(self.model_dir, "no *.safetensors weights")

    def _weight_map(self, index: Path) -> dict[str, str]:
        try:
            raw = json.loads(index.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise IndexFileError(index, f"not valid JSON ({e})") from None
        wm = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(wm, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in wm.items()
        ):
            raise IndexFileError(index, "weight_map must map tensor names to file names")
        for name, file_name in wm.items():
            if Path(file_name).name != file_name or not file_name.endswith(".safetensors"):
                raise IndexFileError(index, f"file {file_name!r} is not a local .safetensors", name)
        return wm

    def _check_index(self) -> None:
        index = self.model_dir / INDEX_NAME
        if not index.exists():
            return
        for name, file_name in self._weight_map(index).items():
            f = self._where.get(name)
            if f is None or f.path.name != file_name:
                raise IndexFileError(index, f"indexed in {file_name} but not found there", name)

    @property
    def names(self) -> list[str]:
        return list(self._where)

    def info(self, name: str) -> TensorInfo:
        return self._where[name].tensors[name]

    def file_of(self, name: str) -> SafetensorsFile:
        return self._where[name]

    def view(self, name: str) -> torch.Tensor:
        return self._where[name].view(name)

    @property
    def total_bytes(self) -> int:
        return sum(f.tensors[n].nbytes for n, f in self._where.items())
