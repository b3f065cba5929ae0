"""`inference-svc plan`: print the memory plan for a config.json, no weights needed.

JSON keys (`--json`, all sizes in bytes, per rank): budget_bytes (device memory × utilisation),
weight_bytes_per_rank, activation_bytes (given, or estimated for --max-num-batched-tokens),
overhead_bytes, kv_bytes_per_token, block_size, block_bytes, num_blocks, kv_pool_bytes,
kv_token_capacity, max_model_len, max_sequences ({length: sequences that fit at once}),
plus num_parameters, tp_size, weight_dtype, kv_dtype, activation_estimated. On refusal:
{"error": message, "advised_max_model_len": n} and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from inference_svc.engine.planner import (
    MIB,
    InsufficientMemoryError,
    ModelShape,
    PlanError,
    PlanInputs,
    estimate_activation_bytes,
    normalize_dtype,
    parse_bytes,
    plan_memory,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, type=Path, help="config.json or its folder")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size (default 1)")
    parser.add_argument(
        "--memory", required=True, help="device memory per rank, e.g. 80GB, 24GiB (GB = 1e9)"
    )
    parser.add_argument(
        "--utilization", type=float, default=0.9, help="fraction of --memory to use (default 0.9)"
    )
    parser.add_argument(
        "--dtype",
        default=None,
        help="weight dtype: float32, float16, bfloat16, int8, int4 (default: the config's "
        "dtype / torch_dtype, float16 if it names none)",
    )
    parser.add_argument(
        "--kv-dtype", default=None, help="KV cache dtype (default: --dtype, float16 if quantized)"
    )
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the config's")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--activation", default=None, help="measured activation peak; default: an estimate"
    )
    parser.add_argument("--overhead", default="1GiB", help="runtime overhead (default 1GiB)")
    parser.add_argument(
        "--lengths",
        default=None,
        help="comma-separated sequence lengths to report capacity for (default: 512,2048,max)",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def _config_dtype(path: Path) -> str:
    """The checkpoint's own dtype, as transformers writes it (`dtype`, formerly `torch_dtype`)."""
    config_file = path / "config.json" if path.is_dir() else path
    raw = json.loads(config_file.read_text())
    return str(raw.get("dtype") or raw.get("torch_dtype") or "float16")


def _parse_lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(x) for x in text.split(","))
    except ValueError:
        lengths = ()
    if not lengths or min(lengths) < 1:
        raise PlanError(f"--lengths must be comma-separated positive integers, got {text!r}")
    return lengths


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    shape = ModelShape.from_config_file(args.config)
    dtype = normalize_dtype(args.dtype or _config_dtype(args.config))
    kv_dtype = normalize_dtype(
        args.kv_dtype or (dtype if dtype in ("float32", "float16", "bfloat16") else "float16")
    )
    if not 0 < args.utilization <= 1:
        raise PlanError(f"--utilization must be in (0, 1], got {args.utilization}")
    budget = int(parse_bytes(args.memory) * args.utilization)
    max_len = args.max_model_len or shape.max_position_embeddings
    compute_dtype = kv_dtype
    estimated = args.activation is None
    activation = (
        estimate_activation_bytes(
            shape, args.tp, compute_dtype, args.max_num_batched_tokens, args.max_num_seqs
        )
        if estimated
        else parse_bytes(args.activation)
    )
    lengths = (
        _parse_lengths(args.lengths)
        if args.lengths
        else tuple(sorted({min(512, max_len), min(2048, max_len), max_len}))
    )
    inputs = PlanInputs(
        shape=shape,
        tp_size=args.tp,
        weight_dtype=dtype,
        kv_dtype=kv_dtype,
        memory_budget_bytes=budget,
        activation_peak_bytes=activation,
        runtime_overhead_bytes=parse_bytes(args.overhead),
        max_model_len=max_len,
        block_size=args.block_size,
    )
    extra: dict[str, Any] = {
        "num_parameters": shape.num_parameters(),
        "tp_size": args.tp,
        "weight_dtype": dtype,
        "kv_dtype": kv_dtype,
        "activation_estimated": estimated,
    }
    try:
        plan = plan_memory(inputs)
    except InsufficientMemoryError as exc:
        if args.json:
            print(
                json.dumps({"error": str(exc), "advised_max_model_len": exc.advised_max_model_len})
            )
        else:
            print(f"refused: {exc}", file=sys.stderr)
        return 2
    figures = {**plan.to_dict(lengths), **extra}
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    act_note = " (estimated)" if estimated else " (given)"
    rows = [
        ("parameters", f"{shape.num_parameters() / 1e9:.3f} B"),
        ("budget per rank", f"{_human(budget)} ({args.memory} × {args.utilization})"),
        ("weights per rank", f"{_human(plan.weight_bytes)} ({dtype}, TP={args.tp})"),
        ("activations", _human(plan.activation_bytes) + act_note),
        ("runtime overhead", _human(plan.overhead_bytes)),
        ("KV bytes per token", f"{plan.kv_bytes_per_token} B ({kv_dtype})"),
        ("block", f"{plan.block_size} tokens, {_human(plan.block_bytes)}"),
        ("KV pool", f"{plan.num_blocks} blocks, {_human(plan.kv_pool_bytes)}"),
        ("KV token capacity", f"{plan.kv_token_capacity} tokens"),
        ("max model len", str(plan.max_model_len)),
    ]
    rows += [(f"sequences of {n}", str(plan.max_sequences(n))) for n in lengths]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    if plan.kv_pool_bytes < 64 * MIB:
        print("warning: the KV pool is under 64 MiB; throughput will be poor", file=sys.stderr)
    return 0
