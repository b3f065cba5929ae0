"""Replicated building blocks of the decoder: RMSNorm and rotary position embedding."""

from __future__ import annotations

import math

import torch

from inference_svc.model.config import RopeConfig
from inference_svc.model.parallel import Loadable, _meta_param


class RMSNorm(Loadable):
    """x / rms(x) * weight, computed in float32 like transformers, returned in x's dtype."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = _meta_param(dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """(head_dim/2,) float32 inverse frequencies, with linear or Llama 3 scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(torch.nn.Module):
    """Rotate-half RoPE; cos/sin computed per step from the positions (no max-length table)."""

    def __init__(self, rope: RopeConfig, head_dim: int):
        super().__init__()
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", rope_inv_freq(rope, head_dim), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,), q (T, H, D), k (T, KVH, D) -> rotated q, k."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]  # (T, 1, D)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)
