"""``walspool export``: spooled records as JSON lines."""

from __future__ import annotations

import argparse
import sys

from ..store.reader import count_records, iter_records
from ._filters import (
    KEY_PREFIX,
    add_narrowing_arguments,
    check_reasons,
    check_session,
    has_stream,
    narrowed,
)
from ._output import Progress, add_progress_argument
from ._reading import reading, record_line, report_bad


def run(args: argparse.Namespace) -> int:
    """Write spooled records to stdout as JSON lines, one record per line.

    Each session in drop order (rows spooled by session id first, then rows spooled
    by session key only). Every reason is exported unless --reason is given.
    --session S takes `key:<KEY>` as ls prints it too; one with no row is an error
    (exit 1). The lines are JSON whatever;
    with --json an error (exit 1: a damaged spool, rows whose payload is not JSON) is
    also one last line on stdout, {"command": "export", "error": ..., "exit": 1},
    which no record line has (records have "id"). Each message is the payload's JSON
    text as stored, copied, not decoded (control, format and separator characters in
    it as \\uXXXX escapes); a payload that is not JSON is flagged ("bad_payload").
    """
    bad: list[str] = []
    with reading(args.spool) as reader:
        check_reasons(reader, args.reason)
        kinds = ("id", "key")
        if args.session is not None and args.session.startswith(KEY_PREFIX):
            if not any(has_stream(reader, args.session, kind) for kind in kinds):
                args.session, kinds = args.session[len(KEY_PREFIX) :], ("key",)
        # A session with no row is a typo, as for show, replay, requeue and drop.
        check_session(reader, args.session)
        progress = Progress("export", sys.stderr, enabled=args.progress)
        narrowing = args.limit, args.tail, args.since, args.failing or None
        counted = progress.enabled and narrowing == (None, None, None, None)
        total = count_records(reader, args.session, args.reason) if counted else 0
        out = sys.stdout
        try:
            found = iter_records(reader, args.session, args.reason, bad=bad, kinds=kinds, raw=True)
            rows = narrowed(found, args)
            for n, (record, inflight) in enumerate(rows, 1):
                out.write(record_line(record, inflight) + "\n")
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
    add_narrowing_arguments(p)
    add_progress_argument(p)
