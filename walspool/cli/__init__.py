"""The ``walspool`` command line: inspect a spool, replay it into state.db, export it.

See ``DESCRIPTION`` (the top-level help) and docs/cli.md.
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
from typing import NoReturn

import apsw

from ..errors import WalspoolError
from ..store.records import AGENT_HISTORY, CAP_DROP, SHUTDOWN
from ..store.spool import default_path
from . import (
    check,
    demo,
    drop,
    export,
    import_json,
    ls,
    metrics,
    replay,
    requeue,
    show,
    stats,
    vacuum,
    watch,
)
from ._filters import UsageError
from ._interrupt import Interrupted
from ._output import (
    EXIT_BUSY,
    EXIT_ERROR,
    EXIT_USAGE,
    ReplayRunning,
    as_path,
    dump,
    log_lines,
    warn,
)
from ._owner import command_owner, run_as
from ._reading import spool_error

#: The gateway's state.db, beside its spool in ``HERMES_HOME``: ``replay``'s default
#: ``--into``.
STATE_DB_NAME = "state.db"

__all__ = ["COMMANDS", "EXAMPLES", "TOP_EXAMPLES", "build_parser", "main"]

DESCRIPTION = """\
Inspect the gateway's overflow spool, replay it into state.db, export it.

usage: walspool COMMAND [SPOOL] [options]; `walspool COMMAND --help` for each command.
SPOOL defaults to $HERMES_HOME/spool.db (HERMES_HOME defaults to ~/.hermes), the
gateway's own spool. Read commands (stats, ls, show, export, check, watch) never write
to the spool and never block a gateway writing to it; requeue and drop (each change
recorded in the spool's audit table) and vacuum are the operators' changes to it."""
#: What ``walspool --help`` ends with: an outage looked at, then replayed.
TOP_EXAMPLES = (
    "walspool stats",
    "walspool ls",
    "walspool show telegram:12345 --failing",
    "walspool replay --dry-run",
    "walspool replay",
)
_TOP_EXAMPLES_TEXT = "\n".join(f"  {line}" for line in TOP_EXAMPLES)
EPILOG = f"""\
reasons (--reason), besides any other a caller chose:
  {CAP_DROP:<40} evicted at the gateway's 200-message cap
  {SHUTDOWN:<40} pending when the gateway shut down
  {AGENT_HISTORY:<40} an agent's unsaved history; replayed
  {"":<40} only when asked for with --reason

exit status: 0 done; 1 error (one line on stderr, `walspool COMMAND: ...`), a
damaged spool included, whatever the command; 2 bad usage; 3 done, but rows were held
back (replay), files left in place (import-json), or the rows drop would take only
listed (no --yes); 4 another replay of the spool is running (replay,
requeue, drop; --wait SECONDS waits for it); 5 done, but rows were quarantined
(replay: kept, not replayed; see `walspool ls`); 130 interrupted (SIGINT); 143
stopped by SIGTERM (replay); 141 stdout closed early (`walspool export | head`).

--json errors: with --json, an error also prints one JSON object on stdout,
{{"command": "...", "error": "...", "exit": N}}, N the exit status above.

examples (an outage, as README's incident runbook walks it):
{_TOP_EXAMPLES_TEXT}"""

#: What each command's --help ends with: its common uses, as an operator types them
#: (SPOOL left to its default, $HERMES_HOME/spool.db). Each parses (tests/test_cli.py).
EXAMPLES: dict[str, tuple[str, ...]] = {
    "stats": ("walspool stats", "walspool stats --sample 5", "walspool stats /srv/spool.db --json"),
    "ls": ("walspool ls", "walspool ls --json"),
    "show": (
        "walspool show telegram:12345 --failing",
        "walspool show telegram:12345 --tail 20 --full",
        "walspool show key:agent:main:telegram:dm:1",
    ),
    "replay": (
        "walspool replay --dry-run",
        "walspool replay",
        "walspool replay --session telegram:12345 --wait 30",
        "walspool replay /srv/spool.db --into /srv/state.db --json",
    ),
    "export": (
        "walspool export --session telegram:12345 > session.jsonl",
        "walspool export --failing --since 2h",
    ),
    "import-json": ("walspool import-json ~/.hermes/pending_messages",),
    "check": ("walspool check", "walspool check /srv/spool.db --json"),
    "requeue": ("walspool requeue --id 7-9,12", "walspool requeue --session telegram:12345"),
    "drop": (
        "walspool drop --id 1198-1200",
        "walspool drop --id 1198-1200 --yes",
        "walspool drop --session telegram:12345 --superseded --yes",
    ),
    "vacuum": ("walspool vacuum",),
    "watch": ("walspool watch", "walspool watch --interval 5", "walspool watch --wait-for-spool"),
    "metrics": (
        "walspool metrics > /var/lib/node_exporter/textfile/walspool.prom",
        "walspool metrics --listen 127.0.0.1:9464",
    ),
    "demo": ("walspool demo",),
}

Command = Callable[[argparse.Namespace], int]
#: name, function (its docstring is its help), and the function that adds its own arguments
COMMANDS: tuple[tuple[str, Command, Callable[[argparse.ArgumentParser], None] | None], ...] = (
    ("stats", stats.run, stats.add_arguments),
    ("ls", ls.run, None),
    ("show", show.run, show.add_arguments),
    ("replay", replay.run, replay.add_arguments),
    ("export", export.run, export.add_arguments),
    ("import-json", import_json.run, import_json.add_arguments),
    ("check", check.run, check.add_arguments),
    ("requeue", requeue.run, requeue.add_arguments),
    ("drop", drop.run, drop.add_arguments),
    ("vacuum", vacuum.run, vacuum.add_arguments),
    ("watch", watch.run, watch.add_arguments),
    ("metrics", metrics.run, metrics.add_arguments),
    ("demo", demo.run, None),
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one subcommand per command module, its ``run`` docstring its help."""
    parser = _Parser(
        prog="walspool",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"walspool {_version()}")
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", title="commands", parser_class=_Parser
    )
    for name, fn, add_args in COMMANDS:
        doc = inspect.cleandoc(fn.__doc__ or "")
        sub = commands.add_parser(
            name,
            help=doc.split("\n")[0],
            description=doc,
            epilog="examples:\n" + "\n".join(f"  {line}" for line in EXAMPLES[name]),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if name != "demo":
            sub.add_argument(
                "spool",
                type=as_path,
                nargs="?",
                default=default_path(),
                metavar="SPOOL",
                # Not %(default)s: the intermixed parse hides a positional's default.
                help="the spool file (default: $HERMES_HOME/spool.db, now "
                f"{str(default_path()).replace('%', '%%')})",
            )
        if add_args is not None:
            add_args(sub)
        if name != "demo":
            sub.add_argument(
                "--json", action="store_true", help="print JSON (the contract: docs/cli.md)"
            )
        sub.set_defaults(func=fn)
    return parser


class _Parser(argparse.ArgumentParser):
    """Options may come between positional arguments (``show SPOOL --limit 2 SESSION``),
    as ``parse_intermixed_args`` allows; a usage error raises ``_BadUsage`` once argparse
    has printed it, so that ``main`` can add its ``--json`` object."""

    _intermixing = False

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        # The subcommand's parser is handed its arguments through parse_known_args;
        # parse_known_intermixed_args calls it in turn, for its two passes.
        if self._intermixing or self._subparsers is not None:
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise _BadUsage(message)


class _BadUsage(Exception):
    """argparse found the command line wrong (exit status 2); its text is printed."""


def _version() -> str:
    try:
        return importlib.metadata.version("walspool")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (see ``EPILOG``).

    Every error is one line on stderr and a non-zero status; with --json it is also one
    object on stdout, ``{"command": ..., "error": ..., "exit": N}``: exit 1 for an
    error (a damaged spool included), 2 for bad usage, 130 and 143 for a signal.
    ``--help`` and ``--version`` exit 0 through ``SystemExit``, as argparse does.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
    except _BadUsage as exc:
        if "--json" in argv:
            # The command as given, known or not: the first argument that is not an
            # option (the top level takes none with a value); "" when there is none.
            name = next((a for a in argv if not a.startswith("-")), "")
            print(dump({"command": name, "error": str(exc), "exit": EXIT_USAGE}))
        raise SystemExit(EXIT_USAGE) from None
    if getattr(args, "into", False) is None:  # replay: the state.db beside the spool
        args.into = args.spool.parent / STATE_DB_NAME
    owner = command_owner(args)
    if owner is not None:  # root, on another user's files: see _owner
        return run_as(owner, args, lambda: _report(args))
    return _report(args)


def _report(args: argparse.Namespace) -> int:
    """Run the command; report its error, if any; its exit status."""
    status, error = _run(args)
    if error is not None:
        warn(args.command, error)
        if getattr(args, "json", False):
            print(dump({"command": args.command, "error": error, "exit": status}))
    return status


def _run(args: argparse.Namespace) -> tuple[int, str | None]:
    """The command's exit status, and the error to report if it failed."""
    try:
        with log_lines(args.command):
            return int(args.func(args)), None
    except UsageError as exc:
        return EXIT_USAGE, str(exc)
    except ReplayRunning as exc:
        return EXIT_BUSY, str(exc)
    except WalspoolError as exc:
        return EXIT_ERROR, str(exc)
    except apsw.Error as exc:
        return EXIT_ERROR, str(spool_error(exc, getattr(args, "spool", Path("?"))))
    except BrokenPipeError:
        # The reader went away (`walspool export ... | head`): stop quietly.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141, None
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        return EXIT_ERROR, f"cannot access{where}: {exc.strerror or exc}"
    except KeyboardInterrupt:
        return 130, "interrupted"
    except Interrupted as exc:
        return exc.status, f"interrupted by {exc.name}"
