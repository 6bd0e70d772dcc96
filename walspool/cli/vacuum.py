"""``walspool vacuum``: give the space of drained rows back to the file system."""

from __future__ import annotations

import argparse
import sys

import msgspec

from ..store.maintenance import VACUUM_MAX_LIVE_BYTES, vacuum
from ..store.spool import Spool
from ..text import printable
from ._output import EXIT_OK, Steps, add_progress_argument, dump, size
from ._reading import reading, upgraded


def run(args: argparse.Namespace) -> int:
    """Shrink a drained spool: rewrite it without its free pages, truncate its -wal.

    A replay deletes rows but SQLite keeps their pages for later appends, so a spool
    that once held a million rows stays that size. The rewrite holds the spool's write
    lock while it copies the rows still there, and the gateway's appends wait for it
    (at most 10 s, then they stay in memory and retry), so a spool holding more than
    64 MiB of rows is refused unless --force (stop the gateway first). Safe while the
    gateway runs otherwise. --progress says on stderr what it is doing, and for how long.
    """
    upgraded("vacuum", args.spool)
    with reading(args.spool):  # a damaged spool is reported, never moved aside
        pass
    steps = Steps("vacuum", sys.stderr, enabled=args.progress)
    try:
        with Spool(args.spool) as spool:
            report = vacuum(spool, force=args.force, step=steps, tick=steps.ticker)
    finally:
        steps.close()
    if args.json:
        print(dump({"spool": str(args.spool), **msgspec.to_builtins(report)}))
        return EXIT_OK
    before = report.db_bytes_before + report.wal_bytes_before
    after = report.db_bytes + report.wal_bytes
    print(f"{printable(args.spool)}: {size(before)} -> {size(after)} (database and -wal)")
    if not report.checkpointed:
        print("a reader kept the -wal from being truncated: it shrinks at a later checkpoint")
    return EXIT_OK


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--force",
        action="store_true",
        help=f"rewrite even a spool holding more than {VACUUM_MAX_LIVE_BYTES // 2**20} MiB "
        "of rows (the gateway's appends wait meanwhile)",
    )
    add_progress_argument(p)
