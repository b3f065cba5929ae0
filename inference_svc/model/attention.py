"""Attention over the paged KV cache: the step metadata the engine builds, and the layer's attend.

Cache layout per layer and rank: (2, num_blocks, block_size, num_kv_heads_per_rank, head_dim).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from kernels.paged_attention_ref import paged_attention, write_kv


@dataclass
class AttentionMetadata:
    """One forward step over a flattened batch of sequences (prefill chunks and decodes alike)."""

    query_start_loc: torch.Tensor  # (B+1,) int64; new tokens of seq i are [qsl[i], qsl[i+1])
    seq_lens: torch.Tensor  # (B,) int64 context length of seq i including this step's tokens
    block_tables: torch.Tensor  # (B, max_blocks_per_seq) int64 physical block ids, padded with 0
    slot_mapping: torch.Tensor  # (T,) int64 block_id * block_size + offset per new token
    block_size: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @cached_property
    def query_start_loc_list(self) -> list[int]:
        return [int(x) for x in self.query_start_loc.tolist()]

    @cached_property
    def seq_lens_list(self) -> list[int]:
        return [int(x) for x in self.seq_lens.tolist()]

    def to(self, device: torch.device | str) -> AttentionMetadata:
        """On `device`; self when already there (keeps the cached python lists)."""
        if self.slot_mapping.device == torch.device(device) and all(
            t.device == self.slot_mapping.device
            for t in (self.query_start_loc, self.seq_lens, self.block_tables)
        ):
            return self
        return AttentionMetadata(
            query_start_loc=self.query_start_loc.to(device),
            seq_lens=self.seq_lens.to(device),
            block_tables=self.block_tables.to(device),
            slot_mapping=self.slot_mapping.to(device),
            block_size=self.block_size,
        )

    @classmethod
    def for_prefill(cls, seq_lens: list[int], block_size: int) -> AttentionMetadata:
        """Whole-prompt prefill of fresh sequences on consecutive blocks (profiling, tests)."""
        blocks_per_seq = [-(-n // block_size) for n in seq_lens]
        width = max(blocks_per_seq, default=1)
        tables = torch.zeros(len(seq_lens), width, dtype=torch.int64)
        slots: list[torch.Tensor] = []
        next_block = 0
        for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
            ids = torch.arange(next_block, next_block + nb, dtype=torch.int64)
            tables[i, :nb] = ids
            pos = torch.arange(n, dtype=torch.int64)
            slots.append(ids[pos // block_size] * block_size + pos % block_size)
            next_block += nb
        qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
        qsl[1:] = torch.cumsum(torch.tensor(seq_lens, dtype=torch.int64), 0)
        return cls(
            query_start_loc=qsl,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            block_tables=tables,
            slot_mapping=torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64),
            block_size=block_size,
        )


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V (T, KVH, D) into the cache, then attend q (T, H, D) over each context.

    On CUDA the Triton kernel runs; on CPU the PyTorch reference (its oracle).
    """
    write_kv(kv_cache, k, v, meta.slot_mapping)
    if q.is_cuda:
        from kernels.paged_attention import paged_attention as triton_paged_attention

        return triton_paged_attention(q, kv_cache, meta, scale)
    return paged_attention(q, kv_cache, meta, scale)
