"""``walspool stats``: one summary of a spool."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import apsw
import msgspec

from ..records import QUARANTINED, SUPERSEDED
from ..spool import STATS_BY_REASON_SQL, STATS_FAILING_SQL, STATS_SESSIONS_SQL, stats_from
from ..text import printable
from ._holders import holders, holders_text
from ._output import EXIT_OK, dump, duration, iso, plural, size
from ._reading import INFLIGHT_SQL, reading

STATUS_COUNT_SQL = "SELECT status, count(*) FROM records WHERE status IS NOT NULL GROUP BY status"


def run(args: argparse.Namespace) -> int:
    """Summarize a spool.

    Rows, sessions, payload bytes, oldest and newest row (time and age), rows by reason,
    rows with errors, rows in flight, and the sizes of the db and WAL files; and who has
    the spool open (pid and command of each process holding its open lock, as watch
    shows). --json has `oldest_age` and `newest_age` in seconds (null for an empty
    spool) and `open_by` ([{"pid", "command"}]; null where the system cannot tell).
    """
    with reading(args.spool, walk=True) as reader:
        stats = reader.read(lambda conn: read_stats(conn, args.spool, time.time()))
    found = holders(args.spool)
    stats["open_by"] = None if found is None else [msgspec.to_builtins(h) for h in found]
    if args.json:
        print(dump(stats))
        return EXIT_OK
    reasons = [f"{n:,} {printable(reason)}" for reason, n in stats["by_reason"].items()] or ["-"]
    lines = [
        ("spool", printable(stats["spool"])),
        ("open by", holders_text(found, stats["rows"])),
        ("rows", f"{stats['rows']:,} in {plural(stats['sessions'], 'session')}"),
        ("payload", size(stats["bytes"])),
        ("oldest", _when(stats["oldest"], stats["oldest_age"])),
        ("newest", _when(stats["newest"], stats["newest_age"])),
        ("by reason", reasons[0]),
        *(("", r) for r in reasons[1:]),
        ("with errors", plural(stats["failing"], "row")),
        ("in flight", plural(stats["inflight"], "row")),
        ("quarantined", plural(stats["quarantined"], "row")),
        ("superseded", plural(stats["superseded"], "row")),
        ("files", f"db {size(stats['db_bytes'])}, WAL {size(stats['wal_bytes'])}"),
    ]
    print("\n".join(f"{k:<12}{v}" for k, v in lines))
    return EXIT_OK


def _when(moment: str | None, age: float | None) -> str:
    return "-" if moment is None or age is None else f"{moment} ({duration(age)} ago)"


def read_stats(conn: apsw.Connection, path: Path, now: float) -> dict[str, Any]:
    """The ``stats --json`` object (see docs/cli.md); ages as of ``now``."""
    with conn:
        by_reason = conn.execute(STATS_BY_REASON_SQL).fetchall()
        sessions = conn.execute(STATS_SESSIONS_SQL).get
        failing = conn.execute(STATS_FAILING_SQL).get
        inflight = conn.execute(INFLIGHT_SQL).get
        by_status = dict(conn.execute(STATUS_COUNT_SQL).fetchall())
    s = stats_from(by_reason, sessions, failing, path)
    return {
        "spool": str(path),
        "rows": s.rows,
        "sessions": s.sessions,
        "bytes": s.bytes,
        "oldest": iso(s.oldest),
        "newest": iso(s.newest),
        "by_reason": dict(sorted(s.by_reason.items())),
        "failing": s.failing,
        "inflight": inflight,
        "db_bytes": s.db_bytes,
        "wal_bytes": s.wal_bytes,
        "quarantined": by_status.get(QUARANTINED, 0),
        "superseded": by_status.get(SUPERSEDED, 0),
        "oldest_age": None if s.oldest is None else max(now - s.oldest, 0.0),
        "newest_age": None if s.newest is None else max(now - s.newest, 0.0),
    }
