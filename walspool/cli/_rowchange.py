"""What ``requeue`` and ``drop`` share: the row ids they take, the lock wait, the report."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from ..errors import ReplayBusy
from ..maintenance import LOCK_WAIT, actor
from ..spool import Spool
from ..text import printable
from ._output import EXIT_BUSY, EXIT_OK, dump, plural, warn
from ._reading import reading

Change = Callable[..., list[int]]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--id",
        dest="ids",
        type=int,
        action="append",
        required=True,
        metavar="ID",
        help="a row's id, as `walspool show` and the failures view print it (repeat it "
        "for more rows)",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=LOCK_WAIT,
        metavar="SECONDS",
        help="wait this long for a running replay to end (default %(default)g)",
    )


def run_change(args: argparse.Namespace, command: str, change: Change, done: str) -> int:
    """Open the spool for writing (after the read path has reported any damage), make
    the change under the replay lock, and report it."""
    with reading(args.spool):  # a damaged spool is reported, never moved aside
        pass
    by = actor()
    try:
        with Spool(args.spool) as spool:
            ids = change(spool, args.ids, by=by, wait=args.wait)
    except ReplayBusy as busy:
        holder = f" (process {busy.pid})" if busy.pid is not None else ""
        warn(
            command,
            f"a replay of {args.spool}{holder} kept its lock for {args.wait:g} s; "
            "nothing was changed: run again when it ends, or give --wait SECONDS",
        )
        return EXIT_BUSY
    report(args, ids, by, done)
    return EXIT_OK


def report(args: argparse.Namespace, ids: Sequence[int], by: str, done: str) -> None:
    if args.json:
        print(dump({"spool": str(args.spool), done: list(ids), "by": by}))
    else:
        listed = ", ".join(str(i) for i in ids)
        print(f"{done} {plural(len(ids), 'row')} of {printable(args.spool)}: {listed}")
        print(f"recorded in its audit table as done by {printable(by)}")
