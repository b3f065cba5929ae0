"""`cache-sidecar` command line (fetch, serve, verify, ls, gc)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    raise SystemExit("cache-sidecar: not built yet")


if __name__ == "__main__":
    sys.exit(main())
