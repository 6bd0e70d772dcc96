"""``walspool requeue``: put set-aside rows back in line for the next replay."""

from __future__ import annotations

import argparse

from ..store.maintenance import requeue
from ._rowchange import add_arguments as add_row_arguments
from ._rowchange import run_change


def run(args: argparse.Namespace) -> int:
    """Make quarantined or superseded rows replayable again (attempts and error cleared).

    For a row set aside that should move after all: state.db was fixed, or it was
    checked and the message is not there. Rows by --id (repeatable, or
    comma-separated, with ranges: 7-9), or chosen: --session S with --quarantined or --superseded
    (either alone: every such row of the spool). All the rows named, or none: a row that is
    missing, replayable already or in flight is named and nothing changes (exit 1).
    Each change is recorded in the spool's audit table with who made it. While a
    replay runs it exits 4 at once, as replay does, or waits --wait SECONDS for it first.
    """
    return run_change(args, "requeue", requeue, "requeued")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_row_arguments(p)
