"""`inference-svc preshard MODEL_DIR --tp N --out DIR`: write one safetensors set per TP rank."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", type=Path, help="a model directory with safetensors weights")
    parser.add_argument("--tp", type=int, required=True, help="tensor-parallel size to shard for")
    parser.add_argument("--out", type=Path, required=True, help="output directory (must not exist)")
    parser.add_argument(
        "--revision", default=None, help="source revision to record (default: detected)"
    )


def run(args: argparse.Namespace) -> int:
    from inference_svc.loader.errors import CheckpointError
    from inference_svc.loader.preshard import write_presharded
    from inference_svc.model.config import ModelConfigError

    try:
        out = write_presharded(args.model_dir, args.tp, args.out, args.revision)
    except (CheckpointError, ModelConfigError, FileExistsError) as e:
        print(f"inference-svc preshard: {e}", file=sys.stderr)
        return 2
    print(f"wrote TP={args.tp} pre-sharded checkpoint to {out}")
    return 0
