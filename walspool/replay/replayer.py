"""Replaying: move spooled rows into a sink, in seq order, exactly once across crashes.

A row belongs to a stream: its ``session_id``, or, for a row spooled with only a
routing key, its ``session_key``. Each batch takes three steps:

1. one spool transaction selects the next rows and stamps each with a ticket, the
   pair (the spool's random ``uid``, a number from the spool's ``next_ticket``
   counter), kept in its ``inflight`` column;
2. the sink writes them, one commit each, in seq order, a stream stopping at its
   first failure. The sink records the ticket in the same transaction as the
   message (``SessionDBSink``: a marker row in state.db);
3. one spool transaction deletes the written rows and records failures.

Why this is exactly once. A ticket is never given to two rows: the uid tells spools
apart and the counter only grows, in the same transaction that stamps the rows.
The sink's marker commits if and only if the message does. So after a crash between
1 and 3, "did this row land?" is a lookup of its ticket (``Sink.landed``), not a
comparison with look-alike rows: the next replay deletes the rows whose ticket is
found and writes the others, with the same ticket, before anything later of their
stream. A write that raised keeps its row in flight too (unless the sink, asked at
once, finds its ticket: then it landed after all), so its retry is probed first.

A sink that cannot look tickets up (``landed`` returns None) trusts its own raise:
a failed row is freed at once; a row left in flight by a crash, whose fate nobody
can know, is quarantined (kept, flagged for an operator), never guessed. Such a sink
is handed one row per batch, so that row is the only one a crash leaves in doubt.

A row the sink refuses for its content (``rejects_content``), a payload that is not
JSON or is too costly to decode (nested deeper than ``codec.MAX_DEPTH``, more than
``codec.MAX_VALUES`` values) and a whole agent history are quarantined: kept with
their error, visible to operators, replayed only when asked for
(``quarantined=True``), and their stream goes on. Any other failure (locked, I/O,
missing session) holds the stream: order over progress.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import cast

import msgspec

from .. import text
from ..errors import (
    InvalidArgument,
    WalspoolError,
)
from ..store import tickets
from ..store.records import QUARANTINED, SUPERSEDED, Record
from ..store.replay_lock import replay_lock
from ..store.spool import Spool, check_lookup, reasons_filter
from ..store.tickets import Scope, Settlement, StreamKey, TakenRow, stream_of
from .sinks import ForgetsTickets, Sink, Ticket, WritesMany, rejects_content

log = text.logger("walspool.replay")

#: Rows per batch: one spool transaction marks them, one settles them.
DEFAULT_BATCH_ROWS = 512
_MAX_SEQ = 2**63 - 1

#: Why a row left in flight is quarantined when the sink cannot look tickets up.
UNKNOWN_LANDING = (
    "a replay was interrupted with this row out, and the sink cannot tell whether it "
    "landed; check the target, then replay it with --quarantined if it is missing"
)
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
    quarantined: int = 0


class ReplayReport(msgspec.Struct, frozen=True):
    """The outcome of one ``Replayer.replay``.

    ``moved``: rows written to the sink and removed from the spool by this call.
    ``held``: rows left behind in streams that failed (the failing row and the
    later rows of its stream). ``sessions``: per stream detail of the rows spooled
    with a session id, keyed by it; ``errors``: each of those streams' error when it
    was held. ``keys`` and ``key_errors``: the same for rows spooled with only a
    session key, keyed by the key, kept apart, so a session id equal to some key
    never merges the two. ``recovered``: rows a crashed replay had written but not
    removed, found in the sink and removed now (not counted in ``moved``).
    ``quarantined``: rows this call set aside (content the sink refused, or a
    landing nobody can know), with their error in the spool; their streams went on.
    """

    moved: int
    held: int
    errors: dict[str, str] = msgspec.field(default_factory=dict)
    recovered: int = 0
    sessions: dict[str, StreamReport] = msgspec.field(default_factory=dict)
    quarantined: int = 0
    keys: dict[str, StreamReport] = msgspec.field(default_factory=dict)
    key_errors: dict[str, str] = msgspec.field(default_factory=dict)

    def streams(self) -> list[StreamReport]:
        """Every stream's report: session ids first, then keys."""
        return [*self.sessions.values(), *self.keys.values()]


class Replayer:
    """Moves spooled rows into a ``Sink``, per stream in seq order, exactly once.

    Guarantees:

    * Per stream, rows reach the sink in seq order. A row whose write fails for the
      database's state stays in the spool with ``attempts`` + 1, ``last_error`` and
      ``last_attempt_at``, and holds back the later rows of its stream only; other
      streams go on. A row the sink refuses for its content is quarantined and its
      stream goes on.
    * A row leaves the spool only after the sink's write committed, as the sink's
      ticket lookup shows.
    * A crash anywhere (before a write, after a write but before the spool delete,
      during the delete) neither loses nor duplicates a message: the next replay
      looks up the tickets of the rows left in flight first (see the module
      docstring).
    * Replays of one spool take turns (an ``flock`` on ``<spool>.replay-lock``,
      released by the kernel if the process dies), so two replayers never write
      the same row; appends go on meanwhile, in any process.

    Not guaranteed: order between different streams (rows spooled by
    ``session_key`` are written after those spooled by ``session_id``, whatever
    session the key resolves to); that rows appended during a replay are taken by
    it; exactness for a copy of a spool (a copy keeps the spool's uid: replay only
    one of the two) or for a target whose ticket records were deleted by hand.
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
        own (the gateway link retries while state.db is down).
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
        *,
        quarantined: bool = False,
        superseded: bool = False,
        wait: bool | float = True,
        session_key: str | None = None,
    ) -> ReplayReport:
        """Move rows to the sink; return what moved, what stayed and why.

        ``session_id`` limits the replay to rows spooled with that session id
        (rows spooled by routing key only are then left alone); ``session_key``
        to the rows spooled by that routing key alone (not with ``session_id``). ``reasons``
        chooses rows by reason; by default every reason except
        ``AGENT_HISTORY``. ``quarantined`` and ``superseded`` also take rows of
        that status (an operator fixed the cause, or wants a rewritten session's
        old rows after all), in seq order with the rest. ``limit`` caps the rows
        written by this call.

        Waits while another replay of the same spool runs: at most ``REPLAY_WAIT``
        seconds (``wait=True``), ``wait`` seconds (a number), or not at all
        (``wait=False``), then raises ``ReplayBusy``; call it off the event loop.
        Errors of the spool propagate; rows then left in flight are looked up by
        the next replay.
        """
        if limit is not None and limit < 0:
            raise InvalidArgument(f"limit must not be negative, not {limit}", path=self.spool.path)
        reasons_json = reasons_filter(reasons, self.spool.path)
        if session_id is not None:
            check_lookup(session_id, "session_id", self.spool.path)
        if session_key is not None:
            if session_id is not None:
                raise InvalidArgument(
                    "replay takes a session_id or a session_key, not both", path=self.spool.path
                )
            check_lookup(session_key, "session_key", self.spool.path)
        statuses = statuses_filter(quarantined, superseded)
        run = _Run(self, session_id, reasons_json, statuses, session_key)
        with replay_lock(self.spool, wait):
            run.resume(limit)
            run.move(limit)
        run.count_held()
        report = run.report()
        if report.moved or report.held or report.recovered or report.quarantined:
            log.info(
                "replayed %d rows from %s into %s; %d held in %d streams, %d quarantined",
                report.moved,
                self.spool.path,
                str(self.sink),  # formatted here: the log filter turns arguments into text
                report.held,
                len(report.errors) + len(report.key_errors),
                report.quarantined,
            )
        return report

    def __repr__(self) -> str:
        return f"Replayer({self.spool!r}, {self.sink!r})"


class _StreamOutcome:
    __slots__ = ("session_id", "moved", "held", "error", "quarantined")

    def __init__(self, session_id: str | None) -> None:
        self.session_id = session_id
        self.moved = 0
        self.held = 0
        self.error: str | None = None
        self.quarantined = 0


class _Run:
    """The state of one ``replay`` call."""

    def __init__(
        self,
        replayer: Replayer,
        session_id: str | None,
        reasons: str | None,
        statuses: str,
        session_key: str | None = None,
    ) -> None:
        self.spool = replayer.spool
        self.sink = replayer.sink
        self.resolver = replayer.resolver
        self.batch_rows = replayer.batch_rows
        self.wait_for_bookkeeping = replayer.wait_for_bookkeeping
        self.session_id = session_id
        #: Only the rows spooled by this routing key (``replay(session_key=...)``).
        self.session_key = session_key
        self.scope = Scope(reasons, statuses, session_id, session_key)
        self.uid = self.spool.uid
        self.tallies: dict[StreamKey, _StreamOutcome] = {}
        self.targets: dict[StreamKey, str | None] = {}
        self.recovered = 0
        self.taken = 0
        #: Rows whose payload is not JSON: each is quarantined when its turn comes.
        self.undecodable: dict[int, str] = {}
        #: Failed rows of a sink that cannot look tickets up: freed, not left in flight.
        self._untracked: list[int] = []

    # -- rows a replay left in flight ---------------------------------------

    def resume(self, limit: int | None) -> None:
        """Finish rows a replay left in flight: drop what landed, write the rest first.

        Rows stay in flight, with their ticket, until they are written or known to
        have landed: a crashed replay's rows, and a row whose write failed. So a
        failed write costs no spool transaction, and the next replay looks its
        ticket up before it writes it again.

        StreamKey by stream, each a page at a time (``paging``: at most ``batch_rows``
        rows and ``PAGE_BYTES`` of what they cost), every page settled before the
        next is read, so memory holds one page, however many rows are in flight.
        """
        # Every reason and status: a stream's rows in flight are finished before
        # anything later of it moves, whatever this replay selects.
        after = 0
        while limit is None or self.taken < limit:
            found = tickets.next_in_flight(self.spool, self.scope, after)
            if found is None:
                return
            after, stream = found
            # A stream met again still has rows in flight only when it is held (the
            # rest of it waits for the next replay, which looks them up first).
            if not self._held(stream):
                self._resume_stream(stream, limit)

    def _resume_stream(self, stream: StreamKey, limit: int | None) -> None:
        """Finish one stream's rows in flight, a page at a time, in seq order."""
        after_seq = 0
        while limit is None or self.taken < limit:
            page = tickets.in_flight_page(self.spool, stream, after_seq, self.batch_rows)
            if not page.taken:
                return
            self.undecodable.update(page.undecodable)
            after_seq = page.taken[-1][0].seq
            done = Settlement()
            self._resume_page(stream, page.taken, done, limit, more=page.full)
            self._finish(done)
            if not page.full or self._held(stream):
                return

    def _resume_page(
        self,
        stream: StreamKey,
        taken: list[TakenRow],
        done: Settlement,
        limit: int | None,
        more: bool,
    ) -> None:
        """One page of a stream's rows in flight: remove what landed, write the rest.

        ``more``: later rows of the stream may be in flight still (a later page).
        """
        try:
            found = self.sink.landed([Ticket(self.uid, ticket, rec.id) for rec, ticket in taken])
        except Exception as exc:  # noqa: BLE001 - the rows stay in flight, reported
            # Whether they landed is unknown for now: they stay in flight, and
            # nothing later in their stream may move before them.
            self._hold(
                stream,
                f"{len(taken)} rows of an interrupted replay could not be checked "
                f"against the sink: {_describe(exc)}",
            )
            return
        if found is None:
            # Nobody can know whether these landed: set them aside for an operator
            # rather than guess either way; the stream goes on.
            for rec, _ in taken:
                self._quarantine(stream, rec, UNKNOWN_LANDING, done)
            return
        landed = [rec.id for rec, ticket in taken if Ticket(self.uid, ticket, rec.id) in found]
        unlanded = [(rec, t) for rec, t in taken if Ticket(self.uid, t, rec.id) not in found]
        if landed:
            done.delete += landed
            self.recovered += len(landed)
            log.warning(
                "%s: interrupted replay of %s %s recovered: %d of %d in-flight rows had "
                "landed and were removed, the rest will be written",
                self.spool.path,
                stream[0],
                stream[1],
                len(landed),
                len(taken),
            )
        if limit is not None:
            # Rows past the limit stay in flight; nothing later of any stream moves
            # in this call, since the limit is then used up.
            room = max(limit - self.taken, 0)
            more = more or len(unlanded) > room
            unlanded = unlanded[:room]
        self.taken += len(unlanded)
        self._write_stream(stream, unlanded, done)
        if more and self._held(stream):
            # Later rows of the stream stay in flight (not read yet, or past the
            # limit), and the next replay writes rows in flight first: freeing
            # these would put them after those. They stay in flight too.
            done.release.clear()

    # -- moving ----------------------------------------------------------------

    def move(self, limit: int | None) -> None:
        """Write batches of rows, streams spooled by session_id first, then by key."""
        self._move(keyed=False, limit=limit)
        if self.session_id is None and self.session_key is None:
            self._move(keyed=True, limit=limit)

    def _move(self, *, keyed: bool, limit: int | None) -> None:
        if self.session_id is not None and self._held(("session_id", self.session_id)):
            return
        if self.session_key is not None and self._held(("session_key", self.session_key)):
            return
        after: tuple[str, int] = ("", 0)
        while limit is None or self.taken < limit:
            size = self.batch_rows if self._sink_can_look_up() else 1
            want = size if limit is None else min(size, limit - self.taken)
            batch = tickets.take(self.spool, self.scope, keyed=keyed, after=after, limit=want)
            if not batch.taken:
                return
            taken = batch.taken
            self.undecodable.update(batch.undecodable)
            self._let_sink_forget(below=taken[0][1], keep=batch.older)
            self.taken += len(taken)
            done = Settlement()
            for stream, group in itertools.groupby(taken, key=lambda t: _stream(t[0])):
                of_stream = list(group)
                if self._held(stream):
                    done.release += [rec.id for rec, _ in of_stream]
                else:
                    self._write_stream(stream, of_stream, done)
            self._finish(done)
            # Resume after the last row taken; past the end of its stream if it is held.
            last = taken[-1][0]
            last_stream = _stream(last)
            after = (last_stream[1], _MAX_SEQ if self._held(last_stream) else last.seq)
            if not batch.full:
                return

    def _sink_can_look_up(self) -> bool:
        """Whether the sink can look tickets up (``landed(())`` is not None).

        One that cannot is given one row per batch: a crash then leaves in flight,
        to be quarantined as "cannot tell", only the row the sink was writing, never
        rows it was not handed yet. A sink that fails to answer is taken at its
        word later, by its writes and lookups.
        """
        try:
            return self.sink.landed(()) is not None
        except Exception:  # noqa: BLE001 - its writes will say what is wrong
            return True

    def _let_sink_forget(self, below: int, keep: list[int]) -> None:
        """Tell the sink which ticket records it may drop: every earlier batch is
        settled, so tickets under this batch's first are done with, but for the
        rows still in flight (``keep``). A record left behind costs a little room,
        never a wrong answer: its ticket is never given out again."""
        if isinstance(self.sink, ForgetsTickets):
            self.sink.forget(self.uid, below, keep)

    def _write_stream(self, stream: StreamKey, taken: list[TakenRow], done: Settlement) -> None:
        """Write one stream's rows of a batch in order, stopping at the first held row.

        Runs of rows the sink can write together (``write_many``) go as one write;
        a run that fails is written again row by row, which finds the row at fault.
        """
        if not taken:
            return
        tally = self._tally(stream)
        target, error = self._target(stream)
        if target is None:
            # Nothing was asked of the sink: the rows are freed and the stream held.
            self._fail(stream, taken[0][0], error or "no target session", done)
            done.release += [rec.id for rec, _ in taken]
            return
        i = 0
        one_by_one = 0  # rows before this index are written one by one
        in_doubt = 0  # rows before this index were in a batch that may have landed
        while i < len(taken):
            run = self._batchable_run(taken, i) if i >= one_by_one else []
            if len(run) > 1:
                landed = self._write_run(target, run)
                if landed:
                    done.delete += [rec.id for rec, _ in run]
                    tally.moved += len(run)
                    i += len(run)
                    continue
                one_by_one = i + len(run)  # the failed batch's rows, never batched again
                if landed is None:
                    in_doubt = one_by_one
            rec, ticket = taken[i]
            i += 1
            if rec.id in self.undecodable:
                self._quarantine(stream, rec, self.undecodable[rec.id], done)
                continue
            try:
                self.sink.write(target, rec, Ticket(self.uid, ticket, rec.id))
            except Exception as exc:  # noqa: BLE001 - sorted below: quarantine or hold
                if rejects_content(exc):
                    self._quarantine(stream, rec, _describe(exc), done)
                    continue
                if self._landed_after_all(rec, ticket):
                    done.delete.append(rec.id)
                    tally.moved += 1
                    continue
                self._fail(stream, rec, _describe(exc), done)
                # The rows of a batch whose landing could not be looked up stay in
                # flight with their tickets, for the next replay to look up; the
                # later ones were never written and are freed.
                done.release += [later.id for later, _ in taken[max(i, in_doubt) :]]
                return
            done.delete.append(rec.id)
            tally.moved += 1

    def _batchable_run(self, taken: list[TakenRow], start: int) -> list[TakenRow]:
        """The rows from ``start`` on that the sink can write as one batch."""
        if not isinstance(self.sink, WritesMany):
            return []
        batchable = self.sink.batchable
        end = start
        while (
            end < len(taken)
            and taken[end][0].id not in self.undecodable
            and batchable(taken[end][0])
        ):
            end += 1
        return taken[start:end]

    def _write_run(self, target: str, run: list[TakenRow]) -> bool | None:
        """Write ``run`` as one batch; True if it landed (all of it: a batch is one
        transaction). False: nothing of it landed, and it is written row by row. None:
        the write raised and whether it landed could not be looked up: it is written
        row by row too, and each row's ticket keeps it from landing twice."""
        items = [(rec, Ticket(self.uid, ticket, rec.id)) for rec, ticket in run]
        tickets = [t for _, t in items]
        try:
            cast(WritesMany, self.sink).write_many(target, items)  # ``_batchable_run`` saw it
        except Exception as exc:  # noqa: BLE001 - the rows are tried one by one next
            unknown = False
            try:
                found = self.sink.landed(tickets)
            except Exception:  # noqa: BLE001 - unknown: the row-by-row writes look first
                found, unknown = None, True
            if found is not None and found >= set(tickets):
                return True  # it committed, then raised
            # Written again row by row: a row whose ticket is recorded after all
            # cannot land twice (the ticket's record is unique; see SessionDBSink).
            log.info(
                "%s: a batch of %d rows for %s failed (%s); writing them one by one",
                self.spool.path,
                len(run),
                target,
                _describe(exc),
            )
            return None if unknown else False
        return True

    def _landed_after_all(self, rec: Record, ticket: int) -> bool:
        """After a write raised: did it commit anyway? Decides the row's in-flight mark.

        Found: it landed (the sink raised after its commit). Not found: the row stays
        in flight, so its retry looks it up first. The sink cannot tell (None): its
        raise is trusted and the row is freed by ``_fail``'s caller.
        """
        try:
            found = self.sink.landed([Ticket(self.uid, ticket, rec.id)])
        except Exception:  # noqa: BLE001 - unknown for now: stays in flight, looked up later
            return False
        if found is None:
            self._untracked.append(rec.id)
            return False
        return Ticket(self.uid, ticket, rec.id) in found

    def _fail(self, stream: StreamKey, rec: Record, error: str, done: Settlement) -> None:
        """Record a failed row and hold its stream; the caller frees the later rows."""
        done.failures.append((error, time.time(), rec.id))
        # INFO, not WARNING: during an outage every replay attempt fails the same
        # way; the caller reports held rows at the level it chooses.
        log.info(
            "%s: replay of %s %s held at seq %d: %s",
            self.spool.path,
            stream[0],
            stream[1],
            rec.seq,
            error,
        )
        self._hold(stream, error)

    def _quarantine(self, stream: StreamKey, rec: Record, error: str, done: Settlement) -> None:
        done.quarantine.append((error, time.time(), rec.id))
        self._tally(stream).quarantined += 1
        log.warning(
            "%s: quarantined row %d (%s %s, seq %d), its stream goes on: %s",
            self.spool.path,
            rec.id,
            stream[0],
            stream[1],
            rec.seq,
            error,
        )

    # -- bookkeeping -----------------------------------------------------------

    def _finish(self, done: Settlement) -> None:
        """Commit a batch's outcome: deletes, releases and quarantines now, failures
        as configured."""
        done.release += self._untracked
        self._untracked = []
        tickets.settle(self.spool, done, wait=self.wait_for_bookkeeping)

    def count_held(self) -> None:
        """Count the rows each held stream leaves behind (a read, after the writes)."""
        for stream, tally in self.tallies.items():
            if tally.error is not None:
                tally.held = tickets.count_held(self.spool, self.scope, stream)

    def _hold(self, stream: StreamKey, error: str) -> None:
        self._tally(stream).error = error

    def _held(self, stream: StreamKey) -> bool:
        tally = self.tallies.get(stream)
        return tally is not None and tally.error is not None

    def _tally(self, stream: StreamKey) -> _StreamOutcome:
        tally = self.tallies.get(stream)
        if tally is None:
            tally = self.tallies[stream] = _StreamOutcome(self._target(stream)[0])
        return tally

    def _target(self, stream: StreamKey) -> tuple[str | None, str | None]:
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
        by_kind: dict[str, dict[str, StreamReport]] = {"session_id": {}, "session_key": {}}
        for (kind, name), t in self.tallies.items():
            by_kind[kind][name] = StreamReport(
                session_id=t.session_id,
                session_key=name if kind == "session_key" else None,
                moved=t.moved,
                held=t.held,
                error=t.error,
                quarantined=t.quarantined,
            )
        return report_of(by_kind["session_id"], by_kind["session_key"], self.recovered)


def report_of(
    sessions: dict[str, StreamReport], keys: dict[str, StreamReport], recovered: int
) -> ReplayReport:
    """A ``ReplayReport`` of these streams' reports, its totals summed."""
    streams = [*sessions.values(), *keys.values()]
    return ReplayReport(
        moved=sum(s.moved for s in streams),
        held=sum(s.held for s in streams),
        errors={name: s.error for name, s in sessions.items() if s.error is not None},
        recovered=recovered,
        sessions=sessions,
        quarantined=sum(s.quarantined for s in streams),
        keys=keys,
        key_errors={name: s.error for name, s in keys.items() if s.error is not None},
    )


def statuses_filter(quarantined: bool, superseded: bool) -> str:
    """The statuses a replay takes besides replayable rows, as ``REASON_FILTER``'s
    ``:statuses`` (a JSON array)."""
    chosen = [QUARANTINED] * quarantined + [SUPERSEDED] * superseded
    return msgspec.json.encode(chosen).decode()


def _stream(record: Record) -> StreamKey:
    return stream_of(record.session_id, record.session_key)


#: SQLite's extended result codes whose message alone misleads, with what they mean.
_MEANINGS = {
    # SQLite refuses to write a database whose path names another file now (renamed,
    # deleted, a link swapped in): "attempt to write a readonly database".
    "SQLITE_READONLY_DBMOVED": (
        "the database was moved, deleted or replaced at its path while it was open, so "
        "SQLite wrote nothing into it"
    ),
}


def _describe(exc: BaseException) -> str:
    if isinstance(exc, WalspoolError):
        return str(exc)
    text = f"{type(exc).__name__}: {exc}"
    name = getattr(exc, "sqlite_errorname", None)
    if name in _MEANINGS:
        text += f" ({name}: {_MEANINGS[name]})"
    return text
