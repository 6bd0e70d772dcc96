"""The ``walspool`` command line: inspect a spool, replay it into state.db, export it.

See ``DESCRIPTION`` (the top-level help) and README.md, "Command line".
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import apsw

from ..errors import WalspoolError
from ..records import AGENT_HISTORY, CAP_DROP, SHUTDOWN
from ..spool import default_path
from . import (
    check,
    demo,
    drop,
    export,
    import_json,
    ls,
    replay,
    requeue,
    show,
    stats,
    vacuum,
    watch,
)
from ._filters import UsageError
from ._interrupt import Interrupted
from ._output import EXIT_ERROR, EXIT_USAGE, as_path, log_lines, warn
from ._reading import spool_error

__all__ = ["COMMANDS", "build_parser", "main"]

DESCRIPTION = """\
Inspect the gateway's overflow spool, replay it into state.db, export it.

usage: walspool COMMAND [SPOOL] [options]; `walspool COMMAND --help` for each command.
SPOOL defaults to $HERMES_HOME/spool.db (HERMES_HOME defaults to ~/.hermes), the
gateway's own spool. Read commands (stats, ls, show, export, check, watch) never write
to the spool and never block a gateway writing to it; requeue and drop (each change
recorded in the spool's audit table) and vacuum are the operators' changes to it."""
EPILOG = f"""\
reasons (--reason), besides any other a caller chose:
  {CAP_DROP:<40} evicted at the gateway's 200-message cap
  {SHUTDOWN:<40} pending when the gateway shut down
  {AGENT_HISTORY:<40} an agent's unsaved history; replayed
  {"":<40} only when asked for with --reason

exit status: 0 done; 1 error (one line on stderr, `walspool COMMAND: ...`); 2 bad
usage; 3 done, but rows were held back (replay) or files left in place (import-json);
4 another replay of the spool is running (replay, requeue, drop; --wait SECONDS
waits for it); 130 interrupted (SIGINT); 143 stopped by SIGTERM (replay); 141 stdout
closed early (`walspool export | head`)."""

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
    ("requeue", requeue.run, requeue.add_arguments),
    ("drop", drop.run, drop.add_arguments),
    ("vacuum", vacuum.run, vacuum.add_arguments),
    ("watch", watch.run, watch.add_arguments),
    ("demo", demo.run, None),
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one subcommand per command module, its ``run`` docstring its help."""
    parser = argparse.ArgumentParser(
        prog="walspool",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"walspool {_version()}")
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", title="commands"
    )
    for name, fn, add_args in COMMANDS:
        doc = inspect.cleandoc(fn.__doc__ or "")
        sub = commands.add_parser(
            name,
            help=doc.split("\n")[0],
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if name != "demo":
            sub.add_argument(
                "spool",
                type=as_path,
                nargs="?",
                default=default_path(),
                metavar="SPOOL",
                help="the spool file (default: $HERMES_HOME/spool.db, now %(default)s)",
            )
        if add_args is not None:
            add_args(sub)
        if name != "demo":
            sub.add_argument(
                "--json", action="store_true", help="print JSON (see the README contract)"
            )
        sub.set_defaults(func=fn)
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("walspool")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


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
    except Interrupted as exc:
        warn(args.command, f"interrupted by {exc.name}")
        return exc.status
    return EXIT_ERROR
