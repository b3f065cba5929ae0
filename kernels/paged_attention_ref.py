"""PyTorch reference for paged attention: the CPU path and the oracle for the Triton kernels.

KV cache per layer: (2, num_blocks, block_size, num_kv_heads, head_dim), [0] = K, [1] = V.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from inference_svc.model.attention import AttentionMetadata


def write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store this step's K/V (T, KVH, D) at their cache slots; a negative slot means padding."""
    _, num_blocks, block_size, kvh, d = kv_cache.shape
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != (kvh, d):
        raise ValueError(f"k/v {tuple(k.shape)} do not match the cache's (T, {kvh}, {d})")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} != ({k.shape[0]},)")
    flat = kv_cache.view(2, num_blocks * block_size, kvh, d)
    slots = slot_mapping
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    flat[0].index_copy_(0, slots, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, v.to(kv_cache.dtype))


def paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached context.

    q: (T, H, D) for the flattened new tokens; returns (T, H, D) in q's dtype. The K/V of the new
    tokens must already be in the cache (write_kv first). Math in float32.
    """
    _, h, d = q.shape
    _, _, block_size, kvh, _ = kv_cache.shape
    if h % kvh != 0:
        raise ValueError(f"{h} query heads are not a multiple of {kvh} kv heads")
    group = h // kvh
    out = torch.empty_like(q)
    starts = meta.query_start_loc_list
    for i, ctx_len in enumerate(meta.seq_lens_list):
        q_lo, q_hi = starts[i], starts[i + 1]
        n_new = q_hi - q_lo
        if n_new == 0:
            continue
        n_blocks = -(-ctx_len // block_size)
        blocks = meta.block_tables[i, :n_blocks]
        k = kv_cache[0, blocks].reshape(-1, kvh, d)[:ctx_len].float()  # (L, KVH, D)
        v = kv_cache[1, blocks].reshape(-1, kvh, d)[:ctx_len].float()
        k = k.repeat_interleave(group, dim=1)  # (L, H, D)
        v = v.repeat_interleave(group, dim=1)
        qi = q[q_lo:q_hi].float()  # (n, H, D)
        scores = torch.einsum("nhd,lhd->hnl", qi, k) * scale  # (H, n, L)
        # New token j sits at position ctx_len - n_new + j and sees keys 0..that position.
        q_pos = torch.arange(ctx_len - n_new, ctx_len, device=q.device)
        k_pos = torch.arange(ctx_len, device=q.device)
        mask = k_pos[None, :] > q_pos[:, None]  # (n, L)
        scores.masked_fill_(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_lo:q_hi] = torch.einsum("hnl,lhd->nhd", probs, v).to(q.dtype)
    return out
