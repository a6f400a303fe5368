"""Command line: `python -m cpcompile inspect DUMP_DIR` (also installed as `cpcompile`)."""
from __future__ import annotations

import argparse
import sys

from .dump import inspect


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cpcompile", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("inspect", help="print the summary of a debug dump directory")
    show.add_argument("dump_dir")
    args = parser.parse_args(argv)
    if args.command == "inspect":
        try:
            print(inspect(args.dump_dir), end="")
        except FileNotFoundError as exc:
            print(f"cpcompile inspect: {exc}", file=sys.stderr)
            return 2
    return 0
