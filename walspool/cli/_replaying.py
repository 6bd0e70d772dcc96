"""The real ``walspool replay``: hermes' SessionDB, the turn among replays, progress.
Not public API."""

from __future__ import annotations

import argparse
import contextlib
import sqlite3
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote

from ..errors import ReplayBusy, WalspoolError
from ..replay.replayer import Replayer, ReplayReport
from ..replay.sinks import ForgetsTickets, SessionDBSink, Sink, Ticket
from ..shutdown_flush import routing_resolver
from ..store import totals
from ..store.records import Record
from ..store.spool import Spool
from ._dryrun import landed
from ._interrupt import raise_kept
from ._lockwait import say_waiting
from ._output import Progress
from ._reading import reading
from ._statedb import (
    CheckedStateDB,
    StateDBError,
    check_state_db,
    open_descriptors,
    open_state_db,
    state_db_message,
)


def replay_into(
    args: argparse.Namespace, progress: Progress, total: int, written: list[Ticket]
) -> ReplayReport:
    """Replay ``args.spool`` into ``args.into`` through hermes' SessionDB.

    Another replay holding the spool's replay lock raises ``ReplayBusy`` at once, or,
    with ``--wait``, after saying so and waiting that long for it. ``progress`` counts
    the rows written into state.db, whose tickets are added to ``written`` (kept after
    an interruption); the caller closes it.
    """
    try:
        import hermes_state
    except ImportError as exc:
        raise WalspoolError("replay needs hermes-agent: pip install 'walspool[hermes]'") from exc

    checked = check_state_db(args.into)
    before = open_descriptors()
    try:
        with connecting_checked(hermes_state, checked):
            db = hermes_state.SessionDB(db_path=args.into)
    except sqlite3.Error as exc:
        raise StateDBError(state_db_message(exc, args.into), path=args.into) from exc
    try:
        checked.verify(before)  # the rows go into the state.db checked, or nowhere
    except BaseException:
        db.close()
        raise
    try:
        with Spool(args.spool) as spool:
            sink = SessionDBSink(db, create_missing=args.create_missing)
            # Rows spooled by routing key go where the gateway routes that key now.
            resolver = routing_resolver(db, args.into.parent)
            replayer = Replayer(
                spool, ProgressSink(sink, progress, total, written), resolver=resolver
            )
            options = {
                "session_id": args.session,
                "reasons": args.reason,
                "quarantined": args.quarantined,
                "superseded": args.superseded,
            }
            try:
                return replayer.replay(**options, wait=False)
            except ReplayBusy as busy:
                if not args.wait:
                    raise
                say_waiting("replay", args, busy.pid)
            return replayer.replay(**options, wait=args.wait)
    finally:
        db.close()


class _CheckedSqlite3:
    """The stdlib ``sqlite3`` module as ``hermes_state`` sees it while ``SessionDB()``
    runs: ``connect`` of the checked state.db opens it ``mode=rw`` (never creating a
    file where a link or a rename sent the path) and proves, before handing the
    connection over, that SQLite holds the checked file (``CheckedStateDB.verify``);
    everything else is ``sqlite3`` itself."""

    def __init__(self, checked: CheckedStateDB):
        self._checked = checked

    def __getattr__(self, name: str) -> Any:
        return getattr(sqlite3, name)

    def connect(self, database: Any, *args: Any, **kwargs: Any) -> sqlite3.Connection:
        path = self._checked.path
        if str(database) not in (str(path), str(path.absolute())):
            return sqlite3.connect(database, *args, **kwargs)  # e.g. hermes' ":memory:" probe
        kwargs["uri"] = True
        before = open_descriptors()  # this connection's own descriptor is the new one
        conn = sqlite3.connect(f"file:{quote(str(path.absolute()))}?mode=rw", *args, **kwargs)
        try:
            self._checked.verify(before, writable=True)  # before any statement of hermes
        except BaseException:
            conn.close()
            raise
        return conn


@contextlib.contextmanager
def connecting_checked(hermes_state: Any, checked: CheckedStateDB) -> Iterator[None]:
    """For the block, hermes' ``SessionDB()`` opens state.db only as the file checked.

    ``SessionDB.__init__`` opens its path and runs its set-up (journal mode, schema
    ``CREATE ... IF NOT EXISTS``, migrations) on that connection at once: a link or a
    rename swapped in after ``check_state_db`` would have those statements run on
    another file. The stdlib module ``hermes_state`` calls is replaced for the block
    by ``_CheckedSqlite3``, which refuses (``StateDBError``) before any of them runs.
    Not thread-safe: for the command line, which builds one SessionDB and nothing else
    of hermes meanwhile.
    """
    original = hermes_state.sqlite3
    hermes_state.sqlite3 = _CheckedSqlite3(checked)
    try:
        yield
    finally:
        hermes_state.sqlite3 = original


class InFlightNow(NamedTuple):
    """Rows a replay has out now, and how many of them state.db already holds."""

    rows: int
    landed: int
    tickets: frozenset[tuple[int, int]] = frozenset()  # (ticket, record id)


def in_flight(spool: Path, state_db: Path) -> InFlightNow:
    """The spool's rows in flight now (read-only, after the replay closed the spool),
    and those whose ticket state.db holds (read-only)."""
    with reading(spool, quick_check=False) as reader:  # checked before the replay
        uid, rows = reader.read(lambda conn: (totals.uid(conn), totals.in_flight_tickets(conn)))
    tickets = frozenset((ticket, rid) for rid, ticket in rows)
    if not tickets:
        return InFlightNow(0, 0)
    state = open_state_db(state_db, write=False)
    try:
        found = landed(state, str(uid), sorted({ticket for ticket, _ in tickets}))
    finally:
        state.close()
    return InFlightNow(len(tickets), len(found & tickets), tickets)


class ProgressSink:
    """A sink that counts successful writes for the progress report; otherwise the sink."""

    def __init__(self, sink: Sink, progress: Progress, total: int, written: list[Ticket]) -> None:
        self.sink = sink
        self.progress = progress
        self.total = total
        self.written = written
        self.done = 0

    def write(self, session_id: str, record: Record, ticket: Ticket) -> None:
        try:
            self.sink.write(session_id, record, ticket)
        except BaseException:
            raise_kept()  # a signal that came during the write ends the replay now
            raise
        self.written.append(ticket)
        self.done += 1
        self.progress(self.done, self.total)
        raise_kept()

    def landed(self, tickets: Sequence[Ticket]) -> Collection[Ticket] | None:
        return self.sink.landed(tickets)

    def forget(self, spool: str, below: int, keep: Sequence[int]) -> None:
        if isinstance(self.sink, ForgetsTickets):
            self.sink.forget(spool, below, keep)

    def __repr__(self) -> str:
        return repr(self.sink)
