"""``walspool drop``: delete set-aside rows, each kept whole in the audit table."""

from __future__ import annotations

import argparse

from ..maintenance import drop
from ._filters import UsageError
from ._rowchange import add_arguments as add_row_arguments
from ._rowchange import run_change


def run(args: argparse.Namespace) -> int:
    """Delete quarantined or superseded rows the gateway should never get (needs --yes).

    Each row is copied whole (payload, reason, times, last error) into the spool's
    audit table with who dropped it, so a drop can be undone by hand; its session never
    reuses its seq. All the rows named, or none: a row that is missing, replayable or
    in flight is named and nothing changes (exit 1). Waits for a running replay
    (--wait SECONDS; exit 4 when it outlasts that).
    """
    if not args.yes:
        raise UsageError("drop deletes rows from the spool (kept in its audit table); pass --yes")
    return run_change(args, "drop", drop, "dropped")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_row_arguments(p)
    p.add_argument("--yes", action="store_true", help="really drop them")
