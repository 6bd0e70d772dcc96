"""Sinks: where a replay writes spooled messages, and how it asks what already landed.

A sink's write is usually not idempotent (``SessionDB.append_message`` writes a
second row when called twice), so the replayer cannot simply retry after a crash.
Instead it gives each row it has out a ticket that no other row ever gets, and the
sink records the ticket in the same transaction as the message. After a crash the
replayer asks ``landed(tickets)`` which of them the sink holds: an exact answer,
never a guess from look-alike rows.

Mapping: a gateway that has its own row mapping (``transcript_append_kwargs`` in
``gateway.session_transcript``, upstream 0.20+) maps every transcript message with
it, so fields walspool does not know travel as the live writer writes them; on
0.19.0, walspool's copy of that gateway's mapping is used.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import inspect
import json
import math
import sqlite3
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

from .. import text
from ..errors import NotAMessage, SessionMissing
from ..store import codec
from ..store.records import Record

log = text.logger("walspool.sinks")

#: Fields the gateway passes to ``append_message`` only for assistant rows.
ASSISTANT_ONLY = (
    "reasoning",
    "reasoning_content",
    "reasoning_details",
    "codex_reasoning_items",
    "codex_message_items",
)
#: ``append_message`` keywords bound to TEXT columns: a value SQLite cannot bind
#: there (a dict, a list, an integer beyond 64 bits) is written as its JSON text.
TEXT_KEYWORDS = (
    "role",
    "tool_name",
    "tool_call_id",
    "platform_message_id",
    "reasoning",
    "reasoning_content",
)
#: Fields newer gateways store with a row (0.20+); passed when the message has them and
#: the installed ``append_message`` takes them (0.19.0's does not).
NEWER_FIELDS = ("display_kind", "display_metadata")
#: A message's durable identity on newer gateways (``agent.message_metadata.MESSAGE_UID``).
MESSAGE_UID = "message_uid"
#: ``source`` of a session that ``create_missing=True`` creates.
CREATED_SOURCE = "walspool"


class Ticket(NamedTuple):
    """A replay ticket. The row id keeps the answer exact even if an operator copies an
    in-flight number onto another row by hand. Equal to the plain tuple of its fields
    (state.db's ``walspool_landed`` rows are read back as such)."""

    #: The spool's uid.
    spool: str
    #: A number no other row of that spool gets.
    number: int
    #: The spool row's id.
    row_id: int


#: In state.db: one row per replayed message whose spool row may still exist, written
#: by a TEMP trigger in the same transaction as the message row.
LANDED_TABLE = "walspool_landed"
LANDED_TABLE_EXISTS_SQL = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"
CREATE_LANDED_TABLE_SQL = f"""
CREATE TABLE IF NOT EXISTS {LANDED_TABLE} (
    spool TEXT NOT NULL,
    ticket INTEGER NOT NULL,
    record_id INTEGER NOT NULL,
    message_id INTEGER NOT NULL,
    landed_at REAL NOT NULL,
    PRIMARY KEY (spool, ticket, record_id)
) WITHOUT ROWID
"""
# A TEMP trigger lives on one connection only: it fires for inserts made through
# SessionDB's own connection, and the functions it calls read the inserting thread's
# ticket, so only the insert walspool asked for, on the thread that asked, records
# one. The DELETE prunes the records of rows a replay has finished (below the current
# batch's first ticket and not still in flight), in the same transaction.
TICKET_TRIGGER_SQL = f"""
CREATE TEMP TRIGGER IF NOT EXISTS walspool_ticket_on_insert
AFTER INSERT ON main.messages
WHEN walspool_ticket(1) IS NOT NULL
BEGIN
    INSERT INTO {LANDED_TABLE} (spool, ticket, record_id, message_id, landed_at)
    VALUES (walspool_ticket(0), walspool_ticket(1), walspool_ticket(2), new.id,
            (julianday('now') - 2440587.5) * 86400.0);
    DELETE FROM {LANDED_TABLE}
     WHERE spool = walspool_ticket(0)
       AND ticket < walspool_ticket(3)
       AND ticket NOT IN (SELECT value FROM json_each(walspool_ticket(4)));
END
"""
# The same for a batch (``write_many``): the first message the batch inserts records
# every ticket of the batch, which commits exactly when all of its messages do; the
# next inserts of the batch find the first ticket there and record nothing more. A
# transaction the gateway retries after a lock starts again with none recorded.
BATCH_TRIGGER_SQL = f"""
CREATE TEMP TRIGGER IF NOT EXISTS walspool_tickets_on_insert
AFTER INSERT ON main.messages
WHEN walspool_tickets(0) IS NOT NULL
 AND NOT EXISTS (SELECT 1 FROM {LANDED_TABLE}
                  WHERE spool = walspool_tickets(0) AND ticket = walspool_tickets(2)
                    AND record_id = walspool_tickets(3))
BEGIN
    INSERT INTO {LANDED_TABLE} (spool, ticket, record_id, message_id, landed_at)
    SELECT walspool_tickets(0), json_extract(value, '$[0]'), json_extract(value, '$[1]'),
           new.id, (julianday('now') - 2440587.5) * 86400.0
      FROM json_each(walspool_tickets(1));
    DELETE FROM {LANDED_TABLE}
     WHERE spool = walspool_tickets(0)
       AND ticket < walspool_tickets(4)
       AND ticket NOT IN (SELECT value FROM json_each(walspool_tickets(5)));
END
"""
LANDED_SQL = f"""
SELECT ticket, record_id FROM {LANDED_TABLE}
WHERE spool = ? AND ticket IN (SELECT value FROM json_each(?))
"""

#: The ticket of the write this thread is making: (spool, number, record id, prune
#: below, prune keep as a JSON array); empty when it is not replaying.
_thread = threading.local()


def _ticket_part(i: int) -> Any:
    """SQL ``walspool_ticket(i)``: part ``i`` of the calling thread's ticket, or NULL."""
    parts = getattr(_thread, "parts", None)
    return None if parts is None else parts[i]


def _batch_part(i: int) -> Any:
    """SQL ``walspool_tickets(i)``: part ``i`` of the calling thread's batch of tickets
    (spool, JSON ``[[number, record id], ...]``, the first number, its record id, prune
    below, prune keep), or NULL."""
    parts = getattr(_thread, "batch", None)
    return None if parts is None else parts[i]


#: The code of the functions SQLite calls inside a replayed row's INSERT: a signal
#: handler must not raise there (``sqlite3`` would swallow it and fail the write).
SQL_FUNCTIONS = frozenset({_ticket_part.__code__, _batch_part.__code__})


@runtime_checkable
class Sink(Protocol):
    """Where replayed messages go: a write that records its ticket, and a lookup.

    ``write`` commits one message durably before it returns, or raises; if it
    raises, ``landed`` tells whether it committed all the same. ``landed`` returns
    exactly the given tickets whose writes committed, or None when the sink cannot
    tell (then a raise must mean nothing was written); asked of no tickets, None
    says it can never tell, and the replayer hands it one row per batch.

    Those two are all a sink needs. What else the replayer calls, if a sink has it,
    is stated by ``WritesMany`` and ``ForgetsTickets``, the protocols it checks for.
    """

    def write(self, session_id: str, record: Record, ticket: Ticket) -> None: ...

    def landed(self, tickets: Sequence[Ticket]) -> Collection[Ticket] | None: ...


@runtime_checkable
class WritesMany(Protocol):
    """A sink that can write a run of one session's rows as one commit: ``batchable``
    says whether a record may join such a run, ``write_many`` writes the run (every
    row or none, each with its ticket, as ``write`` would one by one)."""

    def batchable(self, record: Record) -> bool: ...

    def write_many(self, session_id: str, items: Sequence[tuple[Record, Ticket]]) -> None: ...


@runtime_checkable
class ForgetsTickets(Protocol):
    """A sink that keeps records of tickets: ``forget(spool, below, keep)`` says the
    replayer no longer needs those of the spool's tickets under ``below``, except
    those in ``keep``."""

    def forget(self, spool: str, below: int, keep: Sequence[int]) -> None: ...


#: SQLite's result codes for a lock held elsewhere: SQLITE_BUSY, SQLITE_LOCKED.
_LOCK_CODES = (5, 6)


def met_a_lock(exc: BaseException) -> bool:
    """Whether ``exc`` says a database's lock was held elsewhere past the wait allowed
    ("database is locked", busy): a wait that ran out, not a fault of the database or
    of a row. By the stdlib error's code where it has one, else by its text."""
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF in _LOCK_CODES
    text = str(exc).lower()
    return "locked" in text or "busy" in text


class RowRejected(ValueError):
    """A write the gateway's own rule says failed for the message itself.

    Raised from a sink (chained to the original error) where the installed gateway
    classifies more errors as the row's fault than ``rejects_content`` does by
    itself (upstream's ``is_row_rejection``: a ``TypeError``, ``ValueError`` or
    ``AttributeError`` raised while building or binding the row).
    """


def rejects_content(exc: BaseException) -> bool:
    """Whether a failed write was refused for the message itself, not the database.

    Content: a value the driver cannot bind or convert (``InterfaceError``,
    ``ProgrammingError`` about a parameter, ``OverflowError``, ``UnicodeError``,
    ``RecursionError``), a value too big (``DataError``), a NOT NULL or CHECK
    constraint or a datatype mismatch, and a record that is not one message
    (``NotAMessage``). Everything else (locked, busy, I/O, full, malformed, a
    missing session, a closed database, and anything unknown, a ``TypeError`` from
    a sink's own bug included) is the database's state, which holds the session:
    order over progress, and nothing set aside by mistake. A sink that follows a
    newer gateway's wider rule says so by raising ``RowRejected``.
    """
    if isinstance(exc, (NotAMessage, RowRejected)):
        return True
    if isinstance(exc, (sqlite3.InterfaceError, sqlite3.DataError)):
        return True
    if isinstance(exc, sqlite3.ProgrammingError):
        return "binding parameter" in str(exc) or "not supported" in str(exc)
    if isinstance(exc, sqlite3.IntegrityError):
        text = str(exc)
        return any(
            what in text
            for what in ("NOT NULL constraint", "CHECK constraint", "datatype mismatch")
        )
    if isinstance(exc, sqlite3.Error):
        return False
    return isinstance(exc, (OverflowError, UnicodeError, RecursionError))


#: The installed gateway's own row mapping: ``(session_id, message, *, fallback_ts)``
#: to ``append_message`` keywords (``gateway.session_transcript.transcript_append_kwargs``).
GatewayMapping = Callable[..., dict[str, Any]]


class _Default:
    """Marks "use the installed gateway's mapping, if it has one"."""


INSTALLED = _Default()


def gateway_mapping() -> GatewayMapping | None:
    """The installed gateway's ``transcript_append_kwargs`` (0.20+), else None (0.19.0)."""
    try:
        from gateway.session_transcript import transcript_append_kwargs
    except Exception:  # noqa: BLE001 - absent (0.19.0) or broken: walspool's mapping
        return None
    return transcript_append_kwargs if callable(transcript_append_kwargs) else None


def is_row_rejection(exc: BaseException) -> bool:
    """Upstream's rule (``gateway/shutdown_flush.is_row_rejection``, 0.20+) for a row
    the database refused for its own values, so no retry can write it.

    A value SQLite cannot bind (``InterfaceError``/``ProgrammingError`` about a
    binding parameter), or a ``TypeError``, ``ValueError``, ``AttributeError`` or
    ``OverflowError`` raised before the write; any other SQLite error (locked, I/O,
    corruption, constraints) is retryable.
    """
    if isinstance(exc, sqlite3.Error):
        return (
            isinstance(exc, (sqlite3.InterfaceError, sqlite3.ProgrammingError))
            and "binding parameter" in str(exc).lower()
        )
    return isinstance(exc, (TypeError, ValueError, AttributeError, OverflowError))


def rejects_live_row(exc: BaseException, session_db: Any, message: Any = None) -> bool:
    """Whether a live write through the gateway's own store (its ``append_message``, which
    serialises structured fields itself) failed for the message, not the database.

    ``rejects_content``, widened by the gateway's own rule (``is_row_rejection``: a
    ``TypeError`` from serialising a field holding an SDK object, say), except while
    ``session_db`` is closed, when every write fails with such an error whatever the
    message: that is the database's state. Any other error that is not SQLite's is the
    message's when one of ``message``'s values raises it again inspected alone
    (``raised_by_value``): no retry of the gateway's write can get past it.
    """
    if rejects_content(exc):
        return True
    if is_row_rejection(exc) and not _is_closed_session_db(session_db):
        return True
    return message is not None and raised_by_value(exc, message)


#: What the gateway's write does to a message's values before SQLite sees them (0.19.0's
#: ``_append_transcript_message`` and ``append_message``: truth tests, the role compared,
#: JSON for structured fields, a timestamp's ``timestamp()`` or ``float``, a list's
#: length), each on one value and without the database.
_INSPECTIONS: tuple[Callable[[Any], Any], ...] = (
    bool,
    lambda value: value == "assistant",
    json.dumps,
    lambda value: hasattr(value, "timestamp"),
    float,
    lambda value: isinstance(value, (str, bytes, int, float, list)),
    len,
)


def raised_by_value(exc: BaseException, message: Any) -> bool:
    """Whether one of ``message``'s values, inspected alone as the gateway's write
    inspects it (``_INSPECTIONS``), raises ``exc`` again: the same type, the same text.

    For errors no rule classifies (an SDK object whose ``__class__``, attribute access,
    iteration, length or comparison raises, say, a ``RuntimeError``): raised again with
    no database involved, the message is their cause and the gateway can never write
    it. A SQLite error is never the value's (the classifiers above say which are), and
    an error a value does not raise again (a bug, a transient fault) is not either.
    Not guaranteed: a value that raises differently each time is not recognised.
    """
    if isinstance(exc, sqlite3.Error):
        return False
    wanted = _error_text(exc)
    if wanted is None:
        return False
    try:
        values = list(message.values()) if isinstance(message, dict) else [message]
    except Exception:  # noqa: BLE001 - not a dict the gateway could read: the value itself
        values = [message]
    for value in values:
        for inspect_value in _INSPECTIONS:
            try:
                inspect_value(value)
            except Exception as again:  # noqa: BLE001 - raising is what is looked for
                if type(again) is type(exc) and _error_text(again) == wanted:
                    return True
    return False


def _error_text(exc: BaseException) -> str | None:
    """``str(exc)``, or None for an exception whose text itself raises."""
    try:
        return str(exc)
    except Exception:  # noqa: BLE001
        return None


def as_rejection(exc: BaseException) -> RowRejected | None:
    """``exc`` as a ``RowRejected`` when the newer gateway's rule blames the row and
    ``rejects_content`` does not already; else None (raise ``exc`` unchanged)."""
    if rejects_content(exc) or not is_row_rejection(exc):
        return None
    return RowRejected(f"{type(exc).__name__}: {exc}")


class SessionDBSink:
    """Writes messages into a ``hermes_state.SessionDB`` (0.19.0 and later).

    A message is mapped to ``append_message`` keywords as the installed gateway
    maps it (see ``append_kwargs``): with the gateway's own
    ``transcript_append_kwargs`` where it has one (0.20+), else as 0.19.0's
    ``SessionStore._append_transcript_message`` does; then made bindable (see
    ``bindable``), and only keywords the installed ``append_message`` accepts are
    passed. With the gateway's mapping, errors that gateway blames on the row
    (``is_row_rejection``) are raised as ``RowRejected``, so the row is quarantined
    as upstream quarantines it, and its session goes on.

    Landings are exact: the sink keeps a ``walspool_landed`` table in state.db and
    a TEMP trigger on ``SessionDB``'s own connection that, inside the transaction
    ``append_message`` runs, records the ticket of the row being replayed (read
    from the writing thread). The ticket record commits if and only if the message
    does, and rewrites of the transcript do not touch it, so ``landed`` is a lookup.
    This holds for 0.19.0's ``SessionDB`` and for 0.22's (also in rollback-journal
    mode): both insert through ``_execute_write`` on ``_conn``, reopened after a
    ``close()`` (the trigger is set up again on a new connection).

    A look-alike without ``SessionDB``'s private ``_conn`` (a ``sqlite3``
    connection) and ``_lock`` cannot record tickets: ``landed`` then answers None
    ("cannot tell"), and the replayer quarantines the rows a crash left in flight
    instead of guessing. A real ``SessionDB`` whose connection is closed right now
    makes ``landed`` raise instead: the rows stay in flight for the next replay.
    """

    def __init__(
        self,
        session_db: Any,
        *,
        create_missing: bool = False,
        mapping: GatewayMapping | None | _Default = INSTALLED,
    ) -> None:
        """``mapping``: the gateway's row mapping to use; by default the installed
        gateway's, if it has one; None for walspool's 0.19.0 mapping."""
        self.session_db = session_db
        self.create_missing = create_missing
        self.mapping = gateway_mapping() if isinstance(mapping, _Default) else mapping
        self._accepted = _accepted_keywords(session_db.append_message)
        #: The gateway's batch write (0.22's ``append_messages_batch``), if it has one.
        self._batch: Callable[[str, list[dict[str, Any]]], Any] | None = getattr(
            session_db, "append_messages_batch", None
        )
        self._tickets_on: Any = None
        self._prune: tuple[str, int, str] | None = None

    def write(self, session_id: str, record: Record, ticket: Ticket) -> None:
        """Append one message to ``session_id`` with its ticket; committed on return.

        Raises ``SessionMissing`` when the session has no row and
        ``create_missing`` is off (with it, the session is created, source
        "walspool", and the write made once more), ``NotAMessage`` for an agent
        history spooled as one row, and ``RowRejected`` for a row the gateway's
        own rule refuses; any other error of ``append_message`` (for instance
        ``database is locked`` after its own retries) propagates.
        """
        if _is_history(record.message):
            raise NotAMessage(record)
        try:
            kwargs = self._filter(bindable(append_kwargs(record, self.mapping)))
        except Exception as exc:
            if self.mapping is None:
                raise
            raise RowRejected(f"the gateway cannot map this message: {exc!r}") from exc
        tracked = self._set_up_tickets()
        try:
            with self.tracking(ticket if tracked else None):
                self._append(session_id, kwargs)
        except SessionMissing:
            if not self.create_missing:
                raise
        else:
            return
        # The failed insert wrote nothing, so creating the session and writing
        # again cannot duplicate the message.
        log.warning("creating missing session %s in state.db for replayed messages", session_id)
        self.session_db.create_session(session_id, source=CREATED_SOURCE)
        with self.tracking(ticket if tracked else None):
            self._append(session_id, kwargs)

    def batchable(self, record: Record) -> bool:
        """Can ``write_many`` take this record? A transcript message, for a gateway
        with a batch write (``append_messages_batch``, 0.22) and its own row mapping,
        on a ``SessionDB`` whose inserts record tickets."""
        message = record.message
        return (
            self._batch is not None
            and self.mapping is not None
            and isinstance(message, dict)
            and ("role" in message or "content" in message or "text" not in message)
            and not _is_history(message)
        )

    def write_many(self, session_id: str, items: Sequence[tuple[Record, Ticket]]) -> None:
        """Append ``batchable`` records to ``session_id`` in one transaction, in order,
        each with its ticket: all of them are committed on return, or none.

        Each row is the one ``write`` would make: the message the gateway's mapping
        gives (``append_message``'s keywords, which are the message's own fields),
        written by the gateway's batch write. Any error propagates, with nothing
        written; the caller writes the rows one by one then, to find the row at
        fault (``write`` names a missing session or a refused row).
        """
        if not items or self._batch is None or not self._set_up_tickets():
            raise NotBatchable("this SessionDB has no batch write that records tickets")
        messages = []
        for record, _ in items:
            if not self.batchable(record):
                raise NotBatchable(f"record {record.id} is not a transcript message")
            kwargs = self._filter(bindable(append_kwargs(record, self.mapping)))
            messages.append({k: v for k, v in kwargs.items() if k not in _NOT_MESSAGE_FIELDS})
        # A sink is also handed plain (spool, number, row id) tuples: read by position.
        tickets = [Ticket(*ticket) for _, ticket in items]
        spool = tickets[0].spool
        if any(ticket.spool != spool for ticket in tickets):
            raise NotBatchable("a batch's tickets come from one spool")
        prune = self._prune if self._prune is not None and self._prune[0] == spool else None
        first = tickets[0]
        numbers = codec.encode([[t.number, t.row_id] for t in tickets]).decode()
        _thread.batch = (
            spool,
            numbers,
            first.number,
            first.row_id,
            *(prune[1:] if prune else (None, "[]")),
        )
        try:
            self._batch(session_id, messages)
        finally:
            _thread.batch = None
        if prune is not None and self._prune is prune:
            self._prune = None

    def _append(self, session_id: str, kwargs: dict[str, Any]) -> None:
        """One ``append_message``, its errors named: a missing session, a refused row."""
        try:
            self.session_db.append_message(session_id=session_id, **kwargs)
        except sqlite3.IntegrityError as exc:
            if "FOREIGN KEY" in str(exc):
                raise SessionMissing(session_id) from exc
            raise
        except Exception as exc:
            rejected = as_rejection(exc) if self.mapping is not None else None
            if rejected is None:
                raise
            raise rejected from exc

    def landed(self, tickets: Sequence[Ticket]) -> set[Ticket] | None:
        """The given tickets whose messages are committed in state.db (exact)."""
        conn, lock = session_db_connection(self.session_db)
        if conn is None or lock is None:
            if _is_closed_session_db(self.session_db):
                raise SessionDBClosed(
                    f"{self.session_db!r} has no open connection; its rows stay in flight"
                )
            return None
        wanted = set(tickets)
        by_spool: dict[str, list[int]] = {}
        for spool, number, _ in wanted:
            by_spool.setdefault(spool, []).append(number)
        found: set[Ticket] = set()
        with lock:
            if not conn.execute(LANDED_TABLE_EXISTS_SQL, (LANDED_TABLE,)).fetchone():
                return found  # no ticket was ever recorded in this state.db
            for spool, numbers in by_spool.items():
                rows = conn.execute(LANDED_SQL, (spool, codec.encode(numbers).decode()))
                found.update((spool, number, record_id) for number, record_id in rows)
        return found & wanted

    def forget(self, spool: str, below: int, keep: Sequence[int]) -> None:
        """Prune, in the next write's transaction, ``spool``'s ticket records under
        ``below`` other than ``keep``: their rows have left the spool."""
        self._prune = (spool, below, codec.encode(sorted(keep)).decode())

    @contextlib.contextmanager
    def tracking(self, ticket: Ticket | None) -> Iterator[None]:
        """Make ``ticket`` the one this thread's inserts through ``session_db``'s
        connection record, for the block (after ``set_up_tickets()`` returned True).

        Whoever inserts the message (this sink, or the gateway's own write path
        called on this thread) records the ticket in the same transaction.
        """
        if ticket is None:
            yield
            return
        ticket = Ticket(*ticket)
        prune = self._prune if self._prune is not None and self._prune[0] == ticket.spool else None
        _thread.parts = (*ticket, *(prune[1:] if prune else (None, "[]")))
        try:
            yield
        finally:
            _thread.parts = None
        if prune is not None and self._prune is prune:
            self._prune = None

    def set_up_tickets(self) -> bool:
        """Set up ticket recording on SessionDB's connection; False for a look-alike."""
        return self._set_up_tickets()

    def _set_up_tickets(self) -> bool:
        conn, lock = session_db_connection(self.session_db)
        if conn is None and _is_closed_session_db(self.session_db):
            # Writing now would land untracked: let SessionDB reopen its writer first
            # (0.22 does so in ``_execute_write``), or hold the row.
            try:
                self.session_db._execute_write(lambda c: None)
            except Exception as exc:  # noqa: BLE001 - named below: nothing was written
                raise SessionDBClosed(f"{self.session_db!r} is closed: {exc}") from exc
            conn, lock = session_db_connection(self.session_db)
            if conn is None:
                raise SessionDBClosed(f"{self.session_db!r} is closed")
        if conn is None or lock is None:
            return False
        if conn is self._tickets_on:
            return True
        with lock:
            exists = conn.execute(LANDED_TABLE_EXISTS_SQL, (LANDED_TABLE,)).fetchone()
        if not exists:
            self.session_db._execute_write(lambda c: c.execute(CREATE_LANDED_TABLE_SQL))
        with lock:
            conn.create_function("walspool_ticket", 1, _ticket_part)
            conn.execute(TICKET_TRIGGER_SQL)
            conn.create_function("walspool_tickets", 1, _batch_part)
            conn.execute(BATCH_TRIGGER_SQL)
        _restore_landings_on_write(self.session_db)
        self._tickets_on = conn
        return True

    def _filter(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if self._accepted is None:
            return kwargs
        return {k: v for k, v in kwargs.items() if k in self._accepted}

    def __repr__(self) -> str:
        return f"SessionDBSink({self.session_db!r}, create_missing={self.create_missing})"

    def __str__(self) -> str:
        """Its state.db's path, for log lines (no object repr); the repr without one."""
        path = getattr(self.session_db, "db_path", None)
        return str(path) if isinstance(path, (str, Path)) else repr(self)


#: ``append_message`` keywords that are not fields of the message dict it builds.
_NOT_MESSAGE_FIELDS = frozenset({"session_id", "compression_lock_holder", "turn_lease_holder"})


class NotBatchable(Exception):
    """``write_many`` was given what it cannot write as one batch; nothing was written."""


class SessionDBClosed(Exception):
    """A real ``SessionDB`` whose connection is closed: landings cannot be checked now."""


def write_bindable(write: Callable[[str, Any], Any], session_id: str, message: Any) -> Any:
    """``write(session_id, message)`` (the gateway's live write); if state.db refuses one
    of the message's values as it is (``rejects_content``: refused while binding, before
    anything is written), once more with its values made bindable as a replay makes
    them (``bindable``). So a row gets one verdict, live or replayed."""
    try:
        return write(session_id, message)
    except Exception as exc:
        fixed = bindable(message) if isinstance(message, dict) and rejects_content(exc) else None
        if fixed is None or fixed == message:
            raise
    return write(session_id, fixed)


def bindable(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``append_message`` keywords with every value SQLite can bind where it goes.

    As the gateway makes values bindable: a dict or list in a TEXT column becomes
    its JSON text, an integer outside 64 bits becomes its decimal text (in
    ``content`` too; a list or dict ``content`` is left to ``SessionDB``, which
    stores it as tagged JSON).
    """
    out = dict(kwargs)
    for name in TEXT_KEYWORDS:
        if name in out:
            out[name] = _bindable_text(out[name])
    content = out.get("content")
    if isinstance(content, int) and not isinstance(content, bool) and not _fits(content):
        out["content"] = str(content)
    return out


def _bindable_text(value: Any) -> Any:
    if value is None or isinstance(value, (str, float, bool)):
        return value
    if isinstance(value, int):
        return value if _fits(value) else str(value)
    return codec.encode(value).decode("utf-8")


def _fits(value: int) -> bool:
    return -(2**63) <= value < 2**63


def append_kwargs(record: Record, mapping: GatewayMapping | None = None) -> dict[str, Any]:
    """The ``append_message`` keywords for a spooled record, as the gateway maps them.

    With ``mapping`` (the gateway's ``transcript_append_kwargs``), a transcript
    message is mapped by it, so every field that gateway stores travels (0.22:
    ``display_kind``, ``display_metadata``, ``api_content``); the message's own
    ``message_uid`` is kept, and ``timestamp`` is normalised as below. Without it,
    a dict is a transcript message, mapped as 0.19.0's
    ``SessionStore._append_transcript_message`` does: ``role`` (default
    "unknown"), ``content``, ``tool_name``, ``tool_calls``, ``tool_call_id``, the
    reasoning and codex fields only for assistant rows, ``platform_message_id``
    falling back to ``message_id``, ``observed`` as a bool, and ``api_content``
    only when it is a string. A dict with ``text`` but neither ``role`` nor
    ``content`` (a platform ``MessageEvent`` as the spool stores it) and a str (a
    runner's pending slot) become a user message of that text; any other value
    becomes a user message of its JSON text. ``timestamp`` is always a float: the
    message's own (a number, numeric text, or ISO 8601 text, which is how the spool
    stores a datetime), else the time the record was spooled. Newer fields
    (``display_kind``, ``display_metadata``, ``message_uid``) are added only when the
    message has them (the sink passes them only where ``append_message`` takes them).
    """
    message = record.message
    transcript = _is_transcript_message(message)
    kwargs: dict[str, Any]
    if transcript and mapping is not None:
        kwargs = dict(mapping("", message, fallback_ts=record.created_at))
        kwargs.pop("session_id", None)
        uid = message.get(MESSAGE_UID)
        if isinstance(uid, str) and uid and MESSAGE_UID not in kwargs:
            kwargs[MESSAGE_UID] = uid
    elif transcript:
        role = message.get("role", "unknown")
        assistant = role == "assistant"
        api_content = message.get("api_content")
        kwargs = {
            "role": role,
            "content": message.get("content"),
            "tool_name": message.get("tool_name"),
            "tool_calls": message.get("tool_calls"),
            "tool_call_id": message.get("tool_call_id"),
            **{name: message.get(name) if assistant else None for name in ASSISTANT_ONLY},
            "platform_message_id": message.get("platform_message_id") or message.get("message_id"),
            "observed": bool(message.get("observed")),
            "api_content": api_content if isinstance(api_content, str) else None,
        }
        for name in NEWER_FIELDS:
            if message.get(name) is not None:
                kwargs[name] = message[name]
        uid = message.get(MESSAGE_UID)
        if isinstance(uid, str) and uid:
            kwargs[MESSAGE_UID] = uid
    elif isinstance(message, dict):
        pmid = message.get("platform_message_id") or message.get("message_id")
        kwargs = {
            "role": "user",
            "content": _text(message.get("text")),
            "platform_message_id": pmid,
        }
    elif isinstance(message, str):
        kwargs = {"role": "user", "content": message}
    else:
        kwargs = {"role": "user", "content": codec.encode(message).decode("utf-8")}
    own = message.get("timestamp") if isinstance(message, dict) else None
    kwargs["timestamp"] = _timestamp(own, record.created_at)
    return kwargs


def _is_transcript_message(message: Any) -> bool:
    """A dict a transcript row is made of, not a pending slot (``{"text": ...}``)."""
    return isinstance(message, dict) and (
        "role" in message or "content" in message or "text" not in message
    )


def transcript_message(record: Record) -> Any:
    """The record as the message a gateway's own transcript write takes: a transcript
    message as it is; a pending slot (an event's ``{"text": ...}``, a str, any other
    value) as the user message ``append_kwargs`` makes of it."""
    if _is_transcript_message(record.message):
        return record.message
    kwargs = append_kwargs(record, None)
    return {k: v for k, v in kwargs.items() if v is not None}


def _is_history(message: Any) -> bool:
    """An agent history spooled whole: ``{"messages": [...], ...}`` and no message fields."""
    return (
        isinstance(message, dict)
        and isinstance(message.get("messages"), list)
        and not {"role", "content", "text"} & message.keys()
    )


def _text(value: Any) -> str:
    return value if isinstance(value, str) else codec.encode(value).decode("utf-8")


def _timestamp(value: Any, fallback: float) -> float:
    """A message's own time as epoch seconds, converted as ``append_message`` does.

    ``append_message`` takes ``float(value)``, or ``value.timestamp()`` of a
    datetime; the spool stores a datetime as ISO 8601 text, parsed back here.
    Anything else falls back to the time the record was spooled.
    """
    if isinstance(value, bool) or value is None:
        return fallback
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        pass
    else:
        if math.isfinite(number):  # NaN would become NULL, which state.db refuses
            return number
    if isinstance(value, str):
        try:
            return datetime.datetime.fromisoformat(value).timestamp()
        except (ValueError, OverflowError, OSError):
            pass
    log.debug("ignoring message timestamp %r; using the spool time", value)
    return fallback


def _accepted_keywords(fn: Any) -> frozenset[str] | None:
    """Keyword names ``fn`` accepts, or None when it takes ``**kwargs`` (anything)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    )


def _is_closed_session_db(session_db: Any) -> bool:
    """A real ``SessionDB`` (it has ``_conn``, ``_lock`` and ``_execute_write``) whose
    connection is closed right now (0.22 reopens it at its next write)."""
    return (
        hasattr(session_db, "_conn")
        and getattr(session_db, "_conn", None) is None
        and hasattr(getattr(session_db, "_lock", None), "__enter__")
        and callable(getattr(session_db, "_execute_write", None))
    )


#: Marks a ``SessionDB`` write wrapped by ``_restore_landings_on_write``.
_RESTORES = "__walspool_restores_landings__"
#: The writes of a ``SessionDB`` that insert into ``messages`` (0.22 has the batch).
_MESSAGE_WRITES = ("append_message", "append_messages_batch")


def _restore_landings_on_write(session_db: Any) -> None:
    """Make ``session_db``'s message writes outlive a dropped ``walspool_landed``.

    The TEMP triggers ``set_up_tickets`` puts on its connection name that table, so once
    it is gone (an operator's ``DROP TABLE`` with the sqlite3 shell) SQLite refuses every
    insert into ``messages`` on that connection, the gateway's own included, until the
    process ends. The statement fails as it is prepared, before anything is written,
    so the table is made again and the write made once more. Not guaranteed: rows a
    replay had in flight lose their tickets with the table, and the next lookup takes
    them as not landed, so one that had landed is written a second time.
    """
    for name in _MESSAGE_WRITES:
        write = getattr(session_db, name, None)
        if write is None or getattr(write, _RESTORES, False):
            continue
        own = session_db.__dict__.get(name) if hasattr(session_db, "__dict__") else None

        @functools.wraps(write)
        def restoring(*args: Any, _name: str = name, _own: Any = own, **kwargs: Any) -> Any:
            # The class's method as it is now (another wrapper may come later), unless
            # the instance had one of its own.
            _write = _own or getattr(type(session_db), _name).__get__(session_db)
            try:
                return _write(*args, **kwargs)
            except sqlite3.OperationalError as exc:
                if "no such table" not in str(exc) or LANDED_TABLE not in str(exc):
                    raise
            log.warning(
                "the table %s of replay tickets was dropped from %s; made again, and the "
                "write retried",
                LANDED_TABLE,
                getattr(session_db, "db_path", session_db),
            )
            session_db._execute_write(lambda c: c.execute(CREATE_LANDED_TABLE_SQL))
            return _write(*args, **kwargs)

        setattr(restoring, _RESTORES, True)
        setattr(session_db, name, restoring)


def session_db_connection(session_db: Any) -> tuple[Any, Any]:
    """``SessionDB``'s own connection and lock, for a cheap read; (None, None) if absent."""
    conn = getattr(session_db, "_conn", None)
    lock = getattr(session_db, "_lock", None)
    if isinstance(conn, sqlite3.Connection) and hasattr(lock, "__enter__"):
        return conn, lock
    return None, None
