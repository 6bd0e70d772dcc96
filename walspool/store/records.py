"""The values walspool hands back: receipts, records and statistics.

All are frozen msgspec Structs. New fields are only ever appended, with defaults.
"""

from __future__ import annotations

from typing import Any

import msgspec

#: A message the gateway's pending queue evicted at its cap.
CAP_DROP = "transcript_cap_drop"
#: A message still pending when the gateway shut down.
SHUTDOWN = "shutdown"
#: An agent's history that was never flushed; for operators, not replayed by default.
AGENT_HISTORY = "shutdown-with-unpersisted-agent-history"
#: The reasons walspool's own callers append with.
REASONS = frozenset((CAP_DROP, SHUTDOWN, AGENT_HISTORY))

#: ``Record.status`` of a row kept for operators because the sink refused its
#: content, or because whether its write landed cannot be known; replayed only when
#: asked for (``replay(quarantined=True)``, ``walspool replay --quarantined``).
QUARANTINED = "quarantined"
#: ``Record.status`` of a row the gateway's transcript rewrite (/retry, /undo,
#: /compress) made obsolete; replayed only when asked for (``superseded=True``).
SUPERSEDED = "superseded"


def slot_message(value: Any) -> Any:
    """A pending slot's value as spooled: text as ``{"text": ...}``, events as they are."""
    return {"text": value} if isinstance(value, str) else value


def agent_history_message(session_id: str | None, history: list[Any]) -> dict[str, Any]:
    """The one row an agent's unpersisted history is spooled as (``AGENT_HISTORY``)."""
    return {"session_id": session_id, "count": len(history), "messages": history}


class Receipt(msgspec.Struct, frozen=True):
    """Proof that one message is committed to the spool."""

    id: int
    session_id: str | None
    seq: int
    reason: str
    session_key: str | None
    created_at: float


class Record(msgspec.Struct, frozen=True):
    """One spooled message as read back; ``message`` is the decoded payload."""

    id: int
    session_id: str | None
    seq: int
    reason: str
    session_key: str | None
    created_at: float
    message: Any
    attempts: int
    last_error: str | None
    last_attempt_at: float | None = None
    #: None for a replayable row, else ``QUARANTINED`` or ``SUPERSEDED``.
    status: str | None = None


class Stats(msgspec.Struct, frozen=True):
    """A summary of what a spool holds."""

    rows: int
    sessions: int
    bytes: int
    oldest: float | None
    newest: float | None
    by_reason: dict[str, int]
    failing: int
    db_bytes: int
    wal_bytes: int
    #: Payload bytes by reason (``by_reason`` counts the rows).
    bytes_by_reason: dict[str, int] = msgspec.field(default_factory=dict)
