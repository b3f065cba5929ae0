"""ModelRunner: turns a SchedulerOutput into flat input tensors and AttentionMetadata, runs the
executor, and samples one token for every sequence that reached the end of its known tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from inference_svc.engine.sampler import SamplerOutput, SamplingRow, sample
from inference_svc.engine.scheduler import ScheduledRequest, SchedulerOutput
from inference_svc.model.attention import AttentionMetadata


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # (S,) rows of the flat batch whose logits are sampled
    sampled: list[ScheduledRequest]  # the S sequences, in logits order


def build_step_inputs(scheduled: list[ScheduledRequest], block_size: int) -> StepInputs:
    """Flatten the step's sequences; a sequence's new tokens sit at positions start..start+n-1."""
    ids: list[int] = []
    positions: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    for s in scheduled:
        ids.extend(s.request.token_ids[s.start : s.start + s.num_new])
        positions.extend(range(s.start, s.start + s.num_new))
        qsl.append(qsl[-1] + s.num_new)
        seq_lens.append(s.start + s.num_new)
    width = max((len(s.block_ids) for s in scheduled), default=1)
    tables = torch.zeros((len(scheduled), width), dtype=torch.int64)
    for i, s in enumerate(scheduled):
        tables[i, : len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.int64)
    pos = torch.tensor(positions, dtype=torch.int64)
    seq_index = torch.repeat_interleave(
        torch.arange(len(scheduled)), torch.tensor([s.num_new for s in scheduled])
    )
    slots = tables[seq_index, pos // block_size] * block_size + pos % block_size
    sampled = [s for s in scheduled if s.samples]
    logits_indices = [qsl[i + 1] - 1 for i, s in enumerate(scheduled) if s.samples]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        block_tables=tables,
        slot_mapping=slots,
        block_size=block_size,
    )
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=pos,
        meta=meta,
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
        sampled=sampled,
    )


class ModelRunner:
    """Drives one executor; holds per-request sampling generators (seeded requests only)."""

    def __init__(self, executor: Any, block_size: int, device: str = "cpu") -> None:
        self.executor = executor
        self.block_size = block_size
        self.device = torch.device(device)
        self._generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, s: ScheduledRequest) -> torch.Generator | None:
        seed = s.request.params.seed
        if seed is None:
            return None
        rid = s.request.request_id
        if rid not in self._generators:
            self._generators[rid] = torch.Generator(device=self.device).manual_seed(seed)
        return self._generators[rid]

    def execute(self, out: SchedulerOutput) -> tuple[list[ScheduledRequest], SamplerOutput]:
        """Run one step; returns the sequences that sampled and their tokens (same order)."""
        step = build_step_inputs(out.scheduled, self.block_size)
        dev = self.device
        logits = self.executor.execute(
            step.input_ids.to(dev),
            step.positions.to(dev),
            step.meta.to(dev) if dev.type != "cpu" else step.meta,
            step.logits_indices.to(dev),
        )
        if not step.sampled:
            return [], SamplerOutput([], [], [])
        rows = [
            SamplingRow(
                params=s.request.params,
                token_ids=s.request.token_ids,
                num_output_tokens=s.request.num_output_tokens,
                eos_token_ids=s.request.eos_token_ids,
                generator=self._generator(s),
            )
            for s in step.sampled
        ]
        return step.sampled, sample(logits.float(), rows)
