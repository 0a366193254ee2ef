"""Command line: ``python -m zephon_collate demo``."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zephon_collate", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="build records and a batch, and print its training tensors")
    args = parser.parse_args(argv)
    if args.command == "demo":
        example = Path(__file__).resolve().parent.parent / "examples" / "quickstart.py"
        runpy.run_path(str(example), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
