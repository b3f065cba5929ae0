"""The object the engine drives: one model step at a time, over one or several TP ranks.

Rank 0 lives in the caller's process. For TP > 1, `create_executor` starts one process per other
rank (or joins a `torchrun` job); each step's inputs are broadcast from rank 0, every rank runs
the forward, row-parallel outputs are all-reduced and the logits gathered on rank 0.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from inference_svc.loader.weights import LoadReport
from inference_svc.model.attention import AttentionMetadata
from inference_svc.model.config import ModelConfig
from inference_svc.model.parallel import TPGroup
from inference_svc.model.rank import RankModel, check_kv_cache_args, check_profile_args
from inference_svc.model.tp_workers import (
    ALLOCATE_KV,
    PROFILE,
    SHUTDOWN,
    join_torchrun,
    send_command,
    send_step,
    spawn,
)


class ModelExecutor(Protocol):
    config: ModelConfig
    tp_size: int

    def weight_bytes_per_rank(self) -> int: ...
    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None: ...
    def execute(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor: ...
    def profile_peak_activation_bytes(self, num_tokens: int, num_seqs: int) -> int: ...
    def shutdown(self) -> None: ...


class Executor:
    """Rank 0's executor (the only rank at TP=1)."""

    def __init__(
        self,
        rank_model: RankModel,
        tp_size: int,
        workers: list[Any],
        load_reports: list[LoadReport],
        torchrun: bool = False,
    ):
        self.config = rank_model.config
        self.tp_size = tp_size
        self.dtype = rank_model.dtype  # what the weights and KV cache hold at run time
        self.device = rank_model.device
        self.load_reports = load_reports  # one per rank, rank order
        self._rank = rank_model
        self._workers = workers
        self._torchrun = torchrun  # rank 0 of a torchrun job: the default group is ours to end
        self._closed = False
        self._broken: str | None = None

    def weight_bytes_per_rank(self) -> int:
        return self._rank.weight_bytes()

    def _check_alive(self) -> None:
        if self._closed:
            raise RuntimeError("executor is shut down")
        if self._broken is not None:
            raise RuntimeError(f"TP group stopped after a failed step: {self._broken}")
        dead = [w for w in self._workers if not w.is_alive()]
        if dead:  # a collective with a dead rank would wait out the whole timeout
            raise RuntimeError(f"a TP worker exited (code {dead[0].exitcode}); shut down")

    def _command(self, *values: int) -> None:
        self._check_alive()
        if self.tp_size > 1:
            send_command(self._rank.model.tp, self.device, *values)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        # Checked before the command goes out: the followers would fail on it too, and exit.
        check_kv_cache_args(num_blocks, block_size)
        self._command(ALLOCATE_KV, num_blocks, block_size)
        self._rank.allocate_kv_cache(num_blocks, block_size)

    def execute(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        # Checked before anything is broadcast: a step that fails on every rank would leave the
        # followers out of step with rank 0.
        self._check_alive()
        check_step(input_ids, positions, meta, logits_indices, self.config.vocab_size,
                   self._rank.kv_caches)  # fmt: skip
        if self.tp_size > 1:
            send_step(self._rank.model.tp, self.device, input_ids, positions, meta, logits_indices)
        device = self._rank.device
        with self._collective_step():
            logits = self._rank.execute(
                input_ids.to(device),
                positions.to(device),
                meta.to(device),
                logits_indices.to(device),
            )
        assert logits is not None  # rank 0 always holds the gathered logits
        return logits

    def profile_peak_activation_bytes(self, num_tokens: int, num_seqs: int) -> int:
        check_profile_args(num_tokens, num_seqs)
        self._command(PROFILE, num_tokens, num_seqs)
        with self._collective_step():
            return self._rank.profile_peak_activation_bytes(num_tokens, num_seqs)

    @contextlib.contextmanager
    def _collective_step(self) -> Iterator[None]:
        """Rank 0's share of a step. If it fails half-way the followers wait in a collective
        rank 0 will never join: stop them, and refuse further steps, rather than hang."""
        try:
            yield
        except BaseException as e:
            if self.tp_size > 1:
                self._broken = f"{type(e).__name__}: {e}"
                for w in self._workers:
                    w.kill()
            raise

    def shutdown(self) -> None:
        if self._closed:
            return
        if self.tp_size > 1:
            with contextlib.suppress(RuntimeError):
                self._command(SHUTDOWN)
        self._closed = True
        for w in self._workers:
            w.join(timeout=30)
            if w.is_alive():
                w.kill()
                w.join()
        self._rank.kv_caches = []
        if self._torchrun and dist.is_initialized():
            # The followers destroyed theirs on SHUTDOWN; rank 0's would be left dangling.
            dist.destroy_process_group()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def check_step(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    logits_indices: torch.Tensor,
    vocab_size: int,
    kv_caches: list[torch.Tensor],
) -> None:
    """Raise ValueError for a step whose tensors disagree with each other or the cache."""
    if not kv_caches:
        raise RuntimeError("allocate_kv_cache before execute")
    _, num_blocks, block_size, _, _ = kv_caches[0].shape
    t = int(input_ids.shape[0]) if input_ids.dim() == 1 else -1
    if t < 0 or positions.shape != (t,) or meta.slot_mapping.shape != (t,):
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)}, positions {tuple(positions.shape)} and "
            f"slot_mapping {tuple(meta.slot_mapping.shape)} must all be (T,)"
        )
    if meta.block_size != block_size:
        raise ValueError(f"meta.block_size {meta.block_size} != the cache's {block_size}")
    starts, lens = meta.query_start_loc_list, meta.seq_lens_list
    if len(starts) != len(lens) + 1 or starts[0] != 0 or starts[-1] != t:
        raise ValueError(f"query_start_loc must run from 0 to {t} over {len(lens)} sequences")
    width = meta.block_tables.shape[1] if meta.block_tables.dim() == 2 else -1
    if meta.block_tables.shape[0] != len(lens) or width < 0:
        raise ValueError(f"block_tables {tuple(meta.block_tables.shape)} is not (B, W)")
    for i, ctx in enumerate(lens):
        n_new = starts[i + 1] - starts[i]
        if n_new < 0 or n_new > ctx or -(-ctx // block_size) > width:
            raise ValueError(f"sequence {i}: {n_new} new tokens, context {ctx}, {width} blocks")
    if t:
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size:
            raise ValueError(f"token ids must lie in [0, {vocab_size})")
        if int(meta.slot_mapping.max()) >= num_blocks * block_size:
            raise ValueError(f"slot_mapping points past the {num_blocks * block_size} cache slots")
    if meta.block_tables.numel() and (
        int(meta.block_tables.min()) < 0 or int(meta.block_tables.max()) >= num_blocks
    ):
        raise ValueError(f"block_tables hold ids outside [0, {num_blocks})")
    if logits_indices.dim() != 1 or (
        logits_indices.numel() and (int(logits_indices.min()) < 0 or int(logits_indices.max()) >= t)
    ):
        raise ValueError(f"logits_indices must be a 1-D tensor of token indices in [0, {t})")


def _resolve(
    config: ModelConfig, dtype: torch.dtype | None, device: str
) -> tuple[torch.dtype, torch.device]:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", 0)
    return (dtype or config.dtype), dev


def create_executor(
    model_dir: Path,
    *,
    tensor_parallel_size: int = 1,
    dtype: torch.dtype | None = None,
    device: str = "cpu",
) -> Executor:
    """Load `model_dir` over `tensor_parallel_size` ranks and return rank 0's executor.

    Under `torchrun` (RANK/WORLD_SIZE set, WORLD_SIZE == TP size) every rank calls this; ranks
    other than 0 serve rank 0's steps until it shuts down, then exit the process.
    """
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    config.check_tp(tensor_parallel_size)
    tp_size = tensor_parallel_size
    dtype, dev = _resolve(config, dtype, device)
    if tp_size == 1:
        rank_model = RankModel(model_dir, config, TPGroup(), dtype, dev)
        return Executor(rank_model, 1, [], [rank_model.load_report])
    if os.environ.get("WORLD_SIZE") == str(tp_size) and "RANK" in os.environ:
        rank_model, reports = join_torchrun(model_dir, config, tp_size, dtype, dev)
        return Executor(rank_model, tp_size, [], reports, torchrun=True)
    rank_model, workers, reports = spawn(model_dir, config, tp_size, dtype, dev)
    return Executor(rank_model, tp_size, workers, reports)
