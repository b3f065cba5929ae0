"""Regenerate the Python gRPC stubs (and .pyi type stubs) from the .proto sources.

Run `make protos` (or `python -m protos.generate`). The stubs are committed;
tests/protos/test_stubs.py regenerates into a temp dir and fails when they differ.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_FILES = (
    "protos/llm/v1/inference.proto",
    "protos/fmaas/generation.proto",
    "protos/weightcache/v1/cache.proto",
)


def generate(out_dir: Path) -> list[Path]:
    """Compile every proto into out_dir (laid out like the repo root); return files written."""
    from grpc_tools import protoc  # imported late: only this tool needs grpcio-tools

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{REPO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(REPO_ROOT / p) for p in PROTO_FILES),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = []
    for proto in PROTO_FILES:
        stem = proto.removesuffix(".proto")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            written.append(out_dir / f"{stem}{suffix}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: repo)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
