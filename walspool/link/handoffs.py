"""Rows handed to the spool's writer and not committed yet: the one account both gateway
paths keep of them (the 0.19.0 link's evictions and stop flushes; the drop-in's
evictions, diverts and hand-overs on 0.20 and 0.22).

The promise it serves: a drain of a session sees every row of the session handed off
before it. The drain waits, bounded, for the session's hand-offs to commit before it
reads the spool (``wait``), counts those still in flight as remaining (``pending``),
and a session is drained only when none is left. A hand-off that fails after a
rewrite of its session came would have been superseded in the spool: it is neither
kept nor reported as lost (``rewritten``, ``superseded``).

Every method is called with the lock of the account's condition held (the link's
store lock, or the drop-in's own); ``wait`` releases it while it waits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

from . import bounds


class HandOffs:
    """Per key (a session, or a spool and a session): rows handed to the spool's writer
    and not settled (committed or failed) yet, and how many of those came before the
    key's last rewrite. The writer settles a key's hand-offs in the order they came."""

    __slots__ = ("condition", "_pending", "_superseded")

    def __init__(self, condition: threading.Condition) -> None:
        #: Notified when a key's last pending hand-off settles, and at a rewrite.
        self.condition = condition
        self._pending: dict[Hashable, int] = {}
        self._superseded: dict[Hashable, int] = {}

    def handed(self, key: Hashable) -> None:
        """A row of ``key`` was handed to the spool's writer."""
        self._pending[key] = self._pending.get(key, 0) + 1

    def settled(self, key: Hashable) -> bool:
        """The oldest pending hand-off of ``key`` committed or failed; whether none is
        left (then its waiters are woken)."""
        left = self._pending.get(key, 0) - 1
        superseded = self._superseded.pop(key, 0) - 1
        if superseded > 0:
            self._superseded[key] = superseded
        if left > 0:
            self._pending[key] = left
            return False
        self._pending.pop(key, None)
        self.condition.notify_all()
        return True

    def pending(self, key: Hashable) -> int:
        """Rows of ``key`` handed off and not settled yet."""
        return self._pending.get(key, 0)

    def rewritten(self, key: Hashable) -> None:
        """``key``'s transcript was rewritten: its pending hand-offs are superseded
        (its waiters are woken to read it)."""
        pending = self._pending.get(key, 0)
        if pending:
            self._superseded[key] = pending
        else:
            self._superseded.pop(key, None)
        self.condition.notify_all()

    def counts(self, key: Hashable) -> tuple[int, int]:
        """``key``'s pending hand-offs, and how many of them came before its last
        rewrite."""
        return self._pending.get(key, 0), self._superseded.get(key, 0)

    def superseded(self, key: Hashable) -> bool:
        """Whether the next hand-off of ``key`` to settle came before its last rewrite."""
        return self._superseded.get(key, 0) > 0

    def wait(
        self,
        key: Hashable,
        seconds: float,
        busy: Callable[[], bool],
        clock: Callable[[], float],
    ) -> bool:
        """Wait at most ``seconds`` (on ``clock``) until ``key`` has no pending hand-off,
        and not at all once ``busy()`` (the spool's write lock held elsewhere: its
        writer may wait long, and a busy lock notifies nobody, so it is looked at
        every ``bounds.BUSY_LOOK_SECONDS``); whether none is pending."""
        deadline = clock() + seconds
        while self._pending.get(key, 0) and not busy():
            left = deadline - clock()
            if left <= 0:
                break
            self.condition.wait(min(left, bounds.BUSY_LOOK_SECONDS))
        return not self._pending.get(key, 0)
