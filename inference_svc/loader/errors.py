"""Typed checkpoint errors. Each names the file (and tensor, where one is at fault)."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(Exception):
    """A checkpoint cannot be used; the message says which file and tensor, and why."""

    def __init__(self, path: str | Path, message: str, tensor: str | None = None):
        self.path = str(path)
        self.tensor = tensor
        where = f"{self.path}: tensor {tensor!r}" if tensor is not None else self.path
        super().__init__(f"{where}: {message}")


class CheckpointNotFoundError(CheckpointError):
    """No safetensors weights in the directory, or a file the index names is missing."""


class PickleCheckpointError(CheckpointError):
    """A pickle-based checkpoint (.bin/.pt/.pth/.ckpt): refused, loading it would run code."""


class HeaderTooLargeError(CheckpointError):
    """The 8-byte header length exceeds the limit."""


class TruncatedFileError(CheckpointError):
    """The file ends before its header or its data region does."""


class FileChangedError(CheckpointError):
    """The file was replaced or resized after its header was validated."""


class HeaderFormatError(CheckpointError):
    """The header is not the JSON object safetensors defines (bad JSON, keys, types)."""


class UnsupportedDtypeError(CheckpointError):
    """A tensor's dtype is not one safetensors defines (or torch can hold)."""


class SizeMismatchError(CheckpointError):
    """shape x itemsize differs from the tensor's byte span."""


class OffsetOutOfRangeError(CheckpointError):
    """A tensor's data_offsets point outside the data region."""


class OverlappingTensorsError(CheckpointError):
    """Two tensors share bytes."""


class UncoveredBytesError(CheckpointError):
    """The data region has bytes no tensor owns (a gap, or trailing bytes)."""


class IndexFileError(CheckpointError):
    """model.safetensors.index.json is malformed or disagrees with the shards."""


class MissingTensorError(CheckpointError):
    """The model needs a tensor the checkpoint does not have."""


class UnexpectedTensorError(CheckpointError):
    """The checkpoint has a tensor the model does not know, or one with the wrong shape."""


class PreshardError(CheckpointError):
    """A pre-sharded checkpoint is malformed or was written for another TP size."""
