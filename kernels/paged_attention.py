"""Triton paged attention: one kernel for prefill-with-prefix and decode (a query of length 1).

Few programs over long contexts (small decode batches) split the keys across programs and merge
the partial softmaxes afterwards (flash-decoding).

Oracle: `kernels.paged_attention_ref.paged_attention`. On CPU this runs only under Triton's
interpreter, which `TRITON_INTERPRET=1` selects when set before this module is imported.
"""

from __future__ import annotations

import functools
import itertools
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from inference_svc.model.attention import AttentionMetadata

# Decided when the kernel below is decorated: the interpreter runs on CPU tensors, compiled on CUDA.
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    kv_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    lse_ptr,  # SPLIT only: (splits, T, H) float32 log2-sum-exp of each partial result
    scale_log2,  # softmax scale * log2(e): the kernel works in base 2
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_os,  # SPLIT only: out is the (splits, T, H, D) float32 partial results
    stride_ls,
    stride_lt,
    num_splits,
    split_len,  # keys per split, a multiple of BLOCK_N
    stride_kv,  # cache strides: K/V plane, block, slot within the block, kv head
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,  # block table strides: sequence, column
    stride_btc,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two (>= 16 for tl.dot)
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # new tokens per program; rows = BLOCK_Q * GROUP_PAD
    BLOCK_N: tl.constexpr,  # keys per inner step (independent of BLOCK_SIZE)
    FP32_DOT: tl.constexpr,  # dots in float32 with IEEE precision (fp32 inputs, interpreter)
    SPLIT: tl.constexpr,
):
    # One program: one sequence, BLOCK_Q of its new tokens, all query heads of one kv head,
    # one split of the keys.
    seq = tl.program_id(0)
    q_tile = tl.program_id(1) // num_splits
    split = tl.program_id(1) % num_splits
    kvh = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    n_new = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= n_new:
        return
    ctx_len = tl.load(seq_lens_ptr + seq)

    # Rows pack (token, head in group) so GQA heads share each K/V load.
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = q_tile * BLOCK_Q + rows // GROUP_PAD  # index among this sequence's new tokens
    head = kvh * GROUP + rows % GROUP_PAD
    row_ok = (tok < n_new) & (rows % GROUP_PAD < GROUP)
    q_pos = ctx_len - n_new + tok  # absolute position: the last key this row may see
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    tok64 = (q_start + tok).to(tl.int64)
    q_offs = tok64[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    io_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + q_offs, mask=io_mask, other=0.0)  # (M, D_PAD)
    if FP32_DOT:
        q = q.to(tl.float32)

    # Keys past the tile's last token are masked for every row, so stop there. A split with no
    # keys still runs: it must record an empty (zero-weight) partial result.
    kv_lo = split * split_len
    kv_end = tl.minimum(
        ctx_len - n_new + tl.minimum(n_new, (q_tile + 1) * BLOCK_Q), kv_lo + split_len
    )
    # A finite floor keeps fully masked rows (padding) free of inf - inf = nan.
    m_i = tl.full([BLOCK_Q * GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, D_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_end, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_ok = kpos < kv_end
        block = tl.load(bt_row + (kpos // BLOCK_SIZE) * stride_btc, mask=k_ok, other=0).to(tl.int64)
        kv_offs = block * stride_kb + (kpos % BLOCK_SIZE) * stride_ks + kvh * stride_kh
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(kv_ptr + kv_offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(kv_ptr + stride_kv + kv_offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if FP32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # (M, BLOCK_N)
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2
        visible = k_ok[None, :] & (kpos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP32_DOT:  # noqa: SIM108 (a constexpr branch reads plainer than a ternary here)
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_offs = split * stride_os + tok64[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    if SPLIT:
        # log2 of a guarded l: empty rows would warn (interpreter) before the where drops them.
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + split * stride_ls + tok64 * stride_lt + head, lse, mask=row_ok)
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _check_inputs(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """Raise ValueError for anything the kernel would read out of bounds or misinterpret."""
    if q.dim() != 3:
        raise ValueError(f"q must be (T, H, D), got shape {tuple(q.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            "kv_cache must be (2, num_blocks, block_size, num_kv_heads, head_dim), "
            f"got shape {tuple(kv_cache.shape)}"
        )
    _, h, d = q.shape
    _, _, block_size, kvh, kd = kv_cache.shape
    if kd != d:
        raise ValueError(f"q head_dim {d} != kv_cache head_dim {kd}")
    if kvh == 0 or h % kvh != 0:
        raise ValueError(f"{h} query heads are not a multiple of {kvh} kv heads")
    if block_size != meta.block_size:
        raise ValueError(f"kv_cache block_size {block_size} != meta.block_size {meta.block_size}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q dtype {q.dtype} not supported; use one of {_DTYPES}")
    if kv_cache.dtype != q.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} != q dtype {q.dtype}")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("q and kv_cache need a contiguous last (head_dim) dimension")
    b = meta.seq_lens.shape[0]
    shapes = {
        "query_start_loc": (meta.query_start_loc, (b + 1,)),
        "seq_lens": (meta.seq_lens, (b,)),
    }
    for name, (t, shape) in shapes.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"meta.{name} has shape {tuple(t.shape)}, expected {shape}")
    if meta.block_tables.dim() != 2 or meta.block_tables.shape[0] != b:
        raise ValueError(
            f"meta.block_tables has shape {tuple(meta.block_tables.shape)}, expected ({b}, W)"
        )
    for name, t in (
        ("query_start_loc", meta.query_start_loc),
        ("seq_lens", meta.seq_lens),
        ("block_tables", meta.block_tables),
    ):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"meta.{name} must be int32 or int64, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"meta.{name} is on {t.device}, q on {q.device}")
    if kv_cache.device != q.device:
        raise ValueError(f"kv_cache is on {kv_cache.device}, q on {q.device}")
    if (q.device.type == "cpu") != INTERPRETED:
        raise ValueError(
            f"tensors on {q.device.type} but the kernel was built "
            f"{'for the interpreter' if INTERPRETED else 'compiled'}: CUDA tensors need the "
            "compiled kernel, CPU tensors need TRITON_INTERPRET=1 set before import "
            "(or use kernels.paged_attention_ref)"
        )
    # The python copies are cached on meta (one host sync per step, shared by all layers).
    starts, lens = meta.query_start_loc_list, meta.seq_lens_list
    width = meta.block_tables.shape[1]
    if starts[0] != 0 or starts[-1] > q.shape[0]:
        raise ValueError(f"meta.query_start_loc must run from 0 to at most {q.shape[0]}: {starts}")
    for i, ctx in enumerate(lens):
        n_new = starts[i + 1] - starts[i]
        if n_new < 0 or n_new > ctx:
            raise ValueError(f"sequence {i}: {n_new} new tokens with context length {ctx}")
        if -(-ctx // block_size) > width:
            raise ValueError(
                f"sequence {i}: context {ctx} needs {-(-ctx // block_size)} blocks, "
                f"block_tables has {width}"
            )


def kernel_constexprs(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_query_len: int,
    dtype: torch.dtype,
    num_splits: int = 1,
    interpreted: bool = INTERPRETED,
) -> dict[str, int | bool]:
    """Compile-time parameters for one step's shapes (public: tests compile exactly these)."""
    group = num_heads // num_kv_heads
    group_pad = _next_pow2(group)
    # tl.dot wants at least 16 rows; prefill tiles aim for 64 rows (token x head-in-group).
    block_q = max(16 // group_pad, min(_next_pow2(max_query_len), max(1, 64 // group_pad)), 1)
    if interpreted:
        block_n = 16  # small key steps cost little here and exercise the online softmax more
    elif head_dim > 128 or (dtype == torch.float32 and head_dim > 64):
        block_n = 32  # keeps K/V tiles within shared memory on smaller GPUs
    else:
        block_n = 64
    return {
        "BLOCK_SIZE": block_size,
        "HEAD_DIM": head_dim,
        "D_PAD": max(16, _next_pow2(head_dim)),
        "GROUP": group,
        "GROUP_PAD": group_pad,
        "BLOCK_Q": block_q,
        "BLOCK_N": block_n,
        "FP32_DOT": interpreted or dtype == torch.float32,
        "SPLIT": num_splits > 1,
    }


@functools.cache
def _sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def _auto_splits(programs: int, max_ctx: int, block_n: int, device: torch.device) -> int:
    """Split the keys only when the step alone cannot fill the GPU and contexts are long."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    return max(1, min(16, triton.cdiv(2 * sms, programs), max_ctx // (4 * block_n)))


def compile_for_target(
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_query_len: int,
    num_splits: int = 1,
    arch: int = 90,
) -> bytes:
    """Compile the kernel as the wrapper would launch it, for CUDA compute capability `arch`.

    Needs no GPU (the Triton wheel ships ptxas), so CPU CI can catch what only the compiler
    rejects. Run it in a process where TRITON_INTERPRET is unset. Returns the cubin.
    """
    if INTERPRETED:
        raise RuntimeError("compile_for_target needs TRITON_INTERPRET unset at import")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = kernel_constexprs(
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        max_query_len,
        dtype,
        num_splits=num_splits,
        interpreted=False,
    )
    elem = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    signature: dict[str, str] = {}
    for name in _paged_attention_kernel.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name in ("q_ptr", "kv_ptr") or (name == "out_ptr" and num_splits == 1):
            signature[name] = f"*{elem}"
        elif name in ("out_ptr", "lse_ptr"):
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):
            signature[name] = "*i64"
        else:
            signature[name] = "fp32" if name == "scale_log2" else "i32"
    source = ASTSource(_paged_attention_kernel, signature, consts)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32))
    return bytes(compiled.asm["cubin"])


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached context (Triton).

    Same contract as the reference: q (T, H, D), kv_cache (2, num_blocks, block_size, KVH, D)
    already holding this step's K/V; returns (T, H, D) in q's dtype, accumulation in float32.
    Rows of q that belong to no sequence (past query_start_loc[-1]) are left unspecified.
    num_kv_splits: key splits per program (None: chosen from the GPU's size; 1 on CPU).
    """
    _check_inputs(q, kv_cache, meta)
    if num_kv_splits is not None and num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be at least 1, got {num_kv_splits}")
    t, h, d = q.shape
    _, _, block_size, kvh, _ = kv_cache.shape
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    starts = meta.query_start_loc_list
    max_q = max((b - a for a, b in itertools.pairwise(starts)), default=0)
    if t == 0 or max_q == 0:
        return out
    consts = kernel_constexprs(h, kvh, d, block_size, max_q, q.dtype)
    block_n = int(consts["BLOCK_N"])
    q_tiles = triton.cdiv(max_q, int(consts["BLOCK_Q"]))
    max_ctx = max(meta.seq_lens_list)
    splits = num_kv_splits or _auto_splits(
        meta.num_seqs * q_tiles * kvh, max_ctx, block_n, q.device
    )
    split_len = triton.cdiv(triton.cdiv(max_ctx, splits), block_n) * block_n
    splits = triton.cdiv(max_ctx, split_len)  # none empty for every sequence
    if splits > 1:
        consts = kernel_constexprs(h, kvh, d, block_size, max_q, q.dtype, num_splits=splits)
        dest = torch.empty((splits, t, h, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((splits, t, h), dtype=torch.float32, device=q.device)
    else:
        dest, lse = out.unsqueeze(0), out  # lse is not touched without SPLIT
    _paged_attention_kernel[(meta.num_seqs, q_tiles * splits, kvh)](
        dest,
        q,
        kv_cache,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        lse,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        dest.stride(1),
        dest.stride(2),
        dest.stride(0),
        lse.stride(0),
        lse.stride(1),
        splits,
        split_len,
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        meta.block_tables.stride(0),
        meta.block_tables.stride(1),
        **consts,
    )
    if splits == 1:
        return out
    # Merge the partial softmaxes: weight each by its share of the total exp-sum (base 2).
    weight = torch.exp2(lse - lse.amax(0))  # (S, T, H); an empty split weighs 0
    merged = (weight.unsqueeze(-1) * dest).sum(0) / weight.sum(0).unsqueeze(-1)
    return merged.to(q.dtype)
