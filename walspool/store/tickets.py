"""The spool's side of a replay: rows taken out with a ticket, and settled.

A replay takes the next rows of a ``Scope`` in one transaction (``take``), stamping each
with a ticket, a number from the spool's ``next_ticket`` counter kept in its
``inflight`` column; the sink records the ticket with the message. One more
transaction then settles the batch (``settle``): deletes the rows written, frees the
others, records failures and quarantines. Rows a crashed replay left in flight are
found again stream by stream (``next_in_flight``, ``in_flight_page``), with their
tickets, so the next replay can ask the sink which of them landed. Why that is exactly
once: ``walspool.replay.replayer``.

Every read is a page (``paging``): at most ``limit`` rows and ``PAGE_BYTES`` of what
they cost, so a batch never holds more than that, however large the rows.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import apsw
import msgspec

from ..errors import SpoolCorrupt
from . import totals
from .paging import ROW_BYTES_SQL, as_text, bound, read_page, record_from_row
from .records import AGENT_HISTORY, Record
from .spool import RECORD_COLUMNS, Spool

#: Which rows a replay takes: the asked-for reasons, or every reason but agent history;
#: replayable rows, and quarantined or superseded ones only when asked for.
REASON_FILTER = """(CASE WHEN :reasons IS NULL THEN reason != :agent_history
     ELSE reason IN (SELECT value FROM json_each(:reasons)) END)
     AND (status IS NULL OR status IN (SELECT value FROM json_each(:statuses)))"""
_NEXT_BY_ID_SQL = f"""
SELECT {RECORD_COLUMNS}, {ROW_BYTES_SQL} FROM records
WHERE session_id IS NOT NULL AND (session_id, seq) > (CAST(:after_name AS TEXT), :after_seq)
  AND inflight IS NULL AND {REASON_FILTER}
ORDER BY session_id, seq LIMIT :limit
"""
_NEXT_IN_SESSION_SQL = f"""
SELECT {RECORD_COLUMNS}, {ROW_BYTES_SQL} FROM records
WHERE session_id = CAST(:session_id AS TEXT) AND seq > :after_seq AND inflight IS NULL
  AND {REASON_FILTER}
ORDER BY seq LIMIT :limit
"""
_NEXT_BY_KEY_SQL = f"""
SELECT {RECORD_COLUMNS}, {ROW_BYTES_SQL} FROM records INDEXED BY records_session_key_seq_idx
WHERE session_id IS NULL AND (session_key, seq) > (CAST(:after_name AS TEXT), :after_seq)
  AND inflight IS NULL AND {REASON_FILTER}
ORDER BY session_key, seq LIMIT :limit
"""
_NEXT_OF_KEY_SQL = f"""
SELECT {RECORD_COLUMNS}, {ROW_BYTES_SQL} FROM records INDEXED BY records_session_key_seq_idx
WHERE session_id IS NULL AND session_key = CAST(:session_key AS TEXT) AND seq > :after_seq
  AND inflight IS NULL AND {REASON_FILTER}
ORDER BY seq LIMIT :limit
"""
#: Rows left in flight, found through their partial index in id order: the next one
#: after ``:after``, for the names of its stream (one row's names, never a page of them).
_NEXT_IN_FLIGHT_SQL = """
SELECT id, CAST(session_id AS BLOB), CAST(session_key AS BLOB)
FROM records INDEXED BY records_inflight_idx
WHERE inflight IS NOT NULL AND id > :after
  AND (:session_id IS NULL OR session_id = CAST(:session_id AS TEXT))
  AND (:session_key IS NULL OR (session_id IS NULL AND session_key = CAST(:session_key AS TEXT)))
ORDER BY id LIMIT 1
"""
# One stream's rows in flight, a page at a time in seq order. The subquery sorts only
# seqs (its rows come through the partial index, so the scan is of the rows in flight,
# not the stream); the outer query reads each row by its unique (stream, seq) index in
# that order, so no sorter ever holds a payload or a name.
_IN_FLIGHT_IN_SESSION_SQL = f"""
SELECT {RECORD_COLUMNS}, inflight, {ROW_BYTES_SQL} FROM records
WHERE session_id = CAST(:name AS TEXT) AND seq IN (
    SELECT seq FROM records INDEXED BY records_inflight_idx
    WHERE inflight IS NOT NULL AND session_id = CAST(:name AS TEXT) AND seq > :after_seq
    ORDER BY seq LIMIT :limit)
ORDER BY seq
"""
_IN_FLIGHT_BY_KEY_SQL = f"""
SELECT {RECORD_COLUMNS}, inflight, {ROW_BYTES_SQL}
FROM records INDEXED BY records_session_key_seq_idx
WHERE session_id IS NULL AND session_key = CAST(:name AS TEXT) AND seq IN (
    SELECT seq FROM records INDEXED BY records_inflight_idx
    WHERE inflight IS NOT NULL AND session_id IS NULL AND session_key = CAST(:name AS TEXT)
      AND seq > :after_seq
    ORDER BY seq LIMIT :limit)
ORDER BY seq
"""
_SET_IN_FLIGHT_SQL = "UPDATE records SET inflight = ? WHERE id = ?"
_NEXT_TICKET_SQL = "SELECT value FROM spool_meta WHERE name = 'next_ticket'"
_SAVE_NEXT_TICKET_SQL = "UPDATE spool_meta SET value = ? WHERE name = 'next_ticket'"
_OLDER_TICKETS_SQL = "SELECT inflight FROM records WHERE inflight IS NOT NULL AND inflight < ?"
_RELEASE_SQL = "UPDATE records SET inflight = NULL WHERE id = ?"
_DELETE_SQL = "DELETE FROM records WHERE id = ?"
_RECORD_FAILURE_SQL = """
UPDATE records SET attempts = attempts + 1, last_error = ?, last_attempt_at = ? WHERE id = ?
"""
_QUARANTINE_SQL = """
UPDATE records SET status = 'quarantined', inflight = NULL, attempts = attempts + 1,
    last_error = ?, last_attempt_at = ?
WHERE id = ?
"""
#: Sets a row aside while a writer that records no ticket writes it: if the process dies
#: before the row is deleted, nobody can know whether it landed, and it stays set aside.
_SET_ASIDE_SQL = """
UPDATE records SET status = 'quarantined', inflight = NULL, last_error = ?,
    last_attempt_at = ?
WHERE id = ?
"""
_PUT_BACK_SQL = "UPDATE records SET status = NULL WHERE id = ? AND status = 'quarantined'"
_COUNT_HELD_BY_ID_SQL = f"""
SELECT count(*) FROM records
WHERE session_id = CAST(:name AS TEXT) AND (inflight IS NOT NULL OR ({REASON_FILTER}))
"""
_COUNT_HELD_BY_KEY_SQL = f"""
SELECT count(*) FROM records
WHERE session_id IS NULL AND session_key = CAST(:name AS TEXT)
  AND (inflight IS NOT NULL OR ({REASON_FILTER}))
"""

#: ("session_id" | "session_key", name): the order a row moves in.
StreamKey = tuple[str, str]
#: A row a replay has out, with its ticket number.
TakenRow = tuple[Record, int]


class Scope(msgspec.Struct, frozen=True):
    """Which rows a replay takes.

    ``reasons``: a JSON array of reasons, None for every reason but agent history;
    ``statuses``: a JSON array of the statuses taken besides replayable rows;
    ``session_id`` or ``session_key``: only that stream's rows (None: every stream).
    """

    reasons: str | None
    statuses: str
    session_id: str | None = None
    session_key: str | None = None

    def params(self) -> dict[str, Any]:
        """The named parameters of ``REASON_FILTER`` and the stream."""
        return {
            "reasons": self.reasons,
            "agent_history": AGENT_HISTORY,
            "statuses": self.statuses,
            "session_id": bound(self.session_id),
            "session_key": bound(self.session_key),
        }


class Batch(msgspec.Struct):
    """Rows out with their tickets, in seq order per stream.

    ``undecodable``: the ids of rows whose payload is not JSON or too costly to decode,
    with why (their ``Record.message`` is None); ``older``: the tickets of rows still in
    flight from before this batch (failed writes), whose records the sink must keep;
    ``full``: more rows may follow.
    """

    taken: list[TakenRow]
    undecodable: dict[int, str]
    older: list[int]
    full: bool


class Settlement:
    """What the spool transaction after a batch does: ids to delete (written) and to
    free (not written), and ``(error, at, id)`` of failures and quarantines."""

    def __init__(self) -> None:
        self.delete: list[int] = []
        self.release: list[int] = []
        self.failures: list[tuple[str, float, int]] = []
        self.quarantine: list[tuple[str, float, int]] = []


def take(spool: Spool, scope: Scope, *, keyed: bool, after: tuple[str, int], limit: int) -> Batch:
    """Take the next rows of ``scope`` out, each with a new ticket, in one transaction.

    Rows spooled with a session id (``keyed=False``) or with only a routing key
    (``keyed=True``; ``scope``'s own stream decides when it names one), in (stream,
    seq) order after ``after`` = (stream name, seq), rows in flight left alone.
    """
    if scope.session_id is not None:
        sql = _NEXT_IN_SESSION_SQL
    elif scope.session_key is not None:
        sql = _NEXT_OF_KEY_SQL
    else:
        sql = _NEXT_BY_KEY_SQL if keyed else _NEXT_BY_ID_SQL
    params = {
        **scope.params(),
        "after_name": bound(after[0]),
        "after_seq": after[1],
        "limit": limit,
    }
    rows, older, full = spool.transact(partial(_take, sql=sql, params=params))
    # Decoded once the transaction is over: the write lock is not held meanwhile.
    batch = _records(rows, spool.path)
    batch.older, batch.full = older, full
    return batch


def next_in_flight(spool: Spool, scope: Scope, after: int) -> tuple[int, StreamKey] | None:
    """The first row in flight of ``scope``'s stream (every stream when it names none)
    after row id ``after``: its id and its stream."""
    found = spool.query(
        _NEXT_IN_FLIGHT_SQL,
        {"after": after, "session_id": scope.session_id, "session_key": scope.session_key},
    )
    if not found:
        return None
    row_id, session_id, session_key = found[0]
    return row_id, stream_of(as_text(session_id), as_text(session_key))


def in_flight_page(spool: Spool, stream: StreamKey, after_seq: int, limit: int) -> Batch:
    """A page of ``stream``'s rows in flight after ``after_seq``, with their tickets."""
    sql = _IN_FLIGHT_IN_SESSION_SQL if stream[0] == "session_id" else _IN_FLIGHT_BY_KEY_SQL
    params = {"name": bound(stream[1]), "after_seq": after_seq, "limit": limit}
    rows, full = spool.read_page(sql, params, limit=limit)
    batch = _records([(row[:-2], row[-2]) for row in rows], spool.path)
    batch.full = full
    return batch


def settle(spool: Spool, done: Settlement, *, wait: bool = True) -> None:
    """Commit a batch's outcome. ``wait=False``: when it is only failures (attempts and
    last errors), they go with the writer's next group instead of a commit of their own."""
    if done.delete or done.release or done.quarantine or (done.failures and wait):
        spool.transact(partial(_settle, done=done))
    elif done.failures:
        spool.transact_later(partial(_record_failures, failures=done.failures))


def set_aside(spool: Spool, record_id: int, why: str, at: float) -> None:
    """Quarantine row ``record_id`` (out of flight) with ``why``, committed at once:
    before a write nobody can look up, so a crash leaves it for an operator."""
    spool.transact(lambda conn: conn.execute(_SET_ASIDE_SQL, (why, at, record_id)))


def put_back(spool: Spool, record_id: int) -> None:
    """Undo ``set_aside``: the write failed, by the writer's own word."""
    spool.transact(lambda conn: conn.execute(_PUT_BACK_SQL, (record_id,)))


def count_held(spool: Spool, scope: Scope, stream: StreamKey) -> int:
    """The rows ``stream`` leaves behind for ``scope``: in flight, or still to move."""
    sql = _COUNT_HELD_BY_ID_SQL if stream[0] == "session_id" else _COUNT_HELD_BY_KEY_SQL
    return spool.query(sql, {**scope.params(), "name": bound(stream[1])})[0][0]


def stream_of(session_id: str | None, session_key: str | None) -> StreamKey:
    """A row's stream: its session id, else its routing key."""
    if session_id is not None:
        return ("session_id", session_id)
    return ("session_key", session_key or "")


def _take(
    conn: apsw.Connection, sql: str, params: dict[str, Any]
) -> tuple[list[tuple[tuple[Any, ...], int]], list[int], bool]:
    """Select the next page and give each row its ticket; also the tickets of rows
    still in flight from before, and whether more rows may follow."""
    page, full = read_page(conn, sql, params, limit=params["limit"])
    rows = [row[:-1] for row in page]
    if not rows:
        return [], [], False
    first = conn.execute(_NEXT_TICKET_SQL).get
    taken = [(row, first + i) for i, row in enumerate(rows)]
    conn.executemany(_SET_IN_FLIGHT_SQL, [(ticket, row[0]) for row, ticket in taken])
    conn.execute(_SAVE_NEXT_TICKET_SQL, (first + len(rows),))
    older = [row[0] for row in conn.execute(_OLDER_TICKETS_SQL, (first,))]
    return taken, older, full


def _records(rows: list[tuple[tuple[Any, ...], int]], path: Path) -> Batch:
    batch = Batch([], {}, [], False)
    for row, ticket in rows:
        try:
            record = record_from_row(row, path)
        except SpoolCorrupt as exc:
            batch.undecodable[row[0]] = str(exc)
            record = Record(*row[:6], None, *row[7:])
        batch.taken.append((record, ticket))
    return batch


def _settle(conn: apsw.Connection, done: Settlement) -> None:
    """Delete written rows, free the rest, record failures and quarantines, in one
    transaction."""
    conn.executemany(_DELETE_SQL, [(i,) for i in done.delete])
    totals.add(conn, totals.DRAINED, len(done.delete))
    conn.executemany(_RELEASE_SQL, [(i,) for i in done.release])
    conn.executemany(_QUARANTINE_SQL, done.quarantine)
    totals.add(conn, totals.QUARANTINED_COUNTER, len(done.quarantine))
    _record_failures(conn, done.failures)


def _record_failures(conn: apsw.Connection, failures: list[tuple[str, float, int]]) -> None:
    conn.executemany(_RECORD_FAILURE_SQL, failures)
