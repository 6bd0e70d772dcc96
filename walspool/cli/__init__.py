"""The ``walspool`` command line: inspect a spool, replay it into state.db, export it.

Usage: ``walspool COMMAND SPOOL_PATH [options]``. Read commands (stats, ls, show,
export, check) open the spool read-only and never block or disturb a gateway writing
to it. Exit status: 0 done; 1 error (one line on stderr); 2 bad usage; 3 done, but
rows were held back (replay) or files left in place (import-json).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import apsw

from ..errors import WalspoolError
from . import check, demo, export, import_json, ls, replay, show, stats
from ._filters import UsageError
from ._output import EXIT_ERROR, EXIT_USAGE, as_path, log_lines, warn
from ._reading import spool_error

__all__ = ["COMMANDS", "build_parser", "main"]

Command = Callable[[argparse.Namespace], int]
#: name, function (its docstring is its help), and the function that adds its own arguments
COMMANDS: tuple[tuple[str, Command, Callable[[argparse.ArgumentParser], None] | None], ...] = (
    ("stats", stats.run, None),
    ("ls", ls.run, None),
    ("show", show.run, show.add_arguments),
    ("replay", replay.run, replay.add_arguments),
    ("export", export.run, export.add_arguments),
    ("import-json", import_json.run, import_json.add_arguments),
    ("check", check.run, None),
    ("demo", demo.run, None),
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one subcommand per command module, its ``run`` docstring its help."""
    parser = argparse.ArgumentParser(
        prog="walspool", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, fn, add_args in COMMANDS:
        doc = inspect.cleandoc(fn.__doc__ or "")
        sub = commands.add_parser(
            name,
            help=doc.split("\n")[0],
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if name != "demo":
            sub.add_argument("spool", type=as_path, metavar="SPOOL_PATH", help="the spool file")
        if add_args is not None:
            add_args(sub)
        if name != "demo":
            sub.add_argument(
                "--json", action="store_true", help="print JSON (see the README contract)"
            )
        sub.set_defaults(func=fn)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = build_parser().parse_args(argv)
    try:
        with log_lines(args.command):
            return int(args.func(args))
    except UsageError as exc:
        warn(args.command, str(exc))
        return EXIT_USAGE
    except WalspoolError as exc:
        warn(args.command, str(exc))
    except apsw.Error as exc:
        warn(args.command, str(spool_error(exc, getattr(args, "spool", Path("?")))))
    except BrokenPipeError:
        # The reader went away (`walspool export ... | head`): stop quietly.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        warn(args.command, f"cannot access{where}: {exc.strerror or exc}")
    except KeyboardInterrupt:
        warn(args.command, "interrupted")
        return 130
    return EXIT_ERROR
