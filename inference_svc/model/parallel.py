"""Tensor-parallel layers. Each owns a `weight_loader(param, loaded, shard_id)` that installs the
slice the TP plan (`inference_svc.loader.tp_plan`) chose for this rank.

Weights are created on the meta device; the loader installs real tensors. A tensor that already
has the parameter's shape, dtype and layout is used in place (zero copy from the mapping);
anything else is copied once into a fresh buffer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

META = torch.device("meta")


@dataclass(frozen=True)
class TPGroup:
    """This process's place in its tensor-parallel group.

    `pg` is a c10d process group object (gloo or NCCL) used directly, not the global default
    group, so one process can hold several executors; None at TP=1.
    """

    rank: int = 0
    size: int = 1
    pg: Any = field(default=None, compare=False, repr=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            self.pg.allreduce([x]).wait()
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """x from rank 0, in place on every rank."""
        if self.size > 1:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            self.pg.broadcast([x], opts).wait()
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's x along the last dim on rank 0; other ranks get None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self.pg.gather([parts], [x], opts).wait()
            return torch.cat(parts, dim=-1)
        self.pg.gather([], [x], opts).wait()
        return None


def padded_vocab_size(vocab_size: int, tp_size: int, multiple: int = 64) -> int:
    """Vocabulary rows padded so that every rank holds the same whole number of 64-row groups.

    TP=1 is not padded: the checkpoint tensor is then used as is (zero copy on CPU).
    """
    if tp_size == 1:
        return vocab_size
    step = multiple * tp_size
    return -(-vocab_size // step) * step


def _meta_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=META), requires_grad=False)


def usable_in_place(param: nn.Parameter, loaded: torch.Tensor) -> bool:
    """Whether `loaded` can become the parameter as is: no cast, no padding, dense rows, and
    element-aligned (a safetensors file may place a tensor at any byte offset)."""
    return (
        loaded.shape == param.shape
        and loaded.dtype == param.dtype
        and loaded.is_contiguous()
        and loaded.data_ptr() % loaded.element_size() == 0
    )


def materialize(param: nn.Parameter, loaded: torch.Tensor) -> nn.Parameter:
    """The parameter to install for `loaded`: itself when usable in place, else one copy of it.

    `loaded` may have fewer leading rows than the parameter (vocabulary padding); the rest is zero.
    """
    if loaded.dim() != param.dim() or loaded.shape[1:] != param.shape[1:]:
        raise ValueError(f"loaded shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    if loaded.shape[0] > param.shape[0]:
        raise ValueError(f"loaded {loaded.shape[0]} rows into a parameter of {param.shape[0]}")
    if usable_in_place(param, loaded):
        return nn.Parameter(loaded, requires_grad=False)
    out = torch.empty(param.shape, dtype=param.dtype, device=loaded.device)
    out[: loaded.shape[0]].copy_(loaded)
    if loaded.shape[0] < param.shape[0]:
        out[loaded.shape[0] :].zero_()
    return nn.Parameter(out, requires_grad=False)


class Loadable(nn.Module):
    """A module whose parameters are installed by `weight_loader` (replicated by default)."""

    def _slots(self) -> Iterator[tuple[nn.Module, str]]:
        for key in self._parameters:
            yield self, key
        for child in self.children():
            if isinstance(child, nn.ParameterDict):
                for key in child._parameters:
                    yield child, key

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None
    ) -> None:
        for owner, key in self._slots():
            if owner._parameters[key] is param:
                owner._parameters[key] = materialize(param, loaded)
                return
        raise KeyError(f"{type(self).__name__} does not own the parameter given (shard {shard_id})")


class ColumnParallelLinear(Loadable):
    """y = x W^T with W's output rows split over ranks; each rank returns its part of y."""

    def __init__(self, in_features: int, out_per_rank: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = _meta_param(out_per_rank, in_features, dtype=dtype)
        self.bias = _meta_param(out_per_rank, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(Loadable):
    """Several column-parallel projections of one input (gate/up), one weight per shard id.

    Kept as separate tensors rather than one fused matrix so each can stay in place in the mapping.
    """

    def __init__(
        self, in_features: int, out_per_rank: dict[str, int], bias: bool, dtype: torch.dtype
    ):
        super().__init__()
        self.shard_ids = tuple(out_per_rank)  # output order (ParameterDict sorts a dict's keys)
        self.weight = nn.ParameterDict(
            {k: _meta_param(n, in_features, dtype=dtype) for k, n in out_per_rank.items()}
        )
        self.bias = (
            nn.ParameterDict({k: _meta_param(n, dtype=dtype) for k, n in out_per_rank.items()})
            if bias
            else None
        )

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None
    ) -> None:
        """Install `loaded` as the part `shard_id` (e.g. "q", "gate") of the weight or bias."""
        for group in (self.weight, self.bias):
            if shard_id is not None and group is not None and group.get(shard_id) is param:
                group._parameters[shard_id] = materialize(param, loaded)
                return
        raise KeyError(f"{type(self).__name__} has no part {shard_id!r} holding that parameter")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(
            F.linear(x, self.weight[k], None if self.bias is None else self.bias[k])
            for k in self.shard_ids
        )


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections; query heads split over ranks, KV heads split or replicated."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
    ):
        self.heads_per_rank = num_heads // tp.size
        self.kv_heads_per_rank = max(1, num_kv_heads // tp.size)  # replicated when TP > KV heads
        q, kv = self.heads_per_rank * head_dim, self.kv_heads_per_rank * head_dim
        super().__init__(hidden, {"q": q, "k": kv, "v": kv}, bias, dtype)


class RowParallelLinear(Loadable):
    """y = x W^T with W's input columns split over ranks; partial sums are all-reduced."""

    def __init__(
        self, in_per_rank: int, out_features: int, bias: bool, tp: TPGroup, dtype: torch.dtype
    ):
        super().__init__()
        self.tp = tp
        self.weight = _meta_param(out_features, in_per_rank, dtype=dtype)
        self.bias = _meta_param(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias  # bias once, after the sum


class VocabParallelEmbedding(Loadable):
    """Embedding rows split over ranks (vocabulary padded); each rank looks up the ids it owns."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = padded_vocab_size(vocab_size, tp.size) // tp.size
        self.start = tp.rank * self.rows_per_rank
        self.weight = _meta_param(self.rows_per_rank, hidden, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection with vocabulary rows split like the embedding (so it can be tied)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        raise TypeError("use logits(), which gathers the vocabulary shards on rank 0")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(N, hidden) -> float32 (N, vocab_size) on rank 0, padding removed; None elsewhere."""
        local = F.linear(hidden, self.weight)  # (N, rows_per_rank)
        full = self.tp.gather_last_dim(local)
        return None if full is None else full[:, : self.vocab_size].float()
