"""The ``sglang-frspec`` command line: one module per subcommand.

Each subcommand module defines ``add_parser(subparsers)``, which registers its parser and sets
``func`` to a ``run(args) -> int`` function.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import version

from sglang_frspec.cli import build_map, demo, inspect_map, plan, size
from sglang_frspec.core import TokenMapError, UnsupportedSetupError

SUBCOMMANDS = [build_map, inspect_map, plan, size, demo]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang-frspec",
        description="FR-Spec token maps for SGLang EAGLE under tensor parallelism.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('sglang-frspec')}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except (TokenMapError, UnsupportedSetupError, FileNotFoundError) as e:
        print(f"sglang-frspec {args.command}: error: {e}", file=sys.stderr)
        return 2
