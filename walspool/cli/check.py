"""``walspool check``: the full check of a spool, read-only."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import apsw

from ..errors import SpoolCorrupt, WalspoolError
from ..store import schema, totals
from ..store.paging import LARGE_PAYLOAD, SMALL_PAYLOAD, rows_not_json
from ..store.schema import APPLICATION_ID, SCHEMA_VERSION
from ..text import printable
from ._output import EXIT_ERROR, EXIT_OK, clip, dump, plural, warn
from ._reading import reading


def run(args: argparse.Namespace) -> int:
    """Check a spool in full; exit 1 on any problem.

    PRAGMA integrity_check, application id and schema version, walspool's own schema
    (tables, views, indexes, the triggers that keep each stream's next seq), seq order
    and duplicates, payloads that are not JSON and sizes that are not the payload's, each
    bad row named (id, session, seq). --json prints its object whatever is wrong,
    even when the file is no spool at all. Read-only, like stats, ls, show, export.
    """
    try:
        with reading(args.spool, cheap_check=False) as reader:
            result = reader.read(lambda conn: run_check(conn, args.spool))
    except WalspoolError as exc:
        if not (args.json or isinstance(exc, SpoolCorrupt)):
            raise
        # Not advice to run check itself, which is running.
        text = str(exc).replace(f"; run `walspool check {args.spool}`", "")
        # A schema that is not walspool's: each object named, none of its SQL run.
        problems = getattr(exc, "problems", None) or [text]
        result = check_result(args.spool, None, None, None, problems, [])
    if args.json:
        print(dump(result))
    else:
        print(f"spool          {printable(result['spool'])}")
        print(f"application_id {result['application_id']}")
        print(f"schema version {result['schema_version']}")
        print(f"rows           {'-' if result['rows'] is None else format(result['rows'], ',')}")
        for note in result["notes"]:
            print(f"note: {printable(note)}")
        for problem in result["problems"]:
            print(f"problem: {printable(problem)}")
        print("ok" if result["ok"] else plural(len(result["problems"]), "problem"))
    if not result["ok"]:
        n = plural(len(result["problems"]), "problem")
        warn("check", f"spool {args.spool} has {n}: {clip(result['problems'][0], 200)}")
        return EXIT_ERROR
    return EXIT_OK


#: (what a non-zero count means, SQL counting the offending rows)
NOT_JSON = "rows whose payload is not valid JSON"
_NAMED = "SELECT id, coalesce(session_id, session_key), seq FROM records"
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
    (
        "rows whose size is not their payload's length in bytes",
        "SELECT count(*) FROM records WHERE size != length(CAST(payload AS BLOB))",
    ),
)
#: For the checks about single rows: SQL naming the first of them (id, stream, seq).
NAMED_ROWS_SQL = {
    "rows whose size is not their payload's length in bytes": """SELECT id,
        coalesce(session_id, session_key), seq FROM records
        WHERE size != length(CAST(payload AS BLOB)) ORDER BY id LIMIT :limit""",
}
#: Rows named in one problem at most.
NAMED_ROWS = 20
#: integrity_check lines reported at most.
INTEGRITY_LINES = 100


def run_check(conn: apsw.Connection, path: Path) -> dict[str, Any]:
    """The ``check --json`` object: every problem found, and notes that are not problems."""
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
            listed = ", ".join(f"id {i} (session {name}, seq {seq})" for i, name, seq in named)
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
    for what, sql in BOOKKEEPING_CHECKS:
        check = not_json if sql is None else partial(bookkeeping, what, sql)
        attempt(f"checking for {what}", check)

    def inflight() -> None:
        n = totals.in_flight(conn)
        if n:
            notes.append(
                f"{plural(n, 'row')} in flight: out with a replay or a gateway's drain now, "
                "or left by one that failed or was stopped; each is checked against state.db "
                "before it is written again"
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
