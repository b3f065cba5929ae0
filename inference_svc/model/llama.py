"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3), tensor-parallel, paged KV.

Parameter names follow the checkpoint (`model.layers.N.self_attn...`) except for the merged
projections: q/k/v live in `qkv_proj.weight.{q,k,v}` and gate/up in `gate_up_proj.weight.{gate,up}`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_svc.model.attention import AttentionMetadata, attend
from inference_svc.model.config import ModelConfig
from inference_svc.model.layers import RMSNorm, RotaryEmbedding
from inference_svc.model.parallel import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias, tp, dtype
        )
        self.num_heads = self.qkv_proj.heads_per_rank
        self.num_kv_heads = self.qkv_proj.kv_heads_per_rank
        self.o_proj = RowParallelLinear(
            self.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, tp, dtype
        )
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim)
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x)
        q = q.view(t, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(t, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = attend(q, k, v, kv_cache, meta, self.scale)  # (T, H, D)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        inter = cfg.intermediate_size // tp.size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, {"gate": inter, "up": inter}, False, dtype
        )
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, False, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.self_attn = Attention(cfg, tp, dtype)
        self.mlp = MLP(cfg, tp, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.layers = nn.ModuleList([DecoderLayer(cfg, tp, dtype) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class CausalLM(nn.Module):
    """Weights start on the meta device; `inference_svc.loader.weights` installs them."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        cfg.check_tp(tp.size)
        self.config = cfg
        self.tp = tp
        self.dtype = dtype
        self.model = DecoderModel(cfg, tp, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype)

    def tie_weights(self) -> None:
        """Share the embedding's rows with the output projection (after loading)."""
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions (T,) -> final hidden states (T, hidden)."""
        x = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(positions, x, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(N, hidden) -> float32 (N, vocab) on rank 0 (None on other ranks)."""
        return self.lm_head.logits(hidden)
