"""The `cloche` command line. `cloche serve --help` lists every server setting."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from cloche.commands import add_commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cloche", description=__doc__)
    subparsers = parser.add_subparsers(title="commands", required=True)
    add_commands(subparsers)  # serve, and the clients of a server: run, repl, sessions, ...
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
