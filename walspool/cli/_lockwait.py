"""``--wait``: how long a command waits for another replay of the spool (its replay
lock) before exit 4, the same for ``replay``, ``requeue`` and ``drop``: by default not
at all; with ``--wait SECONDS`` a line says it waits, and for whom."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..store.replay_lock import LOCK_SUFFIX
from ._output import warn


def seconds(text: str) -> float:
    """A number of seconds, not negative (``--wait``, ``--sample``)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds")
    return value


def add_wait_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--wait",
        type=seconds,
        default=0.0,
        metavar="SECONDS",
        help="wait this long for another replay of the spool to end (default: do not "
        "wait; exit 4 at once)",
    )


def lock_of(spool: Path) -> str:
    return f"{spool}{LOCK_SUFFIX}"


def say_waiting(command: str, args: argparse.Namespace, pid: int | None) -> None:
    """The line a command prints before it waits ``args.wait`` for the lock's holder."""
    holder = f"process {pid}" if pid is not None else "it"
    warn(
        command,
        f"waiting for another replay of {args.spool} ({holder} holds "
        f"{lock_of(args.spool)}), at most {args.wait:g} s",
    )


def busy_message(args: argparse.Namespace, pid: int | None) -> str:
    """Why the command did not run: another replay (process ``pid``, if known) holds
    the lock, at once or after ``args.wait`` seconds."""
    lock = lock_of(args.spool)
    holder = f"process {pid}" if pid is not None else "it"
    spool = args.spool
    if args.wait:
        first = f"another replay of {spool} ({holder}) still holds {lock} after {args.wait:g} s"
        then = "run again when it ends"
    else:
        first = f"another replay of {spool} is running ({holder} holds {lock}); not waiting"
        then = "run again when it ends, or give --wait SECONDS"
    if pid is None:
        then += f" (`fuser {lock}` names its process)"
    return f"{first}; {then}"
