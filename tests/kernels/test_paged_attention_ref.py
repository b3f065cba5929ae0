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


def _scattered_case(
    seqs: list[tuple[int, int]], heads: int, kv_heads: int, block_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """q, a cache with each context on shuffled blocks, the step's metadata and the expected out.

    Every slot no context owns holds NaN: a reader that lets padding into the softmax or the
    weighted sum of V returns NaN. Expected: each sequence on its own, dense, in float64.
    """
    g = torch.Generator().manual_seed(seed)
    d = 8
    blocks_per_seq = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 2
    kv_cache = torch.full((2, num_blocks, block_size, kv_heads, d), float("nan"))
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(seqs), max(blocks_per_seq), dtype=torch.int64)
    qs, slots, expected = [], [], []
    for i, ((ctx, n_new), nb) in enumerate(zip(seqs, blocks_per_seq, strict=True)):
        ids = torch.tensor([perm.pop() for _ in range(nb)])
        tables[i, :nb] = ids
        pos = torch.arange(ctx)
        slot = ids[pos // block_size] * block_size + pos % block_size
        k, v = torch.randn(2, ctx, kv_heads, d, generator=g)
        write_kv(kv_cache, k, v, slot)
        q = torch.randn(n_new, heads, d, generator=g)
        qs.append(q)
        slots.append(slot[ctx - n_new :])
        expected.append(dense_attention(q, k, v, d**-0.5))
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    qsl[1:] = torch.tensor([n for _, n in seqs]).cumsum(0)
    meta = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=torch.tensor([ctx for ctx, _ in seqs]),
        block_tables=tables,
        slot_mapping=torch.cat(slots),
        block_size=block_size,
    )
    return torch.cat(qs), kv_cache, meta, torch.cat(expected)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_batched_decodes_match_each_sequence_alone(block_size: int, group: int) -> None:
    # Lengths on both sides of block boundaries, so the padded tables differ in width.
    lens = [1, 3, 16, 17, 33, 5, 40]
    q, cache, meta, expected = _scattered_case(
        [(n, 1) for n in lens], heads=2 * group, kv_heads=2, block_size=block_size, seed=group
    )
    out = paged_attention(q, cache, meta, 8**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_mixed_decodes_and_prefill_chunks(group: int) -> None:
    # Decodes between prefills (fresh, after a cached prefix) and a sequence with no new token.
    seqs = [(9, 1), (12, 12), (5, 1), (20, 3), (6, 0), (1, 1), (30, 7), (23, 1)]
    q, cache, meta, expected = _scattered_case(
        seqs, heads=3 * group, kv_heads=3, block_size=4, seed=10 + group
    )
    out = paged_attention(q, cache, meta, 8**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_batched_decodes_in_bf16_match_fp32_closely() -> None:
    q, cache, meta, expected = _scattered_case(
        [(n, 1) for n in (7, 18, 2, 9)], heads=4, kv_heads=2, block_size=4, seed=3
    )
    out = paged_attention(q.bfloat16(), cache.bfloat16(), meta, 8**-0.5)
    assert out.dtype is torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=0.05, atol=0.05)
