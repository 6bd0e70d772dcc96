"""``walspool export``: spooled records as JSON lines."""

from __future__ import annotations

import argparse
import sys

from . import _narrow
from ._filters import check_reasons
from ._output import Progress, add_progress_argument, dump
from ._reading import count_records, iter_records, reading, record_json, report_bad


def run(args: argparse.Namespace) -> int:
    """Write spooled records to stdout as JSON lines, one record per line.

    Each session in drop order (rows spooled by session id first, then rows spooled
    by session key only). Every reason is exported unless --reason is given.
    """
    bad: list[str] = []
    with reading(args.spool) as reader:
        check_reasons(reader, args.reason)
        progress = Progress("export", sys.stderr, enabled=args.progress)
        narrowing = args.limit, args.tail, args.since, args.failing or None
        counted = progress.enabled and narrowing == (None, None, None, None)
        total = count_records(reader, args.session, args.reason) if counted else 0
        out = sys.stdout
        try:
            rows = _narrow.narrowed(iter_records(reader, args.session, args.reason, bad=bad), args)
            for n, (record, inflight) in enumerate(rows, 1):
                out.write(dump(record_json(record, inflight)) + "\n")
                progress(n, total)
        finally:
            progress.close()
    out.flush()
    return report_bad("export", bad)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--session", metavar="S", help="only this session (id or key)")
    p.add_argument(
        "--reason",
        action="append",
        metavar="R",
        help="only rows of this reason (repeatable); default: every reason",
    )
    _narrow.add_arguments(p)
    add_progress_argument(p)
