"""The gateway link's state for one session, and the claim on its writer role.

Both are plain records guarded by the store's lock; what the writer does next with
them is decided by ``walspool._link_machine``.
"""

from __future__ import annotations

from typing import Any

from . import outage, text
from ._link_machine import Owner

#: The link's one logger, for every module of it (operators filter on this name).
log = text.logger("walspool.hermes")


class Writer:
    """A claim on a session's writer role: only the holder of this object may write
    the session or give the role up (so a stale thread can never release a newer
    writer's claim)."""

    __slots__ = ("background",)

    def __init__(self, background: bool) -> None:
        #: Held by the link's background thread (a gateway thread may take it over).
        self.background = background

    @property
    def owner(self) -> Owner:
        return Owner.BACKGROUND if self.background else Owner.GATEWAY


class Session:
    """The link's state for one session; every field is guarded by the store's lock."""

    __slots__ = (
        "writer",
        "inflight",
        "spooled",
        "unconfirmed",
        "retry_at",
        "hold_until",
        "failures",
        "generation",
        "waiters",
        "episode",
        "said_at",
    )

    def __init__(self, spooled: int) -> None:
        #: The current writer's claim, or None: the session has no writer.
        self.writer: Writer | None = None
        #: The queued message being written to state.db right now, if any.
        self.inflight: dict[str, Any] | None = None
        #: Evictions (and shutdown flushes) since the session's spooled rows were last
        #: all written: while not 0 they go to state.db before its in-memory rows.
        self.spooled = spooled
        #: Evictions handed to the spool's writer and not yet committed (or failed).
        self.unconfirmed = 0
        #: ``time.monotonic()`` when the background thread retries after a failure.
        self.retry_at = 0.0
        #: Until then, after a failed drain, new messages only queue (and spool).
        self.hold_until = 0.0
        #: Failed attempts in a row, for the retry delay.
        self.failures = 0
        #: Bumped by a transcript rewrite: what a writer learned before it is stale.
        self.generation = 0
        #: Threads waiting on this object (a gateway thread taking over, a writer
        #: waiting for its evictions): it stays in ``Link._sessions`` meanwhile.
        self.waiters = 0
        #: Its spooling since its first eviction committed, for the operator's lines.
        self.episode: outage.Episode | None = None
        #: When a failed retry past ``outage.QUIET_AFTER`` was last logged.
        self.said_at = 0.0


def owner_of(state: Session) -> Owner:
    """Who holds the session's claim."""
    return Owner.NOBODY if state.writer is None else state.writer.owner
