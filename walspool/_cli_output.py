"""Helpers of the ``walspool`` command line: read-only spool queries, the state.db
checks of a replay, output formatting and the progress bar. Not public API.

Every spool connection made here is apsw and read-only (``mode=ro``); the stdlib
``sqlite3`` module only ever opens ``state.db``.
"""

from __future__ import annotations

import contextlib
import datetime
import sqlite3
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import quote

import apsw
import msgspec

from . import codec, files, schema
from .errors import NotASpool, SpoolCorrupt, WalspoolError
from .files import SQLITE_MAGIC
from .records import AGENT_HISTORY, QUARANTINED, SUPERSEDED, Record
from .replay import REASON_FILTER, ReplayReport, StreamReport
from .schema import (
    APPLICATION_ID,
    SCHEMA_VERSION,
    open_reader,
    sqlite_error,
)
from .sinks import SessionMissing, Sink, Ticket
from .spool import (
    PAGE_ROWS,
    RECORD_COLUMNS,
    STATS_BY_REASON_SQL,
    STATS_FAILING_SQL,
    STATS_SESSIONS_SQL,
    check_lookup,
    read_page,
    reasons_filter,
    record_from_row,
    stats_from,
)
from .text import printable

#: Seconds a replay waits for the gateway to release state.db's write lock.
STATE_DB_WAIT_SECONDS = 5.0
#: Redraw the progress bar at most this often, in seconds.
PROGRESS_INTERVAL = 0.1


class StateDBError(WalspoolError):
    """state.db is missing, locked, unreadable or not a hermes state.db."""


# -- opening the spool read-only ---------------------------------------------------


@contextlib.contextmanager
def reading(path: Path, *, cheap_check: bool = True) -> Iterator[apsw.Connection]:
    """The spool opened read-only; SQLite failures become one-line walspool errors.

    ``cheap_check`` touches the schema and each table's root (constant time), so a
    damaged spool is reported as such before any output.
    """
    if not path.exists() and not path.is_symlink():
        raise WalspoolError(
            f"no spool at {path} (no such file); give the path of a spool "
            "(the gateway's is <HERMES_HOME>/spool.db)",
            path=path,
        )
    try:
        head = files.read_head(path)
        if head != SQLITE_MAGIC:
            what = "an empty file" if not head else "not a SQLite database"
            raise NotASpool(f"{path} is {what}, so not a walspool spool", path=path)
        conn = open_reader(path)
    except OSError as exc:
        raise WalspoolError(f"cannot read {path}: {exc.strerror or exc}", path=path) from exc
    except SpoolCorrupt as exc:
        if isinstance(exc.__cause__, apsw.Error):
            raise spool_error(exc.__cause__, path) from exc.__cause__
        raise
    try:
        if cheap_check:
            schema.cheap_check(conn)
        yield conn
    except apsw.Error as exc:
        raise spool_error(exc, path) from exc
    finally:
        conn.close()


def spool_error(exc: apsw.Error, path: Path) -> WalspoolError:
    """A damaged spool gets a message saying so; other errors as the engine maps them."""
    if isinstance(exc, (apsw.CorruptError, apsw.NotADBError)):
        return SpoolCorrupt(
            f"spool {path} is damaged ({exc}); run `walspool check {path}` and keep a copy "
            "of the file before any repair",
            path=path,
        )
    return sqlite_error(exc, path)


# -- stats, ls, show, export -------------------------------------------------------

INFLIGHT_SQL = "SELECT count(*) FROM records WHERE inflight IS NOT NULL"
STATUS_COUNT_SQL = "SELECT status, count(*) FROM records WHERE status IS NOT NULL GROUP BY status"
BACKLOG_SQL = """
SELECT session_id, session_key, rows, bytes, oldest, newest, max_attempts, last_error,
       quarantined, superseded
FROM backlog ORDER BY oldest, session_id, session_key
"""
BACKLOG_KEYS = (
    "session_id",
    "session_key",
    "rows",
    "bytes",
    "oldest",
    "newest",
    "max_attempts",
    "last_error",
    "quarantined",
    "superseded",
)
_ROW = f"SELECT {RECORD_COLUMNS}, inflight, size FROM records"
_BY_REASON = "(:reasons IS NULL OR reason IN (SELECT value FROM json_each(:reasons)))"
#: Keyset pages: streams spooled by session_id, then those spooled by key only,
#: each in seq order; or one name's two streams. One short read per page.
PAGES_SQL = {
    (False, "id"): f"""{_ROW} WHERE session_id IS NOT NULL
        AND (session_id, seq) > (:name, :seq) AND {_BY_REASON}
        ORDER BY session_id, seq LIMIT :limit""",
    (False, "key"): f"""{_ROW} INDEXED BY records_session_key_seq_idx WHERE session_id IS NULL
        AND (session_key, seq) > (:name, :seq) AND {_BY_REASON}
        ORDER BY session_key, seq LIMIT :limit""",
    (True, "id"): f"""{_ROW} WHERE session_id = :session AND seq > :seq AND {_BY_REASON}
        ORDER BY seq LIMIT :limit""",
    (True, "key"): f"""{_ROW} INDEXED BY records_session_key_seq_idx WHERE session_id IS NULL
        AND session_key = :session AND seq > :seq AND {_BY_REASON}
        ORDER BY seq LIMIT :limit""",
}
COUNT_SQL = f"""SELECT count(*) FROM records WHERE {_BY_REASON}
    AND (:session IS NULL OR session_id = :session
         OR (session_id IS NULL AND session_key = :session))"""


def read_stats(conn: apsw.Connection, path: Path) -> dict[str, Any]:
    """The ``stats --json`` object (see README, "Command line")."""
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
    }


def read_backlog(conn: apsw.Connection) -> list[dict[str, Any]]:
    """The ``backlog`` view, one object per stream, oldest first."""
    return [dict(zip(BACKLOG_KEYS, row, strict=True)) for row in conn.execute(BACKLOG_SQL)]


class BadPayload:
    """In place of a message whose stored payload is not JSON: its raw text, flagged."""

    __slots__ = ("raw", "error")

    def __init__(self, raw: Any, error: str) -> None:
        self.raw = raw if isinstance(raw, str) else repr(raw)
        self.error = error


def iter_records(
    conn: apsw.Connection,
    session: str | None = None,
    reasons: Sequence[str] | None = None,
    bad: list[str] | None = None,
) -> Iterator[tuple[Record, int | None]]:
    """Yield ``(record, inflight)`` in drop order, a page per read transaction.

    ``session`` selects the rows spooled with that session_id and then those spooled
    with that session_key but no session_id. Rows appended meanwhile may or may not
    be seen; none is seen twice. A row whose payload is not JSON is yielded all the
    same, its message a ``BadPayload``, and named in ``bad``.
    """
    path = Path(conn.filename)
    if session is not None:
        check_lookup(session, "session", path)
    params: dict[str, Any] = {
        "reasons": reasons_filter(reasons, path),
        "session": session,
        "limit": PAGE_ROWS,
    }
    for kind in ("id", "key"):
        sql = PAGES_SQL[(session is not None, kind)]
        name, seq = "", 0
        while True:
            rows, full = read_page(conn, sql, {**params, "name": name, "seq": seq})
            for row in rows:
                yield _record_or_flagged(row[:-2], path, bad), row[-2]
            if not full:
                break
            last = rows[-1]
            name, seq = (last[1] if kind == "id" else last[4]), last[2]


def _record_or_flagged(row: tuple[Any, ...], path: Path, bad: list[str] | None) -> Record:
    try:
        return record_from_row(row, path)
    except SpoolCorrupt as exc:
        row_id, session_id, seq = row[0], row[1] if row[1] is not None else row[4], row[2]
        if bad is not None:
            bad.append(f"id {row_id} (session {session_id}, seq {seq})")
        return Record(*row[:6], BadPayload(row[6], str(exc.__cause__ or exc)), *row[7:])


def count_records(conn: apsw.Connection, session: str | None, reasons: Sequence[str] | None) -> int:
    """How many rows ``iter_records`` would yield now (for the progress bar)."""
    if session is not None:
        check_lookup(session, "session", Path(conn.filename))
    reasons_json = reasons_filter(reasons, Path(conn.filename))
    return int(conn.execute(COUNT_SQL, {"reasons": reasons_json, "session": session}).get)


def record_json(record: Record, inflight: int | None, *, message: bool = True) -> dict[str, Any]:
    """One record as an ``export`` line / ``show --json`` row (see README)."""
    out: dict[str, Any] = {
        "id": record.id,
        "session_id": record.session_id,
        "session_key": record.session_key,
        "seq": record.seq,
        "reason": record.reason,
        "created_at": record.created_at,
        "attempts": record.attempts,
        "last_error": record.last_error,
        "last_attempt_at": record.last_attempt_at,
        "inflight": inflight is not None,
        "status": record.status,
    }
    if isinstance(record.message, BadPayload):
        out["bad_payload"] = {"raw": record.message.raw, "error": record.message.error}
        if message:
            out["message"] = None
    elif message:
        out["message"] = record.message
    return out


def preview(message: Any, width: int = 60) -> str:
    """A one-line glimpse of a message: its role and the start of its text."""
    if isinstance(message, BadPayload):
        text = f"[NOT JSON] {message.raw}"
    elif isinstance(message, dict):
        text = message.get("content", message.get("text"))
        if not isinstance(text, str):
            text = codec.encode(message).decode("utf-8") if text is None else _json(text)
        role = message.get("role")
        text = f"{role}: {text}" if isinstance(role, str) else text
    elif isinstance(message, str):
        text = message
    else:
        text = _json(message)
    text = printable(" ".join(text.split()))
    return text if len(text) <= width else text[: width - 1] + "…"


def _json(value: Any) -> str:
    return codec.encode(value).decode("utf-8")


# -- check ---------------------------------------------------------------------------

_STREAM = "CASE WHEN r.session_id IS NULL THEN 'session_key' ELSE 'session_id' END"
_NAME = "coalesce(r.session_id, r.session_key)"
#: (what a non-zero count means, SQL counting the offending rows)
BOOKKEEPING_CHECKS = (
    (
        "rows whose stream has no row in `sequences`",
        f"""SELECT count(*) FROM records AS r WHERE NOT EXISTS (SELECT 1 FROM sequences AS s
            WHERE s.stream = {_STREAM} AND s.name = {_NAME})""",
    ),
    (
        "rows whose seq is not below their stream's next_seq in `sequences`",
        f"""SELECT count(*) FROM records AS r JOIN sequences AS s
            ON s.stream = {_STREAM} AND s.name = {_NAME} WHERE r.seq >= s.next_seq""",
    ),
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
    (
        "rows whose payload is not valid JSON",
        "SELECT count(*) FROM records WHERE NOT json_valid(payload)",
    ),
)
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

    def bookkeeping(what: str, sql: str) -> None:
        n = conn.execute(sql).get
        if n:
            problems.append(f"{n} {what}")

    attempt("PRAGMA integrity_check", integrity)
    if problems and "failed" in problems[-1]:
        # SQLite could not even walk the file: every later query fails the same way.
        return check_result(path, app_id, version, None, problems, notes)
    attempt("reading the schema", definitions)
    attempt("counting rows", count)
    for what, sql in BOOKKEEPING_CHECKS:
        attempt(f"checking for {what}", lambda w=what, s=sql: bookkeeping(w, s))

    def inflight() -> None:
        n = conn.execute(INFLIGHT_SQL).get
        if n:
            notes.append(
                f"{plural(n, 'row')} in flight: out with a running replay, or left by an "
                "interrupted or failed one; the next replay checks them against state.db first"
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


# -- state.db ------------------------------------------------------------------------


def open_state_db(path: Path, *, write: bool, wait: float | None = None) -> sqlite3.Connection:
    """Open the gateway's state.db with the stdlib, checked; never creates it.

    With ``write``, take and release its write lock (``BEGIN IMMEDIATE``, waiting
    up to ``wait`` seconds), so a gateway holding it is reported before the replay
    starts rather than as one held session after another.
    """
    wait = STATE_DB_WAIT_SECONDS if wait is None else wait
    if not path.exists():
        raise StateDBError(
            f"no state.db at {path} (no such file); give the gateway's state.db "
            "(<HERMES_HOME>/state.db); walspool does not create one",
            path=path,
        )
    if not path.is_file():
        raise StateDBError(f"{path} is not a file; give the gateway's state.db", path=path)
    try:
        head = files.read_head(path)
    except (OSError, NotASpool) as exc:
        raise StateDBError(
            f"cannot read state.db at {path}: {exc.strerror or exc}; check its permissions",
            path=path,
        ) from exc
    if head != SQLITE_MAGIC:
        raise StateDBError(f"{path} is not a SQLite database, so not a hermes state.db", path=path)
    mode = "rw" if write else "ro"
    conn: sqlite3.Connection | None = None
    try:
        conn = sqlite3.connect(
            f"file:{quote(str(path.absolute()))}?mode={mode}",
            uri=True,
            timeout=wait,
            isolation_level=None,
        )
        tables = {
            r[0]
            for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' "
                "AND name IN ('sessions', 'messages')"
            )
        }
        if tables != {"sessions", "messages"}:
            raise StateDBError(
                f"{path} is a SQLite database but not a hermes state.db "
                "(it has no sessions and messages tables)",
                path=path,
            )
        if write:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
    except BaseException as exc:
        if conn is not None:
            conn.close()
        if isinstance(exc, sqlite3.Error):
            raise StateDBError(state_db_message(exc, path), path=path) from exc
        raise
    return conn


def state_db_message(exc: sqlite3.Error, path: Path) -> str:
    """One line saying what is wrong with state.db, for any stdlib sqlite3 error."""
    text = str(exc)
    low = text.lower()
    if "locked" in low or "busy" in low:
        return (
            f"state.db at {path} is locked by another process ({text}); wait for the "
            "gateway to finish writing, or stop it, and run the replay again"
        )
    if "unable to open" in low or "readonly" in low or "read-only" in low:
        return (
            f"cannot open state.db at {path} for writing ({text}); check the permissions "
            "of the file and its directory, or run as the gateway's user"
        )
    if "not a database" in low or "malformed" in low or "corrupt" in low:
        return f"state.db at {path} is damaged ({text}); repair it before replaying into it"
    return f"state.db at {path}: {type(exc).__name__}: {text}"


def session_exists(conn: sqlite3.Connection, session_id: str) -> bool:
    """Whether state.db has a ``sessions`` row for ``session_id``."""
    return conn.execute("SELECT 1 FROM sessions WHERE id = ?", (session_id,)).fetchone() is not None


STREAMS_SQL = f"""
SELECT session_id, CASE WHEN session_id IS NULL THEN session_key END, count(*) FROM records
WHERE {REASON_FILTER} AND (:session IS NULL OR session_id = :session)
GROUP BY 1, 2 ORDER BY 1, 2
"""


def replay_streams(
    conn: apsw.Connection, session: str | None, reasons: Sequence[str] | None, statuses: str
) -> list[tuple[str | None, str | None, int]]:
    """``(session_id, session_key, rows)`` of each stream a replay would take."""
    reasons_json = None if reasons is None else codec.encode(list(reasons)).decode()
    params = {
        "reasons": reasons_json,
        "agent_history": AGENT_HISTORY,
        "session": session,
        "statuses": statuses,
    }
    return conn.execute(STREAMS_SQL, params).fetchall()


def dry_run_report(
    streams: list[tuple[str | None, str | None, int]],
    state: sqlite3.Connection,
    create_missing: bool,
) -> ReplayReport:
    """What a replay would do, judged by which sessions exist in state.db."""
    sessions: dict[str, StreamReport] = {}
    for session_id, session_key, rows in streams:
        if session_id is None:
            error: str | None = (
                f"rows spooled with session_key {session_key!r} but no session_id need a "
                "resolver to find their session; the gateway's link replays them"
            )
        elif create_missing or session_exists(state, session_id):
            error = None
        else:
            error = str(SessionMissing(session_id))
        moved, held = (0, rows) if error else (rows, 0)
        name = session_id if session_id is not None else str(session_key)
        sessions[name] = StreamReport(session_id, session_key, moved, held, error)
    return ReplayReport(
        moved=sum(s.moved for s in sessions.values()),
        held=sum(s.held for s in sessions.values()),
        errors={n: s.error for n, s in sessions.items() if s.error is not None},
        sessions=sessions,
    )


class ProgressSink:
    """A sink that counts successful writes for the progress bar; otherwise the sink."""

    def __init__(self, sink: Sink, progress: Progress, total: int) -> None:
        self.sink = sink
        self.progress = progress
        self.total = total
        self.done = 0

    def write(self, session_id: str, record: Record, ticket: Ticket) -> None:
        self.sink.write(session_id, record, ticket)
        self.done += 1
        self.progress(self.done, self.total)

    def landed(self, tickets: Sequence[Ticket]) -> Collection[Ticket] | None:
        return self.sink.landed(tickets)

    def forget(self, spool: str, below: int, keep: Sequence[int]) -> None:
        forget = getattr(self.sink, "forget", None)
        if forget is not None:
            forget(spool, below, keep)

    def __repr__(self) -> str:
        return repr(self.sink)


# -- formatting ----------------------------------------------------------------------


def iso(ts: float | None) -> str | None:
    """Epoch seconds as ISO 8601 UTC with milliseconds, as the views print them."""
    if ts is None:
        return None
    moment = datetime.datetime.fromtimestamp(ts, datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def size(n: int) -> str:
    """Bytes for people: 512 B, 4.0 KiB, 1.2 MiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned columns, two spaces apart; None prints as "-"."""
    cells = [[str(h) for h in headers]] + [
        ["-" if c is None else f"{c:,}" if isinstance(c, int) else printable(c) for c in row]
        for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells
    )


def plural(n: int, word: str) -> str:
    """``1 row``, ``2 rows``, with thousands separators."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def clip(text: str | None, width: int = 80) -> str | None:
    """One line of at most ``width`` characters."""
    if text is None:
        return None
    text = printable(" ".join(text.split()))
    return text if len(text) <= width else text[: width - 1] + "…"


def dump(value: Any) -> str:
    """Compact JSON text of a value (the ``--json`` outputs)."""
    return msgspec.json.encode(value).decode("utf-8")


def pretty(value: Any) -> str:
    """Indented JSON text of a value (``show --full``), controls JSON leaves raw
    (DEL, C1, bidi) escaped too; a payload that is not JSON, flagged, as stored."""
    if isinstance(value, BadPayload):
        return f"[NOT JSON: {printable(value.error)}]\n{printable(value.raw)}"
    return printable_lines(msgspec.json.format(dump(value), indent=2))


def printable_lines(text: str) -> str:
    """Text of several lines, each made ``printable``."""
    return "\n".join(printable(line) for line in text.split("\n"))


class Progress:
    """A one-line progress bar (``label: done/total (pct%)``) redrawn with ``\\r``.

    Draws only when ``stream`` is a terminal, at most every ``PROGRESS_INTERVAL``
    seconds; ``close`` draws the final count and ends the line.
    """

    def __init__(self, label: str, stream: TextIO) -> None:
        self.label = label
        self.stream = stream
        self.enabled = _isatty(stream)
        self.drawn = False
        self.last = 0.0
        self.state = (0, 0)

    def __call__(self, done: int, total: int) -> None:
        self.state = (done, total)
        now = time.monotonic()
        if self.enabled and now - self.last >= PROGRESS_INTERVAL:
            self.last = now
            self._draw()

    def _draw(self) -> None:
        done, total = self.state
        pct = f" ({100 * done // total}%)" if total else ""
        self.stream.write(f"\r{self.label}: {done:,}/{total:,}{pct}")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.enabled:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False
