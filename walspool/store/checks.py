"""Checks of a spool file: how every read command tells a damaged spool before any
output, and ``walspool check``'s full check.

``quick_check`` is SQLite's walk of every page with every record decoded, about 1 s per
million rows; ``walk_check`` loads every page of every b-tree without decoding a
record, about a third of that, for ``stats`` and ``ls`` (see ``cli._reading.reading``).
``full_check`` adds SQLite's integrity check, walspool's own schema and the rows'
bookkeeping (seq order, duplicates, payloads, sizes), each bad row named.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import apsw

from . import connections, schema, totals
from .paging import LARGE_PAYLOAD, SMALL_PAYLOAD, as_text, rows_not_json, undecodable
from .reader import SpoolReader
from .schema import APPLICATION_ID, SCHEMA_VERSION

#: Every page of the file walked, each b-tree's structure checked (not each index
#: against its table: that is ``check``'s integrity_check), every record decoded and its
#: columns checked. About 0.6 s per million rows (1 KB each).
QUICK_CHECK_SQL = "PRAGMA quick_check(1)"

#: SQLite checks each b-tree page it loads against the page's own bounds (every cell
#: within the page, none overlapping): https://www.sqlite.org/pragma.html#pragma_cell_size_check
CELL_SIZE_CHECK_SQL = "PRAGMA cell_size_check = ON"
#: ``walk_check``: each b-tree of the spool (by name), every one of its pages loaded.
#: ``count(*)`` without a WHERE clause counts cells page by page (no record decoded);
#: the partial indexes are walked by a cursor. Older schemas' b-trees are not listed:
#: a spool that has one gets ``QUICK_CHECK_SQL`` instead.
WALK_SQL = {
    "records": "SELECT count(*) FROM records NOT INDEXED",
    "sqlite_autoindex_records_1": (
        "SELECT count(*) FROM records INDEXED BY sqlite_autoindex_records_1"
    ),
    "records_reason_created_at_size_session_id_session_key_idx": (
        "SELECT count(*) FROM records "
        "INDEXED BY records_reason_created_at_size_session_id_session_key_idx"
    ),
    "records_inflight_idx": (
        "SELECT count(*) FROM records INDEXED BY records_inflight_idx WHERE inflight IS NOT NULL"
    ),
    "records_last_error_idx": (
        "SELECT count(*) FROM records INDEXED BY records_last_error_idx "
        "WHERE last_error IS NOT NULL"
    ),
    "records_status_idx": (
        "SELECT count(*) FROM records INDEXED BY records_status_idx WHERE status IS NOT NULL"
    ),
    "records_session_key_seq_idx": (
        "SELECT count(*) FROM records INDEXED BY records_session_key_seq_idx "
        "WHERE session_id IS NULL"
    ),
    # Small tables: checked whole, their own b-trees and indexes.
    "sequences": "PRAGMA quick_check(sequences)",
    "spool_meta": "PRAGMA quick_check(spool_meta)",
    "audit": "PRAGMA quick_check(audit)",
}
BTREES_SQL = "SELECT name FROM sqlite_schema WHERE type IN ('table', 'index')"


def quick_check(reader: SpoolReader) -> None:
    """Raise ``apsw.CorruptError`` saying what ``QUICK_CHECK_SQL`` found, unless "ok"."""
    _verdict(reader.read(lambda c: c.execute(QUICK_CHECK_SQL).get))


def _verdict(found: object) -> None:
    if found != "ok":
        lines = str(found).splitlines()
        said = "; ".join(x for x in lines if not x.startswith("*** in database"))
        raise apsw.CorruptError(f"quick_check: {said}")


def walk_check(conn: apsw.Connection) -> None:
    """Load every page of every b-tree of the spool with ``cell_size_check`` on: a page
    whose header, cell pointers or cell sizes do not fit raises ``apsw.CorruptError``.

    About a third of ``QUICK_CHECK_SQL``'s time: no record is decoded. Not checked, as
    ``QUICK_CHECK_SQL`` would: the free-page list, a page used twice or never, and
    each record's header and column types. A spool with a b-tree not in ``WALK_SQL``
    (an older schema) gets ``QUICK_CHECK_SQL``.
    """
    conn.execute(CELL_SIZE_CHECK_SQL)
    names = [name for (name,) in conn.execute(BTREES_SQL)]
    if any(name not in WALK_SQL for name in names):
        _verdict(conn.execute(QUICK_CHECK_SQL).get)
        return
    for sql in dict.fromkeys(WALK_SQL[name] for name in names):
        conn.execute(sql).fetchall()


#: (what a non-zero count means, SQL counting the offending rows)
NOT_JSON = "rows whose payload is not valid JSON"
NOT_UTF8 = "rows whose session id, reason or session key is not UTF-8 text"
#: Every row's names as stored bytes, one row in memory at a time (SQLite cannot tell
#: whether text is UTF-8: Python decodes each).
_TEXTS_SQL = """SELECT id, CAST(coalesce(session_id, session_key) AS BLOB), seq,
    CAST(session_id AS BLOB), CAST(reason AS BLOB), CAST(session_key AS BLOB)
FROM records ORDER BY id"""
_NAMED = "SELECT id, CAST(coalesce(session_id, session_key) AS BLOB), seq FROM records"
NOT_JSON_SMALL_SQL = f"{_NAMED} WHERE {SMALL_PAYLOAD} AND NOT json_valid(payload) ORDER BY id"
NOT_JSON_LARGE_SQL = f"{_NAMED} WHERE {LARGE_PAYLOAD} ORDER BY id"
BOOKKEEPING_CHECKS: tuple[tuple[str, str | None], ...] = (
    (
        "rows that share their stream's seq with another row",
        """SELECT coalesce(sum(n - 1), 0) FROM (SELECT count(*) AS n FROM records NOT INDEXED
            GROUP BY session_id IS NULL, coalesce(session_id, session_key), seq
            HAVING count(*) > 1)""",
    ),
    (
        "rows whose seq is not above the seq of the row before them (by id) in their stream",
        """SELECT count(*) FROM (SELECT seq, lag(seq) OVER (
                PARTITION BY session_id IS NULL, coalesce(session_id, session_key)
                ORDER BY id) AS before FROM records NOT INDEXED)
            WHERE before >= seq""",
    ),
    (NOT_JSON, None),  # paging.rows_not_json: no scan holds large payloads' parses
    (NOT_UTF8, None),  # decoded in Python
    (
        "rows whose size is not their payload's length in bytes",
        "SELECT count(*) FROM records WHERE size != length(CAST(payload AS BLOB))",
    ),
)
#: For the checks about single rows: SQL naming the first of them (id, stream, seq).
NAMED_ROWS_SQL = {
    "rows whose size is not their payload's length in bytes": """SELECT id,
        CAST(coalesce(session_id, session_key) AS BLOB), seq FROM records
        WHERE size != length(CAST(payload AS BLOB)) ORDER BY id LIMIT :limit""",
}
#: Rows named in one problem at most.
NAMED_ROWS = 20
#: integrity_check lines reported at most.
INTEGRITY_LINES = 100


def full_check(
    conn: apsw.Connection,
    path: Path,
    step: Callable[[str, int, int], object] | None = None,
    tick: Callable[[], object] | None = None,
) -> dict[str, Any]:
    """Every problem found in the spool, and notes that are not problems, as the
    ``check --json`` object (see docs/cli.md): ``check_result``'s keys. ``step`` is
    told each step as it begins: what it checks, its number from 1, how many there are;
    ``tick`` is called while a step runs (``connections.ticking``).
    """
    with connections.ticking(conn, tick):
        return _full_check(conn, path, step)


def _full_check(
    conn: apsw.Connection, path: Path, step: Callable[[str, int, int], object] | None
) -> dict[str, Any]:
    # integrity_check, the schema, the count, each bookkeeping check, rows in flight
    total = 3 + len(BOOKKEEPING_CHECKS) + 1
    begun = 0
    problems: list[str] = []
    notes: list[str] = []
    app_id = conn.execute("PRAGMA application_id").get
    version = conn.execute("PRAGMA user_version").get
    if app_id != APPLICATION_ID:
        problems.append(f"application_id is {app_id}, not {APPLICATION_ID} (a walspool spool)")
    if version != SCHEMA_VERSION:
        problems.append(f"schema version is {version}; this walspool reads {SCHEMA_VERSION}")
    rows: int | None = None

    def attempt(what: str, fn: Callable[[], None]) -> None:
        nonlocal begun
        begun += 1
        if step is not None:
            step(what, begun, total)
        try:
            fn()
        except apsw.Error as exc:
            problems.append(f"{what} failed: {exc}")

    def integrity() -> None:
        found = [
            line
            for (text,) in conn.execute(f"PRAGMA integrity_check({INTEGRITY_LINES})")
            for line in str(text).splitlines()
            if line and not line.startswith("*** in database")
        ]
        if found != ["ok"]:
            problems.extend(f"integrity_check: {line}" for line in found)

    def definitions() -> None:
        problems.extend(schema.schema_problems(conn))

    def count() -> None:
        nonlocal rows
        rows = conn.execute("SELECT count(*) FROM records NOT INDEXED").get

    def report(what: str, n: int, named: list[Any]) -> None:
        if named:
            listed = ", ".join(
                f"id {i} (session {as_text(name)}, seq {seq})" for i, name, seq in named
            )
            more = f" and {n - len(named)} more" if n > len(named) else ""
            problems.append(f"{n} {what}: {listed}{more}")
        elif n:
            problems.append(f"{n} {what}")

    def bookkeeping(what: str, sql: str) -> None:
        n = conn.execute(sql).get
        named = []
        if n and what in NAMED_ROWS_SQL:
            named = conn.execute(NAMED_ROWS_SQL[what], {"limit": NAMED_ROWS}).fetchall()
        report(what, n, named)

    def not_json() -> None:
        n, named = 0, []
        for row in rows_not_json(conn, NOT_JSON_SMALL_SQL, NOT_JSON_LARGE_SQL, ()):
            n += 1
            if len(named) < NAMED_ROWS:
                named.append(row)
        report(NOT_JSON, n, named)

    attempt("PRAGMA integrity_check", integrity)
    if problems and "failed" in problems[-1]:
        # SQLite could not even walk the file: every later query fails the same way.
        return check_result(path, app_id, version, None, problems, notes)
    attempt("reading the schema", definitions)
    attempt("counting rows", count)

    def not_utf8() -> None:
        n, named = 0, []
        for row_id, name, seq, *texts in conn.execute(_TEXTS_SQL):
            if any(undecodable(as_text(text)) for text in texts):
                n += 1
                if len(named) < NAMED_ROWS:
                    named.append((row_id, name, seq))
        report(NOT_UTF8, n, named)

    scans = {NOT_JSON: not_json, NOT_UTF8: not_utf8}
    for what, sql in BOOKKEEPING_CHECKS:
        check = scans[what] if sql is None else partial(bookkeeping, what, sql)
        attempt(f"checking for {what}", check)

    def inflight() -> None:
        n = totals.in_flight_rows(conn)
        if n:
            notes.append(
                f"{n:,} row{'' if n == 1 else 's'} in flight: out with a replay or a "
                "gateway's drain now, or left by one that failed or was stopped; each is "
                "checked against state.db before it is written again"
            )

    attempt("counting rows in flight", inflight)
    return check_result(path, app_id, version, rows, problems, notes)


def check_result(
    path: Path,
    app_id: int | None,
    version: int | None,
    rows: int | None,
    problems: list[str],
    notes: list[str],
) -> dict[str, Any]:
    return {
        "spool": str(path),
        "ok": not problems,
        "application_id": app_id,
        "schema_version": version,
        "rows": rows,
        "problems": problems,
        "notes": notes,
    }
