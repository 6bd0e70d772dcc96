"""Sinks: where a replay writes spooled messages, and how it asks what already landed.

A sink's write is usually not idempotent (``SessionDB.append_message`` writes a
second row when called twice), so the replayer cannot simply retry after a crash.
Instead it gives each row it has out a ticket that no other row ever gets, and the
sink records the ticket in the same transaction as the message. After a crash the
replayer asks ``landed(tickets)`` which of them the sink holds: an exact answer,
never a guess from look-alike rows.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import logging
import math
import sqlite3
import threading
from collections.abc import Collection, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from . import codec
from .errors import NotAMessage, SessionMissing
from .records import Record

log = logging.getLogger("walspool.sinks")

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
#: ``source`` of a session that ``create_missing=True`` creates.
CREATED_SOURCE = "walspool"

#: A replay ticket: (the spool's uid, a number no other row of that spool gets, the
#: spool row's id). The row id keeps the answer exact even if an operator copies an
#: in-flight number onto another row by hand.
Ticket = tuple[str, int, int]

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


@runtime_checkable
class Sink(Protocol):
    """Where replayed messages go: a write that records its ticket, and a lookup.

    ``write`` commits one message durably before it returns, or raises; if it
    raises, ``landed`` tells whether it committed all the same. ``landed`` returns
    exactly the given tickets whose writes committed, or None when the sink cannot
    tell (then a raise must mean nothing was written). A sink may also offer
    ``forget(spool, below, keep)``: the replayer no longer needs the records of
    that spool's tickets under ``below``, except those in ``keep``.
    """

    def write(self, session_id: str, record: Record, ticket: Ticket) -> None: ...

    def landed(self, tickets: Sequence[Ticket]) -> Collection[Ticket] | None: ...


def rejects_content(exc: BaseException) -> bool:
    """Whether a failed write was refused for the message itself, not the database.

    Content: a value the driver cannot bind or convert (``InterfaceError``,
    ``ProgrammingError`` about a parameter, ``OverflowError``, ``UnicodeError``,
    ``RecursionError``), a value too big (``DataError``), a NOT NULL or CHECK
    constraint or a datatype mismatch, and a record that is not one message
    (``NotAMessage``). Everything else (locked, busy, I/O, full, malformed, a
    missing session, a closed database, and anything unknown, a ``TypeError`` from
    a sink's own bug included) is the database's state, which holds the session:
    order over progress, and nothing set aside by mistake.
    """
    if isinstance(exc, NotAMessage):
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


class SessionDBSink:
    """Writes messages into a ``hermes_state.SessionDB`` (0.19.0 and later).

    A message is mapped to ``append_message`` keywords exactly as the gateway's own
    ``SessionStore._append_transcript_message`` does (see ``append_kwargs``), made
    bindable (see ``bindable``), and only keywords the installed ``append_message``
    accepts are passed.

    Landings are exact: the sink keeps a ``walspool_landed`` table in state.db and
    a TEMP trigger on ``SessionDB``'s own connection that, inside the transaction
    ``append_message`` runs, records the ticket of the row being replayed (read
    from the writing thread). The ticket record commits if and only if the message
    does, and rewrites of the transcript do not touch it, so ``landed`` is a lookup.

    A look-alike without ``SessionDB``'s private ``_conn`` (a ``sqlite3``
    connection) and ``_lock`` cannot record tickets: ``landed`` then answers None
    ("cannot tell"), and the replayer quarantines the rows a crash left in flight
    instead of guessing.
    """

    def __init__(self, session_db: Any, *, create_missing: bool = False) -> None:
        self.session_db = session_db
        self.create_missing = create_missing
        self._accepted = _accepted_keywords(session_db.append_message)
        self._prepared: Any = None
        self._prune: tuple[str, int, str] | None = None

    def write(self, session_id: str, record: Record, ticket: Ticket) -> None:
        """Append one message to ``session_id`` with its ticket; committed on return.

        Raises ``SessionMissing`` when the session has no row and
        ``create_missing`` is off (with it, the session is created, source
        "walspool", and the write made once more), and ``NotAMessage`` for an
        agent history spooled as one row; any other error of ``append_message``
        (for instance ``database is locked`` after its own retries) propagates.
        """
        if _is_history(record.message):
            raise NotAMessage(record)
        kwargs = self._filter(bindable(append_kwargs(record)))
        tracked = self._prepare()
        try:
            with self._ticket(ticket if tracked else None):
                self.session_db.append_message(session_id=session_id, **kwargs)
        except sqlite3.IntegrityError as exc:
            if "FOREIGN KEY" not in str(exc):
                raise
            if not self.create_missing:
                raise SessionMissing(session_id) from exc
        else:
            return
        # The failed insert wrote nothing, so creating the session and writing
        # again cannot duplicate the message.
        log.warning("creating missing session %s in state.db for replayed messages", session_id)
        create = getattr(self.session_db, "ensure_session", None) or self.session_db.create_session
        create(session_id, source=CREATED_SOURCE)
        with self._ticket(ticket if tracked else None):
            self.session_db.append_message(session_id=session_id, **kwargs)

    def landed(self, tickets: Sequence[Ticket]) -> set[Ticket] | None:
        """The given tickets whose messages are committed in state.db (exact)."""
        conn, lock = _private_connection(self.session_db)
        if conn is None or lock is None:
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
    def _ticket(self, ticket: Ticket | None) -> Iterator[None]:
        """Make ``ticket`` the one this thread's next inserts record."""
        if ticket is None:
            yield
            return
        prune = self._prune if self._prune is not None and self._prune[0] == ticket[0] else None
        _thread.parts = (*ticket, *(prune[1:] if prune else (None, "[]")))
        try:
            yield
        finally:
            _thread.parts = None
        if prune is not None and self._prune is prune:
            self._prune = None

    def _prepare(self) -> bool:
        """Set up ticket recording on SessionDB's connection; False for a look-alike."""
        conn, lock = _private_connection(self.session_db)
        if conn is None or lock is None:
            return False
        if conn is self._prepared:
            return True
        with lock:
            exists = conn.execute(LANDED_TABLE_EXISTS_SQL, (LANDED_TABLE,)).fetchone()
        if not exists:
            self.session_db._execute_write(lambda c: c.execute(CREATE_LANDED_TABLE_SQL))
        with lock:
            conn.create_function("walspool_ticket", 1, _ticket_part)
            conn.execute(TICKET_TRIGGER_SQL)
        self._prepared = conn
        return True

    def _filter(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if self._accepted is None:
            return kwargs
        return {k: v for k, v in kwargs.items() if k in self._accepted}

    def __repr__(self) -> str:
        return f"SessionDBSink({self.session_db!r}, create_missing={self.create_missing})"


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


def append_kwargs(record: Record) -> dict[str, Any]:
    """The ``append_message`` keywords for a spooled record, as the gateway maps them.

    A dict is a transcript message, mapped as 0.19.0's
    ``SessionStore._append_transcript_message`` does: ``role`` (default
    "unknown"), ``content``, ``tool_name``, ``tool_calls``, ``tool_call_id``, the
    reasoning and codex fields only for assistant rows, ``platform_message_id``
    falling back to ``message_id``, ``observed`` as a bool, and ``api_content``
    only when it is a string. A dict with ``text`` but neither ``role`` nor
    ``content`` (a platform ``MessageEvent`` as the spool stores it) and a str (a
    runner's pending slot) become a user message of that text; any other value
    becomes a user message of its JSON text. ``timestamp`` is always a float: the
    message's own (a number, numeric text, or ISO 8601 text, which is how the spool
    stores a datetime), else the time the record was spooled.
    """
    message = record.message
    if isinstance(message, dict) and (
        "role" in message or "content" in message or "text" not in message
    ):
        role = message.get("role", "unknown")
        assistant = role == "assistant"
        api_content = message.get("api_content")
        kwargs: dict[str, Any] = {
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


def _private_connection(session_db: Any) -> tuple[Any, Any]:
    """``SessionDB``'s own connection and lock, for a cheap read; (None, None) if absent."""
    conn = getattr(session_db, "_conn", None)
    lock = getattr(session_db, "_lock", None)
    if isinstance(conn, sqlite3.Connection) and hasattr(lock, "__enter__"):
        return conn, lock
    return None, None
