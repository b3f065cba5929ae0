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
    tokens must already be in the cache (write_kv first). Math in float32. Sequences with one new
    token (decodes) are attended together in one batched pass; prefill chunks one at a time.
    """
    _, h, _ = q.shape
    kvh = kv_cache.shape[3]
    if h % kvh != 0:
        raise ValueError(f"{h} query heads are not a multiple of {kvh} kv heads")
    out = torch.empty_like(q)
    starts = meta.query_start_loc_list
    decodes: list[int] = []
    for i, ctx_len in enumerate(meta.seq_lens_list):
        q_lo, q_hi = starts[i], starts[i + 1]
        if q_hi - q_lo == 1:
            decodes.append(i)
        elif q_hi > q_lo:
            out[q_lo:q_hi] = _sequence_attention(
                q[q_lo:q_hi], kv_cache, meta.block_tables[i], ctx_len, scale
            )
    if decodes:
        rows = torch.tensor(decodes, device=q.device)
        tokens = meta.query_start_loc[rows]  # a decode's one token sits at its sequence's start
        out[tokens] = _decode_attention(
            q[tokens], kv_cache, meta.block_tables[rows], meta.seq_lens[rows], scale
        )
    return out


def _sequence_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, ctx_len: int, scale: float
) -> torch.Tensor:
    """One sequence's n new tokens q (n, H, D), the last n of its ctx_len positions."""
    n_new, h, d = q.shape
    _, _, block_size, kvh, _ = kv_cache.shape
    group = h // kvh
    n_blocks = -(-ctx_len // block_size)
    blocks = block_table[:n_blocks]
    k = kv_cache[0, blocks].reshape(-1, kvh, d)[:ctx_len].float()  # (L, KVH, D)
    v = kv_cache[1, blocks].reshape(-1, kvh, d)[:ctx_len].float()
    k = k.repeat_interleave(group, dim=1)  # (L, H, D)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale  # (H, n, L)
    # New token j sits at position ctx_len - n_new + j and sees keys 0..that position.
    q_pos = torch.arange(ctx_len - n_new, ctx_len, device=q.device)
    k_pos = torch.arange(ctx_len, device=q.device)
    mask = k_pos[None, :] > q_pos[:, None]  # (n, L)
    scores.masked_fill_(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hnl,lhd->nhd", probs, v).to(q.dtype)


def _decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """B decodes at once: q (B, H, D) is each sequence's last position, which sees all of it.

    Contexts are padded to the longest (Lmax) and the padding masked out of the softmax.
    """
    b, h, d = q.shape
    _, num_blocks, block_size, kvh, _ = kv_cache.shape
    n_blocks = -(-int(seq_lens.max()) // block_size)
    pos = torch.arange(n_blocks * block_size, device=q.device)  # (Lmax,)
    pad = pos[None, :] >= seq_lens[:, None]  # (B, Lmax)
    # Padding reads position 0 again, which is always written: an unwritten slot may hold
    # anything, NaN included, and a zero softmax weight times NaN is still NaN.
    pos = pos.expand(b, -1).masked_fill(pad, 0)
    slots = block_tables.gather(1, pos // block_size) * block_size + pos % block_size  # (B, Lmax)
    flat = kv_cache.view(2, num_blocks * block_size, kvh, d)
    kv = flat.index_select(1, slots.flatten()).view(2, b, -1, kvh, d)
    # (2, B, KVH, Lmax, D) in float32, laid out so each (sequence, kv head) is one matrix.
    k, v = kv.transpose(2, 3).to(torch.float32, memory_format=torch.contiguous_format)
    # GQA: query head j reads kv head j // group, the order repeat_interleave gives.
    qg = q.float().view(b, kvh, h // kvh, d)  # (B, KVH, G, D)
    scores = torch.einsum("bkgd,bkld->bkgl", qg, k) * scale  # (B, KVH, G, Lmax)
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bkgl,bkld->bkgd", probs, v).reshape(b, h, d).to(q.dtype)
