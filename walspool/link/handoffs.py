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
from collections import deque
from collections.abc import Callable, Hashable

from . import bounds


class HandOffs:
    """Per key (a session, or a spool and a session): rows handed to the spool's writer
    and not settled (committed or failed) yet, each known by the token ``handed``
    returned, and the last token handed before the key's last rewrite. A settle names
    its token, or settles the key's oldest (the 0.19.0 link's writer settles a key's
    hand-offs in the order they came); the drop-in's two paths can settle out of order."""

    __slots__ = ("condition", "_pending", "_rewritten_at", "_next")

    def __init__(self, condition: threading.Condition) -> None:
        #: Notified when a key's last pending hand-off settles, and at a rewrite.
        self.condition = condition
        #: A key's pending tokens, oldest first.
        self._pending: dict[Hashable, deque[int]] = {}
        #: A key's last token handed before its last rewrite: that one and those
        #: before it are superseded. Kept only while the key has a pending hand-off.
        self._rewritten_at: dict[Hashable, int] = {}
        self._next = 0

    def handed(self, key: Hashable) -> int:
        """A row of ``key`` was handed to the spool's writer; its token."""
        token = self._next
        self._next += 1
        tokens = self._pending.get(key)
        if tokens is None:
            self._pending[key] = deque((token,))
        else:
            tokens.append(token)
        return token

    def settled(self, key: Hashable, token: int | None = None) -> bool:
        """The hand-off ``token`` of ``key`` (its oldest when None) committed or
        failed; whether none is left (then its waiters are woken)."""
        tokens = self._pending.get(key)
        if not tokens:  # nothing handed off: none left
            self.condition.notify_all()
            return True
        if token is None or token == tokens[0]:
            tokens.popleft()
        else:
            tokens.remove(token)
        if tokens:
            return False
        del self._pending[key]
        self._rewritten_at.pop(key, None)
        self.condition.notify_all()
        return True

    def pending(self, key: Hashable) -> int:
        """Rows of ``key`` handed off and not settled yet."""
        tokens = self._pending.get(key)
        return len(tokens) if tokens is not None else 0

    def rewritten(self, key: Hashable) -> None:
        """``key``'s transcript was rewritten: its pending hand-offs are superseded
        (its waiters are woken to read it)."""
        tokens = self._pending.get(key)
        if tokens:
            self._rewritten_at[key] = tokens[-1]
        self.condition.notify_all()

    def counts(self, key: Hashable) -> tuple[int, int]:
        """``key``'s pending hand-offs, and how many of them came before its last
        rewrite."""
        tokens = self._pending.get(key, ())
        mark = self._rewritten_at.get(key, -1)
        return len(tokens), sum(1 for token in tokens if token <= mark)

    def superseded(self, key: Hashable, token: int | None = None) -> bool:
        """Whether the hand-off ``token`` of ``key`` (its oldest pending when None)
        came before the key's last rewrite."""
        if token is None:
            tokens = self._pending.get(key)
            if not tokens:
                return False
            token = tokens[0]
        return token <= self._rewritten_at.get(key, -1)

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
