"""The Triton paged-attention kernel against the PyTorch reference.

On CPU it runs under Triton's interpreter (tests/kernels/conftest.py sets TRITON_INTERPRET=1), so
default cases stay small; the `slow` sweep is larger and the `gpu` test runs the compiled kernel.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import kernels.paged_attention as triton_attn
from inference_svc.model.attention import AttentionMetadata
from kernels.paged_attention_ref import paged_attention as reference
from kernels.paged_attention_ref import write_kv

if not triton_attn.INTERPRETED and not torch.cuda.is_available():
    # triton.language decorates its own helpers when triton is first imported, so nothing short
    # of a fresh process can switch to the interpreter now.
    raise RuntimeError(
        "triton was imported before tests/kernels/conftest.py set TRITON_INTERPRET=1 and there is "
        "no CUDA device: import kernels.paged_attention only on the CUDA path, or set "
        "TRITON_INTERPRET=1 in the environment"
    )
DEVICE = "cpu" if triton_attn.INTERPRETED else "cuda"
# Absolute = relative tolerance per dtype. One bf16 ulp at |x| in [2, 4) is 2**-6: kernel and
# reference may round either way.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}

# (context length, new tokens): a fresh prefill, a chunk after a cached prefix, decodes,
# lengths that do not divide the block size.
MIXED = [(7, 7), (13, 5), (21, 1), (1, 1), (40, 3)]


def make_case(
    seqs: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    device: str = DEVICE,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """q (T, H, D), a cache holding every context on shuffled blocks, and the step's metadata.

    The cache starts as noise, so a kernel that reads a wrong block or a slot past the context
    length gets a different answer from the reference.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(seqs), max(blocks_per_seq, default=1), dtype=torch.int64)
    slots: list[torch.Tensor] = []
    for i, ((ctx, n_new), nb) in enumerate(zip(seqs, blocks_per_seq, strict=True)):
        ids = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int64)
        tables[i, :nb] = ids
        pos = torch.arange(ctx)
        slot = ids[pos // block_size] * block_size + pos % block_size
        kv = torch.randn(2, ctx, kv_heads, head_dim, generator=g)
        write_kv(kv_cache, kv[0], kv[1], slot)
        slots.append(slot[ctx - n_new :])
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    qsl[1:] = torch.tensor([n for _, n in seqs], dtype=torch.int64).cumsum(0)
    meta = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int64),
        block_tables=tables,
        slot_mapping=torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64),
        block_size=block_size,
    )
    q = torch.randn(int(qsl[-1]), heads, head_dim, generator=g)
    return q.to(device, dtype), kv_cache.to(device, dtype), meta.to(device)


def check_against_reference(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, splits: int | None = None
) -> None:
    scale = q.shape[-1] ** -0.5
    out = triton_attn.paged_attention(q, kv_cache, meta, scale, num_kv_splits=splits)
    expected = reference(q, kv_cache, meta, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    tol = TOLERANCE[q.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "dtype"),
    [
        (4, 4, 16, 4, torch.float32),
        (4, 2, 32, 16, torch.float32),
        (8, 2, 64, 4, torch.float32),
        (4, 4, 32, 16, torch.bfloat16),
        (4, 2, 16, 4, torch.bfloat16),
        (8, 2, 64, 16, torch.bfloat16),
    ],
)
def test_mixed_batch_matches_reference(
    heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    seed = heads * 1000 + kv_heads * 100 + head_dim + block_size
    check_against_reference(*make_case(MIXED, heads, kv_heads, head_dim, block_size, dtype, seed))


@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (8, 2), (6, 2)])
def test_decode_batch_matches_reference(heads: int, kv_heads: int) -> None:
    # One token per sequence; 6/2 is a group of 3, padded to 4 rows inside the kernel.
    seqs = [(1, 1), (5, 1), (16, 1), (33, 1)]
    check_against_reference(*make_case(seqs, heads, kv_heads, 16, 4, torch.float32, heads))


@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (4, 1)])
def test_empty_prefix_prefill_over_several_query_tiles(heads: int, kv_heads: int) -> None:
    # 70 new tokens span two or more query tiles, each tile seeing a different key range.
    seqs = [(3, 3), (70, 70), (17, 17)]
    check_against_reference(*make_case(seqs, heads, kv_heads, 16, 16, torch.float32, 7))


def test_long_prefix_with_a_chunk_crossing_tiles() -> None:
    check_against_reference(*make_case([(150, 40), (9, 2)], 4, 2, 32, 16, torch.float32, 11))


@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_split_across_programs_match_reference(splits: int, dtype: torch.dtype) -> None:
    # With contexts of 1..40 keys, many (sequence, split) pairs are empty and must weigh nothing.
    check_against_reference(*make_case(MIXED, 8, 2, 32, 4, dtype, splits), splits=splits)


def test_split_keys_in_a_prefill_over_several_tiles() -> None:
    # Early query tiles see none of the later splits' keys.
    case = make_case([(70, 70), (150, 40), (5, 1)], 4, 1, 16, 16, torch.float32, 13)
    check_against_reference(*case, splits=4)


def test_sequences_without_new_tokens_and_unowned_rows() -> None:
    q, kv_cache, meta = make_case([(9, 0), (6, 2), (4, 0)], 2, 1, 16, 4, torch.float32, 3)
    # Two trailing rows of q belong to no sequence: computed rows must still match.
    q = torch.cat([q, torch.randn(2, *q.shape[1:], device=q.device)])
    out = triton_attn.paged_attention(q, kv_cache, meta, 0.25)
    expected = reference(q, kv_cache, meta, 0.25)
    torch.testing.assert_close(out[:2], expected[:2], atol=1e-4, rtol=1e-4)


def test_empty_step_returns_empty() -> None:
    q, kv_cache, meta = make_case([(5, 0)], 2, 2, 16, 4, torch.float32, 1)
    assert q.shape == (0, 2, 16)
    assert triton_attn.paged_attention(q, kv_cache, meta, 1.0).shape == (0, 2, 16)


def test_strided_q_view_and_odd_head_dim() -> None:
    # q as a slice of a fused qkv projection: rows are strided, heads contiguous.
    q, kv_cache, meta = make_case(MIXED, 4, 2, 24, 4, torch.float32, 5)
    fused = torch.randn(q.shape[0], 8, 24, device=q.device)
    fused[:, 2:6] = q
    check_against_reference(fused[:, 2:6], kv_cache, meta)


def test_int32_metadata_and_padded_block_tables() -> None:
    q, kv_cache, meta = make_case(MIXED, 4, 2, 16, 4, torch.float32, 9)
    wide = torch.zeros(meta.num_seqs, meta.block_tables.shape[1] + 5, dtype=torch.int32)
    wide[:, : meta.block_tables.shape[1]] = meta.block_tables
    meta32 = replace(
        meta,
        query_start_loc=meta.query_start_loc.int(),
        seq_lens=meta.seq_lens.int(),
        block_tables=wide.to(meta.block_tables.device),
    )
    check_against_reference(q, kv_cache, meta32)


def _bad(case: str) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, str]:
    q, kv, meta = make_case([(6, 2), (3, 3)], 4, 2, 16, 4, torch.float32, 2)
    if case == "q_rank":
        return q[0], kv, meta, r"q must be \(T, H, D\)"
    if case == "cache_rank":
        return q, kv[0], meta, "kv_cache must be"
    if case == "head_dim":
        return q[..., :8], kv, meta, "head_dim 8 != kv_cache head_dim 16"
    if case == "gqa":
        return q[:, :3], kv, meta, "3 query heads are not a multiple of 2"
    if case == "block_size":
        return q, kv, replace(meta, block_size=8), "block_size 4 != meta.block_size 8"
    if case == "dtype":
        return q.half(), kv, meta, "dtype torch.float32 != q dtype torch.float16"
    if case == "int_q":
        return q.long(), kv.long(), meta, "not supported"
    if case == "last_dim":
        return q.transpose(1, 2).contiguous().transpose(1, 2), kv, meta, "contiguous last"
    if case == "qsl_shape":
        return q, kv, replace(meta, query_start_loc=meta.query_start_loc[:-1]), "query_start_loc"
    if case == "float_lens":
        return q, kv, replace(meta, seq_lens=meta.seq_lens.float()), "int32 or int64"
    if case == "too_many_new":
        lens = torch.tensor([1, 3], device=meta.seq_lens.device)
        return q, kv, replace(meta, seq_lens=lens), "2 new tokens with context length 1"
    if case == "narrow_table":
        return q, kv, replace(meta, block_tables=meta.block_tables[:, :1]), "needs 2 blocks"
    if case == "qsl_past_q":
        return q[:3], kv, meta, "query_start_loc must run from 0 to at most 3"
    if case == "splits":
        return q, kv, meta, "num_kv_splits must be at least 1, got 0"
    raise AssertionError(case)


def _call(q: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata, case: str) -> torch.Tensor:
    return triton_attn.paged_attention(
        q, kv, meta, 1.0, num_kv_splits=0 if case == "splits" else None
    )


@pytest.mark.parametrize(
    "case",
    [
        "q_rank",
        "cache_rank",
        "head_dim",
        "gqa",
        "block_size",
        "dtype",
        "int_q",
        "last_dim",
        "qsl_shape",
        "float_lens",
        "too_many_new",
        "narrow_table",
        "qsl_past_q",
        "splits",
    ],
)
def test_bad_inputs_raise_value_error(case: str) -> None:
    q, kv_cache, meta, message = _bad(case)
    with pytest.raises(ValueError, match=message):
        _call(q, kv_cache, meta, case)


def test_kernel_compiles_for_hopper_without_a_device() -> None:
    # The interpreter accepts code the compiler rejects (dot shapes, constexpr misuse), so compile
    # what the wrapper would launch on an H100/H200 down to a cubin. A fresh process: the
    # interpreter patches triton.language in this one.
    script = (
        "import torch\n"
        "from kernels.paged_attention import compile_for_target\n"
        "assert compile_for_target(torch.bfloat16, 32, 8, 128, 16, 1)\n"  # GQA decode
        "assert compile_for_target(torch.float32, 6, 2, 80, 4, 100)\n"  # odd group and head_dim
        "assert compile_for_target(torch.float16, 8, 8, 64, 16, 1, num_splits=4)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]


def _random_seqs(rng: random.Random, max_ctx: int) -> list[tuple[int, int]]:
    seqs = []
    for _ in range(rng.randint(1, 5)):
        ctx = rng.randint(1, max_ctx)
        n_new = rng.choice([1, ctx, rng.randint(1, ctx)])
        seqs.append((ctx, n_new))
    return seqs


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("head_dim", [16, 32, 64])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_random_batches_sweep(
    group: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    rng = random.Random(group * 10_000 + head_dim * 100 + block_size)
    for trial in range(3):
        seqs = _random_seqs(rng, 100)
        kv_heads = rng.choice([1, 2])
        case = make_case(seqs, kv_heads * group, kv_heads, head_dim, block_size, dtype, trial)
        check_against_reference(*case, splits=rng.choice([1, 2, 5]))


@pytest.mark.gpu
@pytest.mark.skipif(
    triton_attn.INTERPRETED or not torch.cuda.is_available(),
    reason="needs a CUDA device and the compiled (not interpreted) kernel",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_compiled_kernel_on_cuda(dtype: torch.dtype) -> None:
    rng = random.Random(str(dtype))
    for group, head_dim, block_size in [(1, 64, 16), (4, 128, 16), (8, 128, 32), (2, 80, 8)]:
        seqs = [(1, 1), (700, 1), (513, 513), (1000, 37), *_random_seqs(rng, 2000)]
        case = make_case(seqs, 4 * group, 4, head_dim, block_size, dtype, group, device="cuda")
        for splits in (None, 1, 4):  # None: the GPU-size heuristic
            check_against_reference(*case, splits=splits)
    # A small decode batch over long contexts, where the heuristic splits the keys.
    case = make_case([(9000, 1), (3000, 1)], 32, 8, 128, 16, dtype, 0, device="cuda")
    check_against_reference(*case)
