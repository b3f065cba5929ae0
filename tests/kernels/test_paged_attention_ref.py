"""The paged-attention reference against dense causal attention on contiguous K/V."""

from __future__ import annotations

import pytest
import torch

from inference_svc.model.attention import AttentionMetadata
from kernels.paged_attention_ref import paged_attention, write_kv


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q (n, H, D) are the last n of L positions; k, v (L, KVH, D). Causal, GQA by repetition."""
    n, h, _ = q.shape
    length, kvh, _ = k.shape
    k = k.repeat_interleave(h // kvh, dim=1)
    v = v.repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k.double()) * scale
    q_pos = torch.arange(length - n, length)[:, None]
    scores = scores.masked_fill(torch.arange(length)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v.double()).float()


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 1)])
def test_matches_dense_attention_with_scattered_blocks(
    block_size: int, heads: int, kv_heads: int
) -> None:
    g = torch.Generator().manual_seed(block_size * 100 + heads * 10 + kv_heads)
    d = 8
    # (context length, new tokens): a fresh prefill, a chunk after a cached prefix, a decode,
    # lengths that do not divide the block size.
    seqs = [(7, 7), (13, 5), (21, 1), (1, 1)]
    total_blocks = sum(-(-ctx // block_size) for ctx, _ in seqs) + 3
    kv_cache = torch.zeros(2, total_blocks, block_size, kv_heads, d)
    perm = torch.randperm(total_blocks, generator=g).tolist()  # blocks anywhere in the pool
    width = max(-(-ctx // block_size) for ctx, _ in seqs)
    tables = torch.zeros(len(seqs), width, dtype=torch.int64)
    full_k, full_v, qs, slots, expected = [], [], [], [], []
    for i, (ctx, n_new) in enumerate(seqs):
        nb = -(-ctx // block_size)
        ids = [perm.pop() for _ in range(nb)]
        tables[i, :nb] = torch.tensor(ids)
        k = torch.randn(ctx, kv_heads, d, generator=g)
        v = torch.randn(ctx, kv_heads, d, generator=g)
        slot = torch.tensor(
            [ids[p // block_size] * block_size + p % block_size for p in range(ctx)]
        )
        write_kv(kv_cache, k[: ctx - n_new], v[: ctx - n_new], slot[: ctx - n_new])  # the prefix
        q = torch.randn(n_new, heads, d, generator=g)
        qs.append(q)
        full_k.append(k[ctx - n_new :])
        full_v.append(v[ctx - n_new :])
        slots.append(slot[ctx - n_new :])
        expected.append(dense_attention(q, k, v, d**-0.5))
    lens = [n for _, n in seqs]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    meta = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=torch.tensor([ctx for ctx, _ in seqs]),
        block_tables=tables,
        slot_mapping=torch.cat(slots),
        block_size=block_size,
    )
    write_kv(kv_cache, torch.cat(full_k), torch.cat(full_v), meta.slot_mapping)
    out = paged_attention(torch.cat(qs), kv_cache, meta, d**-0.5)
    torch.testing.assert_close(out, torch.cat(expected), rtol=1e-5, atol=1e-5)


def test_write_kv_skips_padding_slots_and_checks_shapes() -> None:
    kv_cache = torch.zeros(2, 2, 4, 1, 2)
    k = torch.ones(3, 1, 2)
    write_kv(kv_cache, k, 2 * k, torch.tensor([5, -1, 0]))
    flat = kv_cache.view(2, 8, 1, 2)
    assert flat[0, :, 0, 0].tolist() == [1, 0, 0, 0, 0, 1, 0, 0]
    assert flat[1, :, 0, 0].tolist() == [2, 0, 0, 0, 0, 2, 0, 0]
    with pytest.raises(ValueError, match="do not match"):
        write_kv(kv_cache, torch.ones(3, 2, 2), torch.ones(3, 2, 2), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(kv_cache, k, k, torch.tensor([0, 1]))


def test_bf16_cache_matches_fp32_closely() -> None:
    g = torch.Generator().manual_seed(0)
    meta = AttentionMetadata.for_prefill([9, 4], block_size=4)
    q, k, v = (torch.randn(13, h, 16, generator=g) for h in (4, 2, 2))
    outs = []
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.zeros(2, 6, 4, 2, 16, dtype=dtype)
        write_kv(cache, k, v, meta.slot_mapping)
        outs.append(paged_attention(q.to(dtype), cache, meta, 0.25).float())
    torch.testing.assert_close(outs[1], outs[0], rtol=0.05, atol=0.05)
