"""`inference-svc` command line: one subcommand per module, imported only when used.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "plan": (
        "inference_svc.engine.plan_cli",
        "print the memory plan for a config, no weights needed",
    ),
    "preshard": ("inference_svc.loader.preshard_cli", "write one safetensors set per TP rank"),
    "serve": ("inference_svc.server.serve_cli", "serve the gRPC APIs"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inference-svc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.run(args))


if __name__ == "__main__":
    sys.exit(main())
