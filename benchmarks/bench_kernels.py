"""Paged attention on CUDA: the Triton kernel vs the PyTorch reference, side by side in one run.

Decode batches and prefill chunks over a paged bf16 cache (Llama-8B-like heads by default); also
dense SDPA on contiguous K/V as a yardstick, and the kernel's achieved KV read bandwidth on decode.
Also RMSNorm, Triton vs reference. Prints tables with ratios, writes JSON under benchmarks/results/.
Needs a GPU; on CPU it says so and exits 0.

    python benchmarks/bench_kernels.py [--quick] [--heads 32 --kv-heads 8 --head-dim 128]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Workload:
    name: str
    seqs: tuple[tuple[int, int], ...]  # (context length incl. new tokens, new tokens) per sequence


def workloads(quick: bool) -> list[Workload]:
    decode = [(1, 1024), (32, 1024), (128, 1024), (32, 4096), (8, 16384)]
    prefill = [(1, 2048, 2048), (4, 2048, 512), (16, 1024, 128)]
    if quick:
        decode, prefill = decode[1:3], prefill[:2]
    out = [Workload(f"decode b={b} ctx={ctx}", ((ctx, 1),) * b) for b, ctx in decode]
    out += [Workload(f"prefill b={b} ctx={ctx} new={n}", ((ctx, n),) * b) for b, ctx, n in prefill]
    return out


def build(
    w: Workload, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """q, a cache with every context on shuffled blocks, and the step metadata, all on CUDA."""
    from inference_svc.model.attention import AttentionMetadata

    per_seq = [-(-ctx // block_size) for ctx, _ in w.seqs]
    num_blocks = sum(per_seq)
    perm = torch.randperm(num_blocks)
    tables = torch.zeros(len(w.seqs), max(per_seq), dtype=torch.int64)
    at = 0
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = perm[at : at + nb]
        at += nb
    new = torch.tensor([n for _, n in w.seqs], dtype=torch.int64)
    qsl = torch.zeros(len(w.seqs) + 1, dtype=torch.int64)
    qsl[1:] = new.cumsum(0)
    meta = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=torch.tensor([ctx for ctx, _ in w.seqs], dtype=torch.int64),
        block_tables=tables,
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),  # unused: cache filled below
        block_size=block_size,
    ).to("cuda")
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, device="cuda", dtype=dtype)
    q = torch.randn(int(qsl[-1]), heads, head_dim, device="cuda", dtype=dtype)
    return q, kv, meta


def dense_sdpa_ms(w: Workload, q: torch.Tensor, kv_heads: int) -> float:
    """SDPA on contiguous per-sequence K/V of the same shapes: what paging costs, roughly."""
    import triton.testing

    ctx, n = w.seqs[0]  # the workloads are uniform
    b, h, d = len(w.seqs), q.shape[1], q.shape[2]
    qd = q.view(b, n, h, d).transpose(1, 2)  # (B, H, n, D)
    k = torch.randn(b, kv_heads, ctx, d, device="cuda", dtype=q.dtype)
    v = torch.randn_like(k)
    # The new tokens are the last n positions: causal with a bottom-right aligned mask; a fresh
    # prefill is plain causal, which lets SDPA pick its flash backend.
    mask = None if ctx == n else torch.ones(n, ctx, device="cuda", dtype=torch.bool).tril(ctx - n)

    def run() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            qd, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True
        )

    return float(triton.testing.do_bench(run))


def measure(w: Workload, args: argparse.Namespace, dtype: torch.dtype) -> dict[str, Any]:
    """Time one workload three ways and check the kernel against the reference on it."""
    import triton.testing

    from kernels.paged_attention import paged_attention as triton_attention
    from kernels.paged_attention_ref import paged_attention as reference

    torch.manual_seed(0)
    q, kv, meta = build(w, args.heads, args.kv_heads, args.head_dim, args.block_size, dtype)
    _ = meta.query_start_loc_list, meta.seq_lens_list  # host copies, cached once per step
    scale = args.head_dim**-0.5
    out = triton_attention(q, kv, meta, scale)
    err = float((out.float() - reference(q, kv, meta, scale).float()).abs().max())
    t_tri = float(triton.testing.do_bench(lambda: triton_attention(q, kv, meta, scale)))
    t_ref = float(triton.testing.do_bench(lambda: reference(q, kv, meta, scale), rep=200))
    t_sdpa = dense_sdpa_ms(w, q, args.kv_heads)
    elem = torch.finfo(dtype).bits // 8
    kv_bytes = 2 * sum(ctx for ctx, _ in w.seqs) * args.kv_heads * args.head_dim * elem
    return {
        **asdict(w),
        "triton_ms": t_tri,
        "reference_ms": t_ref,
        "sdpa_dense_ms": t_sdpa,
        "speedup_vs_reference": t_ref / t_tri,
        "triton_over_sdpa": t_tri / t_sdpa,
        "kv_read_gb_per_s": kv_bytes / (t_tri * 1e-3) / 1e9,
        "max_abs_err_vs_reference": err,
    }


def measure_rms_norm(tokens: int, hidden: int, dtype: torch.dtype) -> dict[str, Any]:
    import triton.testing

    from kernels.rms_norm import rms_norm, rms_norm_ref

    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    w = torch.randn(hidden, device="cuda", dtype=dtype)
    err = float((rms_norm(x, w, 1e-5).float() - rms_norm_ref(x, w, 1e-5).float()).abs().max())
    t_tri = float(triton.testing.do_bench(lambda: rms_norm(x, w, 1e-5)))
    t_ref = float(triton.testing.do_bench(lambda: rms_norm_ref(x, w, 1e-5)))
    gbps = 2 * x.numel() * x.element_size() / (t_tri * 1e-3) / 1e9
    return {
        "tokens": tokens,
        "hidden": hidden,
        "triton_ms": t_tri,
        "reference_ms": t_ref,
        "speedup_vs_reference": t_ref / t_tri,
        "gb_per_s": gbps,
        "max_abs_err_vs_reference": err,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer workloads")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_kernels.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench_kernels: needs a CUDA GPU (the Triton kernels run compiled only there); skipped"
        )
        return 0

    import triton

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    rows: list[dict[str, Any]] = []
    print(f"{torch.cuda.get_device_name()}  heads {args.heads}/{args.kv_heads}  d {args.head_dim}")
    print(
        f"{'workload':34} {'triton ms':>10} {'ref ms':>9} {'ref/tri':>8} {'sdpa ms':>8} "
        f"{'tri/sdpa':>9} {'KV GB/s':>8} {'max err':>8}"
    )
    for w in workloads(args.quick):
        r = measure(w, args, dtype)
        rows.append(r)
        print(
            f"{w.name:34} {r['triton_ms']:10.3f} {r['reference_ms']:9.3f} "
            f"{r['speedup_vs_reference']:8.1f} {r['sdpa_dense_ms']:8.3f} "
            f"{r['triton_over_sdpa']:9.2f} {r['kv_read_gb_per_s']:8.0f} "
            f"{r['max_abs_err_vs_reference']:8.1e}"
        )
        torch.cuda.empty_cache()
    norms: list[dict[str, Any]] = []
    print(
        f"\n{'rms_norm tokens x hidden':34} {'triton ms':>10} {'ref ms':>9} {'ref/tri':>8} "
        f"{'GB/s':>8} {'max err':>8}"
    )
    for tokens, hidden in [(1, 4096), (256, 4096), (8192, 4096), (8192, 8192)]:
        r = measure_rms_norm(tokens, hidden, dtype)
        norms.append(r)
        print(
            f"{f'{tokens} x {hidden}':34} {r['triton_ms']:10.4f} {r['reference_ms']:9.4f} "
            f"{r['speedup_vs_reference']:8.1f} {r['gb_per_s']:8.0f} "
            f"{r['max_abs_err_vs_reference']:8.1e}"
        )
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "config": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
        "rms_norm": norms,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
