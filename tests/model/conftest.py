"""Model test helpers: a minimal paged-KV bookkeeper that drives an executor like the engine."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from inference_svc.model.attention import AttentionMetadata
from inference_svc.model.executor import ModelExecutor


class PagedBatch:
    """Sequences on a shared block pool; blocks handed out in a shuffled order."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0):
        self.block_size = block_size
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=g).tolist()
        self.tokens: list[list[int]] = []
        self.blocks: list[list[int]] = []

    def add(self, prompt: list[int]) -> int:
        self.tokens.append([])
        self.blocks.append([])
        self.pending = getattr(self, "pending", {})
        self.pending[len(self.tokens) - 1] = list(prompt)
        return len(self.tokens) - 1

    def step(self, executor: ModelExecutor, new: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run the given new tokens for each sequence; logits of each sequence's last new token."""
        ids, pos, slots, qsl, lens, order = [], [], [], [0], [], []
        for seq, toks in new.items():
            start = len(self.tokens[seq])
            for i, tok in enumerate(toks):
                p = start + i
                if p // self.block_size >= len(self.blocks[seq]):
                    self.blocks[seq].append(self.free.pop())
                ids.append(tok)
                pos.append(p)
                slots.append(
                    self.blocks[seq][p // self.block_size] * self.block_size + p % self.block_size
                )
            self.tokens[seq].extend(toks)
            qsl.append(qsl[-1] + len(toks))
            lens.append(len(self.tokens[seq]))
            order.append(seq)
        width = max(len(self.blocks[s]) for s in order)
        tables = torch.zeros(len(order), width, dtype=torch.int64)
        for i, s in enumerate(order):
            tables[i, : len(self.blocks[s])] = torch.tensor(self.blocks[s])
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl),
            seq_lens=torch.tensor(lens),
            block_tables=tables,
            slot_mapping=torch.tensor(slots),
            block_size=self.block_size,
        )
        last = torch.tensor(qsl[1:]) - 1
        logits = executor.execute(torch.tensor(ids), torch.tensor(pos), meta, last)
        return {s: logits[i] for i, s in enumerate(order)}


def greedy(executor: ModelExecutor, prompts: list[list[int]], steps: int, block_size: int = 4,
           num_blocks: int = 256) -> list[list[int]]:  # fmt: skip
    """All prompts prefilled in one step, then decoded together for `steps` tokens."""
    executor.allocate_kv_cache(num_blocks, block_size)
    batch = PagedBatch(num_blocks, block_size)
    seqs = [batch.add(p) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    logits = batch.step(executor, {s: prompts[s] for s in seqs})
    for _ in range(steps):
        nxt = {s: int(logits[s].argmax()) for s in seqs}
        for s, t in nxt.items():
            out[s].append(t)
        logits = batch.step(executor, {s: [t] for s, t in nxt.items()})
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.fixture
def rel() -> Callable[[torch.Tensor, torch.Tensor], float]:
    return rel_err


PROMPTS = [
    [0, 17, 42, 300, 5, 9, 88, 123, 7],
    [0, 250, 3, 3, 60],
    [0, 11, 400, 401, 402, 99, 17, 42, 300, 5, 9, 88, 123, 7, 2, 19, 33],
]
