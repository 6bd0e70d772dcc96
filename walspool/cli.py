"""The ``walspool`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .errors import WalspoolError


def cmd_demo(args: argparse.Namespace) -> int:
    """Spool messages during a simulated outage and read them back in order."""
    from .demo import run_demo

    return run_demo(sys.stdout)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="walspool", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, fn in (("demo", cmd_demo),):
        sub = commands.add_parser(name, help=fn.__doc__, description=fn.__doc__)
        sub.set_defaults(func=fn)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except WalspoolError as exc:
        print(f"walspool: {exc}", file=sys.stderr)
        return 1
