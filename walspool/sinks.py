"""Sinks: where a replay writes spooled messages, and how it asks what already landed.

A sink's write is usually not idempotent (``SessionDB.append_message`` writes a
second row when called twice), so the replayer cannot simply retry after a crash.
Instead every sink offers a probe: before a batch is written the replayer takes the
sink's high-water ``mark()`` and records it on the rows it has out; after a crash it
asks ``landed(session_id, mark, records)`` how many of those rows the sink already
holds, deletes that many and writes the rest.
"""

from __future__ import annotations

import datetime
import inspect
import logging
import math
import sqlite3
from collections.abc import Iterable, Sequence
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
#: ``source`` of a session that ``create_missing=True`` creates.
CREATED_SOURCE = "walspool"

MARK_SQL = "SELECT coalesce(max(id), 0) FROM messages"
LANDED_SQL = "SELECT role, timestamp FROM messages WHERE session_id = ? AND id > ? ORDER BY id"


@runtime_checkable
class Sink(Protocol):
    """Where replayed messages go: a write, and a probe for writes a crash cut short.

    ``mark()`` returns an opaque high-water mark such that anything written after
    it can be found by ``landed``. ``write`` commits one message durably before it
    returns, or raises and writes nothing. ``landed`` returns how many of
    ``records`` (one session's rows, in seq order, written in that order after
    ``mark`` was taken, the writing stopping at the first failure) the sink holds.
    """

    def mark(self) -> int: ...

    def write(self, session_id: str, record: Record) -> None: ...

    def landed(self, session_id: str, mark: int, records: Sequence[Record]) -> int: ...


class SessionDBSink:
    """Writes messages into a ``hermes_state.SessionDB`` (0.19.0) or a look-alike.

    A message is mapped to ``append_message`` keywords exactly as the gateway's own
    ``SessionStore._append_transcript_message`` does (see ``append_kwargs``), and
    only keywords the installed ``append_message`` accepts are passed.

    The probe matches ``(role, timestamp)``. Each message is written with an
    explicit float timestamp (its own ``timestamp``, else the time it was spooled),
    so a landed row carries a value the replayer knows in advance. ``landed`` walks
    the session's rows with ``id`` greater than the mark, in id order, and matches
    the in-flight records against them as a subsequence, so rows other writers
    added to the session meanwhile are skipped.

    What the probe cannot tell apart: a row another writer added to the same
    session after the mark with the same role and the same timestamp as an
    in-flight record that never landed; that record is then taken as landed and
    leaves the spool without being written. Timestamps are floats with sub-
    microsecond resolution, so this needs the same message written twice, or two
    messages stamped with one explicit timestamp. A row that landed and was then
    deleted from state.db (a transcript rewrite) before recovery is not seen, and
    is written again. A look-alike without ``_conn``/``_lock`` is probed through
    ``get_messages`` with a mark of 0 (all of the session's rows), and one whose
    ``append_message`` takes no ``timestamp`` is probed on role alone; both widen
    the ambiguity above.
    """

    def __init__(self, session_db: Any, *, create_missing: bool = False) -> None:
        self.session_db = session_db
        self.create_missing = create_missing
        self._accepted = _accepted_keywords(session_db.append_message)
        self._keyed_by_timestamp = self._accepted is None or "timestamp" in self._accepted

    def mark(self) -> int:
        """The largest ``messages.id`` now: every later write gets a larger id."""
        conn, lock = _private_connection(self.session_db)
        if conn is None or lock is None:
            return 0
        with lock:
            return int(conn.execute(MARK_SQL).fetchone()[0])

    def write(self, session_id: str, record: Record) -> None:
        """Append one message to ``session_id``; committed when this returns.

        Raises ``SessionMissing`` when the session has no row and
        ``create_missing`` is off (with it, the session is created, source
        "walspool", and the write made once more), and ``NotAMessage`` for an
        agent history spooled as one row; any other error of ``append_message``
        (for instance ``database is locked`` after its own retries) propagates.
        """
        if _is_history(record.message):
            raise NotAMessage(record)
        kwargs = self._filter(append_kwargs(record))
        try:
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
        self.session_db.append_message(session_id=session_id, **kwargs)

    def landed(self, session_id: str, mark: int, records: Sequence[Record]) -> int:
        """How many of ``records`` (a prefix, in order) are in the session after ``mark``."""
        wanted = [self._key(append_kwargs(r)) for r in records]
        return _match_prefix(wanted, (self._key(row) for row in self._rows_after(session_id, mark)))

    def _filter(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if self._accepted is None:
            return kwargs
        return {k: v for k, v in kwargs.items() if k in self._accepted}

    def _key(self, row: Any) -> tuple[Any, ...]:
        if self._keyed_by_timestamp:
            return (row["role"], float(row["timestamp"]))
        return (row["role"],)

    def _rows_after(self, session_id: str, mark: int) -> list[Any]:
        conn, lock = _private_connection(self.session_db)
        if conn is not None and lock is not None:
            with lock:
                rows = conn.execute(LANDED_SQL, (session_id, mark)).fetchall()
            return [{"role": r[0], "timestamp": r[1]} for r in rows]
        try:
            rows = self.session_db.get_messages(session_id, include_inactive=True)
        except TypeError:
            rows = self.session_db.get_messages(session_id)
        return [r for r in rows if not isinstance(r.get("id"), int) or r["id"] > mark]

    def __repr__(self) -> str:
        return f"SessionDBSink({self.session_db!r}, create_missing={self.create_missing})"


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


def _match_prefix(wanted: Sequence[tuple[Any, ...]], found: Iterable[tuple[Any, ...]]) -> int:
    """Length of the longest prefix of ``wanted`` that occurs in ``found`` as a subsequence."""
    i = 0
    for key in found:
        if i == len(wanted):
            break
        if key == wanted[i]:
            i += 1
    return i


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
