"""Replaying: move spooled rows into a sink, in seq order, exactly once across crashes.

A row belongs to a stream: its ``session_id``, or, for a row spooled with only a
routing key, its ``session_key``. Each batch takes three steps:

1. one spool transaction selects the next rows and records the sink's ``mark()``
   in their ``inflight`` column;
2. the sink writes them, one commit each, in seq order, a stream stopping at its
   first failure;
3. one spool transaction deletes the written rows, clears ``inflight`` on the rest
   and records the failure (``attempts``, ``last_error``, ``last_attempt_at``).

A crash between 1 and 3 leaves rows with ``inflight`` set; so does a failed write,
for the row that failed (the rows after it are freed). The next replay first asks
the sink which in-flight rows landed after their recorded mark (``Sink.landed``),
deletes those and writes the rest, with the same mark, before anything else of
their stream. What the probe can and cannot tell apart
is the sink's to document (see ``SessionDBSink``).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import apsw
import msgspec

from .errors import InvalidArgument, NotAMessage, SpoolCorrupt, SpoolIOError, WalspoolError
from .records import AGENT_HISTORY, Record
from .sinks import Sink
from .spool import RECORD_COLUMNS, Spool, check_lookup, reasons_filter, record_from_row

log = logging.getLogger("walspool.replay")

#: Rows per batch: one spool transaction marks them, one settles them.
DEFAULT_BATCH_ROWS = 512
#: Beside the spool; an exclusive ``flock`` on it makes replays take turns.
LOCK_SUFFIX = ".replay-lock"
_MAX_SEQ = 2**63 - 1

#: Which rows a replay takes: the asked-for reasons, or every reason but agent history.
REASON_FILTER = """(CASE WHEN :reasons IS NULL THEN reason != :agent_history
     ELSE reason IN (SELECT value FROM json_each(:reasons)) END)"""
NEXT_BY_ID_SQL = f"""
SELECT {RECORD_COLUMNS} FROM records
WHERE session_id IS NOT NULL AND (session_id, seq) > (:after_name, :after_seq)
  AND inflight IS NULL AND {REASON_FILTER}
ORDER BY session_id, seq LIMIT :limit
"""
NEXT_IN_SESSION_SQL = f"""
SELECT {RECORD_COLUMNS} FROM records
WHERE session_id = :session_id AND seq > :after_seq AND inflight IS NULL AND {REASON_FILTER}
ORDER BY seq LIMIT :limit
"""
NEXT_BY_KEY_SQL = f"""
SELECT {RECORD_COLUMNS} FROM records INDEXED BY records_session_key_seq_idx
WHERE session_id IS NULL AND (session_key, seq) > (:after_name, :after_seq)
  AND inflight IS NULL AND {REASON_FILTER}
ORDER BY session_key, seq LIMIT :limit
"""
INFLIGHT_SQL = f"""
SELECT {RECORD_COLUMNS}, inflight FROM records
WHERE inflight IS NOT NULL AND (:session_id IS NULL OR session_id = :session_id)
"""
SET_INFLIGHT_SQL = "UPDATE records SET inflight = ? WHERE id = ?"
RELEASE_SQL = "UPDATE records SET inflight = NULL WHERE id = ?"
DELETE_SQL = "DELETE FROM records WHERE id = ?"
RECORD_FAILURE_SQL = """
UPDATE records SET attempts = attempts + 1, last_error = ?, last_attempt_at = ? WHERE id = ?
"""
COUNT_HELD_BY_ID_SQL = f"""
SELECT count(*) FROM records
WHERE session_id = :name AND (inflight IS NOT NULL OR {REASON_FILTER})
"""
COUNT_HELD_BY_KEY_SQL = f"""
SELECT count(*) FROM records
WHERE session_id IS NULL AND session_key = :name AND (inflight IS NOT NULL OR {REASON_FILTER})
"""

#: ("session_id" | "session_key", name): the order a row moves in, as in ``sequences``.
Stream = tuple[str, str]
Resolver = Callable[[str], "str | None"]


class StreamReport(msgspec.Struct, frozen=True):
    """What one stream did: rows moved, rows held and why.

    ``session_id`` is where the rows went (for a key stream, what the resolver
    gave; None when it gave nothing); ``session_key`` is set for key streams.
    """

    session_id: str | None
    session_key: str | None
    moved: int
    held: int
    error: str | None = None


class ReplayReport(msgspec.Struct, frozen=True):
    """The outcome of one ``Replayer.replay``.

    ``moved``: rows written to the sink and removed from the spool by this call.
    ``held``: rows left behind in streams that failed (the failing row and the
    later rows of its stream). ``errors``: each held stream's error, keyed by the
    stream's name (its session_id, or its session_key for rows spooled without
    one). ``recovered``: rows a crashed replay had written but not removed, found
    in the sink and removed now (not counted in ``moved``). ``sessions``: per
    stream detail, keyed like ``errors``.
    """

    moved: int
    held: int
    errors: dict[str, str] = msgspec.field(default_factory=dict)
    recovered: int = 0
    sessions: dict[str, StreamReport] = msgspec.field(default_factory=dict)


class Replayer:
    """Moves spooled rows into a ``Sink``, per stream in seq order, exactly once.

    Guarantees:

    * Per stream, rows reach the sink in seq order. A row whose write fails stays
      in the spool with ``attempts`` + 1, ``last_error`` and ``last_attempt_at``,
      and holds back the later rows of its stream only; other streams go on.
    * A row leaves the spool only after the sink's write committed.
    * A crash anywhere (before a write, after a write but before the spool
      delete, during the delete) neither loses nor duplicates a message, within
      what the sink's ``landed`` probe can tell apart: the next replay probes
      the rows left in flight first.
    * Replays of one spool take turns (an ``flock`` on ``<spool>.replay-lock``,
      released by the kernel if the process dies), so two replayers never
      write the same row; appends go on meanwhile, in any process.

    Not guaranteed: order between different streams (rows spooled by
    ``session_key`` are written after those spooled by ``session_id``, whatever
    session the key resolves to); that rows appended during a replay are taken
    by it; that a write which raised did not land (the next replay writes it
    again, so a sink must raise only for writes that did not commit).
    """

    def __init__(
        self,
        spool: Spool,
        sink: Sink,
        *,
        resolver: Resolver | None = None,
        batch_rows: int = DEFAULT_BATCH_ROWS,
        wait_for_bookkeeping: bool = True,
    ) -> None:
        """``wait_for_bookkeeping=False``: when a replay's only spool write is a failed
        row's ``attempts``/``last_error``, it is committed with the writer's next group
        instead of before ``replay`` returns, so a failed attempt costs no fsync of its
        own (the gateway link retries on every message during an outage).
        """
        if batch_rows < 1:
            raise InvalidArgument(f"batch_rows must be positive, not {batch_rows}", path=spool.path)
        self.spool = spool
        self.sink = sink
        self.resolver = resolver
        self.batch_rows = batch_rows
        self.wait_for_bookkeeping = wait_for_bookkeeping

    def replay(
        self,
        session_id: str | None = None,
        reasons: Sequence[str] | None = None,
        limit: int | None = None,
    ) -> ReplayReport:
        """Move rows to the sink; return what moved, what stayed and why.

        ``session_id`` limits the replay to rows spooled with that session id
        (rows spooled by routing key only are then left alone). ``reasons``
        chooses rows by reason; by default every reason except
        ``AGENT_HISTORY``. ``limit`` caps the rows written by this call.

        Blocks while another replay of the same spool runs; call it off the
        event loop. Errors of the spool, and ``sink.mark()`` errors, propagate;
        rows then left in flight are probed by the next replay.
        """
        if limit is not None and limit < 0:
            raise InvalidArgument(f"limit must not be negative, not {limit}", path=self.spool.path)
        reasons_json = reasons_filter(reasons, self.spool.path)
        if session_id is not None:
            check_lookup(session_id, "session_id", self.spool.path)
        run = _Run(self, session_id, reasons_json)
        with _exclusive(Path(f"{self.spool.path}{LOCK_SUFFIX}")):
            run.resume(limit)
            run.move(limit)
        run.count_held()
        report = run.report()
        if report.moved or report.held or report.recovered:
            log.info(
                "replayed %d rows from %s into %r; %d held in %d streams",
                report.moved,
                self.spool.path,
                self.sink,
                report.held,
                len(report.errors),
            )
        return report

    def __repr__(self) -> str:
        return f"Replayer({self.spool!r}, {self.sink!r})"


class _Tally:
    __slots__ = ("session_id", "moved", "held", "error")

    def __init__(self, session_id: str | None) -> None:
        self.session_id = session_id
        self.moved = 0
        self.held = 0
        self.error: str | None = None


class _Settlement:
    """What the spool transaction after a batch has to do."""

    def __init__(self) -> None:
        self.delete: list[int] = []
        self.release: list[int] = []
        self.failures: list[tuple[str, float, int]] = []


class _Run:
    """The state of one ``replay`` call."""

    def __init__(self, replayer: Replayer, session_id: str | None, reasons: str | None) -> None:
        self.spool = replayer.spool
        self.sink = replayer.sink
        self.resolver = replayer.resolver
        self.batch_rows = replayer.batch_rows
        self.wait_for_bookkeeping = replayer.wait_for_bookkeeping
        self.session_id = session_id
        self.filter = {"reasons": reasons, "agent_history": AGENT_HISTORY}
        self.tallies: dict[Stream, _Tally] = {}
        self.targets: dict[Stream, str | None] = {}
        self.recovered = 0
        self.taken = 0
        #: Rows whose payload is not JSON: each fails like a write, holding its stream.
        self.undecodable: dict[int, str] = {}

    # -- rows a replay left in flight ---------------------------------------

    def resume(self, limit: int | None) -> None:
        """Finish rows a replay left in flight: drop what landed, write the rest first.

        Rows stay in flight, with their mark, until they are written or known to have
        landed: a crashed replay's rows, and the row a failed write left behind. So a
        failed write costs no spool transaction, and the next replay probes that row
        before it writes it again.
        """
        # Every reason: a stream's rows in flight are finished before anything later
        # of it moves, whatever this replay selects.
        rows = self.spool._read(INFLIGHT_SQL, {"session_id": self.session_id})
        if not rows:
            return
        pairs = sorted(
            ((self._record(r[:-1]), r[-1]) for r in rows),
            key=lambda p: (_stream(p[0]), p[0].seq),
        )
        done = _Settlement()
        for stream, group in itertools.groupby(pairs, key=lambda p: _stream(p[0])):
            self._resume_stream(stream, list(group), done, limit)
        self._finish(done)

    def _resume_stream(
        self,
        stream: Stream,
        pairs: list[tuple[Record, int]],
        done: _Settlement,
        limit: int | None,
    ) -> None:
        target, error = self._target(stream)
        landed: list[int] = []
        unlanded: list[Record] = []
        if target is not None:
            try:
                for mark, part in itertools.groupby(pairs, key=lambda p: p[1]):
                    records = [rec for rec, _ in part]
                    n = self.sink.landed(target, mark, records)
                    landed += [rec.id for rec in records[:n]]
                    unlanded += records[n:]
            except Exception as exc:  # noqa: BLE001 - the rows stay in flight, reported
                error = f"probe failed: {_describe(exc)}"
        if error is not None:
            # Whether they landed is unknown: they stay in flight, and nothing later
            # in their stream may move before them.
            self._hold(
                stream,
                f"{len(pairs)} rows of an interrupted replay could not be "
                f"checked against the sink: {error}",
            )
            return
        if landed:
            done.delete += landed
            self.recovered += len(landed)
            log.warning(
                "%s: interrupted replay of %s %s recovered: %d of %d in-flight rows had "
                "landed and were removed, the rest will be written again",
                self.spool.path,
                stream[0],
                stream[1],
                len(landed),
                len(pairs),
            )
        if limit is not None:
            # Rows past the limit stay in flight; nothing later of any stream moves
            # in this call, since the limit is then used up.
            unlanded = unlanded[: max(limit - self.taken, 0)]
        self.taken += len(unlanded)
        self._write_stream(stream, unlanded, done)

    # -- moving ----------------------------------------------------------------

    def move(self, limit: int | None) -> None:
        """Write batches of rows, streams spooled by session_id first, then by key."""
        if self.session_id is not None:
            self._move(NEXT_IN_SESSION_SQL, limit)
        else:
            self._move(NEXT_BY_ID_SQL, limit)
            self._move(NEXT_BY_KEY_SQL, limit)

    def _move(self, sql: str, limit: int | None) -> None:
        if self.session_id is not None and self._held(("session_id", self.session_id)):
            return
        after: tuple[str, int] = ("", 0)
        while limit is None or self.taken < limit:
            want = self.batch_rows if limit is None else min(self.batch_rows, limit - self.taken)
            params = {
                **self.filter,
                "session_id": self.session_id,
                "after_name": after[0],
                "after_seq": after[1],
                "limit": want,
            }
            mark = self.sink.mark()
            rows = self.spool._execute(partial(_take_batch, sql=sql, params=params, mark=mark))
            if not rows:
                return
            records = [self._record(row) for row in rows]
            self.taken += len(records)
            done = _Settlement()
            for stream, group in itertools.groupby(records, key=_stream):
                records_of_stream = list(group)
                if self._held(stream):
                    done.release += [rec.id for rec in records_of_stream]
                else:
                    self._write_stream(stream, records_of_stream, done)
            self._finish(done)
            # Resume after the last row taken; past the end of its stream if it is held.
            last, last_stream = records[-1], _stream(records[-1])
            held = self._held(last_stream)
            after = (last_stream[1], _MAX_SEQ if held else last.seq)
            if len(rows) < want:
                return

    def _write_stream(self, stream: Stream, records: list[Record], done: _Settlement) -> None:
        """Write one stream's rows of a batch in order, stopping at the first failure."""
        if not records:
            return
        tally = self._tally(stream)
        target, error = self._target(stream)
        written = 0
        retried = False  # whether the failed row goes to the sink again as it is
        if target is not None:
            for rec in records:
                if rec.id in self.undecodable:
                    error = self.undecodable[rec.id]
                    break
                try:
                    self.sink.write(target, rec)
                except NotAMessage as exc:
                    error = _describe(exc)
                    break
                except Exception as exc:  # noqa: BLE001 - any failure holds the stream
                    error, retried = _describe(exc), True
                    break
                written += 1
        done.delete += [rec.id for rec in records[:written]]
        tally.moved += written
        if error is None:
            return
        # A row whose write failed keeps its in-flight mark, so the next replay
        # retries it (after a probe) without a spool transaction first; a row the sink
        # was never asked to take (unresolvable, not JSON, not a message) is freed, as
        # are the rows after it.
        failed = records[written]
        done.failures.append((error, time.time(), failed.id))
        done.release += [rec.id for rec in records[written + (1 if retried else 0) :]]
        # INFO, not WARNING: during an outage every replay attempt fails the same
        # way; the caller reports held rows at the level it chooses.
        log.info(
            "%s: replay of %s %s held at seq %d: %s",
            self.spool.path,
            stream[0],
            stream[1],
            failed.seq,
            error,
        )
        self._hold(stream, error)

    # -- bookkeeping -----------------------------------------------------------

    def _record(self, row: tuple[Any, ...]) -> Record:
        try:
            return record_from_row(row, self.spool.path)
        except SpoolCorrupt as exc:
            self.undecodable[row[0]] = str(exc)
            return Record(*row[:6], None, *row[7:])

    def _finish(self, done: _Settlement) -> None:
        """Commit a batch's outcome: deletes and releases now, failures as configured."""
        if done.delete or done.release or (done.failures and self.wait_for_bookkeeping):
            self.spool._execute(partial(_settle, done=done))
        elif done.failures:
            self.spool._execute_later(partial(_record_failures, failures=done.failures))

    def count_held(self) -> None:
        """Count the rows each held stream leaves behind (a read, after the writes)."""
        for (kind, name), tally in self.tallies.items():
            if tally.error is not None:
                sql = COUNT_HELD_BY_ID_SQL if kind == "session_id" else COUNT_HELD_BY_KEY_SQL
                tally.held = self.spool._read(sql, {**self.filter, "name": name})[0][0]

    def _hold(self, stream: Stream, error: str) -> None:
        self._tally(stream).error = error

    def _held(self, stream: Stream) -> bool:
        tally = self.tallies.get(stream)
        return tally is not None and tally.error is not None

    def _tally(self, stream: Stream) -> _Tally:
        tally = self.tallies.get(stream)
        if tally is None:
            tally = self.tallies[stream] = _Tally(self._target(stream)[0])
        return tally

    def _target(self, stream: Stream) -> tuple[str | None, str | None]:
        """The session a stream's rows go to, or None and why there is none."""
        kind, name = stream
        if kind == "session_id":
            return name, None
        if stream not in self.targets:
            self.targets[stream] = self._resolve(name)
        target = self.targets[stream]
        if target is not None:
            return target, None
        if self.resolver is None:
            return None, (
                f"rows spooled with session_key {name!r} but no session_id need "
                "a resolver (Replayer(..., resolver=...)) to find their session"
            )
        return None, f"resolver found no session for session_key {name!r}"

    def _resolve(self, session_key: str) -> str | None:
        if self.resolver is None:
            return None
        try:
            return self.resolver(session_key) or None
        except Exception as exc:  # noqa: BLE001 - reported as unresolvable
            log.warning("resolver failed for session_key %r: %s", session_key, exc)
            return None

    def report(self) -> ReplayReport:
        sessions = {
            name: StreamReport(
                session_id=t.session_id,
                session_key=name if kind == "session_key" else None,
                moved=t.moved,
                held=t.held,
                error=t.error,
            )
            for (kind, name), t in self.tallies.items()
        }
        return ReplayReport(
            moved=sum(t.moved for t in self.tallies.values()),
            held=sum(t.held for t in self.tallies.values()),
            errors={name: s.error for name, s in sessions.items() if s.error is not None},
            recovered=self.recovered,
            sessions=sessions,
        )


def _settle(conn: apsw.Connection, done: _Settlement) -> None:
    """Delete written rows, free the rest and record failures, in one transaction."""
    conn.executemany(DELETE_SQL, [(i,) for i in done.delete])
    conn.executemany(RELEASE_SQL, [(i,) for i in done.release])
    _record_failures(conn, done.failures)


def _record_failures(conn: apsw.Connection, failures: list[tuple[str, float, int]]) -> None:
    conn.executemany(RECORD_FAILURE_SQL, failures)


def _take_batch(
    conn: apsw.Connection, sql: str, params: dict[str, Any], mark: int
) -> list[tuple[Any, ...]]:
    """Select the next batch and record the sink's mark on it, in one transaction."""
    rows = conn.execute(sql, params).fetchall()
    conn.executemany(SET_INFLIGHT_SQL, [(mark, row[0]) for row in rows])
    return rows


def _stream(record: Record) -> Stream:
    if record.session_id is not None:
        return ("session_id", record.session_id)
    return ("session_key", record.session_key or "")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, WalspoolError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created 0600) for the block.

    flock locks belong to an open file description, so two replays in one
    process exclude each other too; the kernel drops the lock when the process dies.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise SpoolIOError(
            f"cannot open the replay lock {path} ({exc}); it must be a regular file "
            "beside the spool",
            path=path,
        ) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
