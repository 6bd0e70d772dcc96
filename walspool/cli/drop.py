"""``walspool drop``: delete set-aside rows, each kept whole in the audit table."""

from __future__ import annotations

import argparse

from ..store.maintenance import drop, not_set_aside
from ._output import EXIT_ERROR, EXIT_HELD, dump, warn
from ._rowchange import add_arguments as add_row_arguments
from ._rowchange import run_change, would_change


def run(args: argparse.Namespace) -> int:
    """Delete quarantined or superseded rows the gateway should never get (needs --yes).

    Rows by --id (repeatable, or comma-separated, with ranges: 7-9; a list that reads
    as one number with thousands separators, such as 1,041, is refused as ambiguous:
    ids print without them), or chosen: --session S with --quarantined or
    --superseded (either alone: every such row of the spool). Without --yes it changes
    nothing: it lists the rows it would drop (with --json, an object with "would_drop",
    "rows", "missing" and the error's "command", "error" and "exit") and exits 3 (ran,
    left them behind). Each row dropped is copied whole (payload, reason, times, last
    error) into the spool's audit table with who dropped it, so a drop can be undone by
    hand; its session never reuses its seq. All the rows named, or none: a row that is
    missing, replayable or in flight is named and nothing changes (exit 1, with or
    without --yes: the list without --yes shows them as refused). While a replay runs
    it exits 4 at once, as replay does, or waits --wait SECONDS for it first.
    """
    if not args.yes:
        would = would_change(args, "drop")
        problems = would.pop("problems")
        if problems:  # --yes would refuse them all: say so now, not "pass --yes"
            status, error = EXIT_ERROR, str(not_set_aside(args.spool, "drop", problems))
        else:
            status = EXIT_HELD  # ran, and left the rows where they are
            error = "nothing was dropped: pass --yes to drop these rows (kept in the audit table)"
        warn("drop", error)
        if args.json:
            print(dump({"command": "drop", "error": error, "exit": status, **would}))
        return status
    return run_change(args, "drop", drop, "dropped")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_row_arguments(p)
    p.add_argument("--yes", action="store_true", help="really drop them")
