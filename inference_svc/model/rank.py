"""One TP rank's model: build on meta, load this rank's weights, own the KV cache, run a step."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from inference_svc.loader.checkpoint import Checkpoint
from inference_svc.loader.preshard import is_presharded, open_presharded
from inference_svc.loader.weights import LoadReport, load_weights
from inference_svc.model.attention import AttentionMetadata
from inference_svc.model.config import ModelConfig
from inference_svc.model.llama import CausalLM
from inference_svc.model.parallel import TPGroup
from inference_svc.model.profile import StoragePeakTracker

log = logging.getLogger(__name__)


def check_kv_cache_args(num_blocks: int, block_size: int) -> None:
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")


def check_profile_args(num_tokens: int, num_seqs: int) -> None:
    if num_seqs < 1 or num_tokens < num_seqs:
        raise ValueError(f"need num_tokens >= num_seqs >= 1, got {num_tokens}, {num_seqs}")


class RankModel:
    """The model, its weights and its KV cache on this rank."""

    def __init__(
        self,
        model_dir: Path,
        config: ModelConfig,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.config = config
        self.device = device
        self.dtype = dtype
        self.model = CausalLM(config, tp, dtype)
        if is_presharded(model_dir):
            ckpt, plans = open_presharded(model_dir, self.model)
            self.load_report: LoadReport = load_weights(self.model, ckpt, device, plans=plans)
        else:
            self.load_report = load_weights(self.model, Checkpoint(model_dir), device)
        log.info("loaded weights: %s", self.load_report.summary())
        self.kv_caches: list[torch.Tensor] = []
        self.store: object | None = None  # a spawned group's rendezvous store, kept alive

    def weight_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for p in self.model.parameters():
            if p.data_ptr() not in seen:  # tied weights once
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
        return total

    def kv_heads(self) -> int:
        """KV heads this rank holds (split, or one replicated head when TP exceeds them)."""
        return max(1, self.config.num_kv_heads // self.model.tp.size)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        check_kv_cache_args(num_blocks, block_size)
        self.kv_caches = []  # free the old pool before allocating the new one
        shape = (2, num_blocks, block_size, self.kv_heads(), self.config.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device)
            for _ in range(self.config.num_layers)
        ]

    @torch.inference_mode()
    def execute(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        kv_caches: list[torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """One step; float32 logits (len(logits_indices), vocab) on rank 0, None elsewhere."""
        caches = self.kv_caches if kv_caches is None else kv_caches
        if not caches:
            raise RuntimeError("allocate_kv_cache before execute")
        hidden = self.model(input_ids, positions, caches, meta)  # (T, hidden)
        return self.model.compute_logits(hidden[logits_indices])

    def profile_peak_activation_bytes(self, num_tokens: int, num_seqs: int) -> int:
        """Run a dummy prefill of `num_tokens` over `num_seqs` sequences; measured peak bytes."""
        check_profile_args(num_tokens, num_seqs)
        base, extra = divmod(num_tokens, num_seqs)
        lens = [base + (1 if i < extra else 0) for i in range(num_seqs)]
        block_size = 16
        meta = AttentionMetadata.for_prefill(lens, block_size).to(self.device)
        num_blocks = sum(-(-n // block_size) for n in lens)
        shape = (2, num_blocks, block_size, self.kv_heads(), self.config.head_dim)
        caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)] * self.config.num_layers
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        last = (meta.query_start_loc[1:] - 1).to(self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            self.execute(ids, positions, meta, last, caches)
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device) - before)
        with StoragePeakTracker() as tracker:
            self.execute(ids, positions, meta, last, caches)
        return tracker.peak
