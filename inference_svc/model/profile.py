"""Measure the peak bytes of tensors alive during a forward pass.

On CUDA the caching allocator's peak counter does this. On CPU there is no such counter, so a
dispatch mode records each new storage an op creates and notices when it is freed.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class StoragePeakTracker(TorchDispatchMode):
    """Peak of the sum of live storages created inside the `with` block."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _freed(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # Outputs that alias an input (in-place ops, views of weights) allocate nothing.
        inputs = {
            t.untyped_storage().data_ptr()
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key, n = storage.data_ptr(), storage.nbytes()
            if n == 0 or key in self._live or key in inputs:
                continue
            self._live[key] = n
            self.current += n
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._freed, key)
        return out
