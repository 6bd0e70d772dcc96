"""The background thread's schedule, kept as sessions change: which session is due (the
one longest due) and when to look next, as ``machine.pick_due`` answers it from every
session, found in O(log n) of the sessions a look does not touch.

Two heaps of the sessions the background thread may take (nobody holds them, no
thread waits on them, none of their hand-offs is in flight, they have work), each by
its ``retry_at``: those that wait for an outage's probe (``machine.Candidate.failing``)
and the others. A heap's top is the soonest of its kind, whatever ``probe_at`` is, so a
look reads two tops.

An entry is checked against the session when it reaches a top: one whose session
changed since (taken, given work, backed off later, forgotten) is placed again or
dropped there. What a look cannot find that way is a session that became due sooner,
or could be taken, while its entry lay below a top, or while it had none: every event
that can do that touches the session (``touch``: a release, an eviction, a hand-off
settled, a rewrite, a recovery, a wake, a thread that stopped waiting on it), and the
next look places it again. The link's tests check each look against
``machine.pick_due`` of every session when ``WALSPOOL_CHECK_DUE`` is set.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Mapping
from typing import Any

from .machine import Owner, due_at

#: A session's facts as ``machine.Candidate`` orders them (a plain tuple).
Facts = tuple[Owner, bool, float, bool, bool, bool]
#: A heap entry: retry_at, a tie-breaker (placing order), the session's id, its state
#: object (a forgotten session's id may come back with another), and its kind.
_Entry = tuple[float, int, str, Any, bool]


class DueBook:
    """The schedule of one link's background thread; guarded by the store's lock.
    Once ``closed`` (its thread ended) touches are not kept."""

    __slots__ = ("_facts", "_touched", "_heaps", "_entries", "_order", "closed")

    def __init__(self) -> None:
        #: ``facts(session_id, state)``: a session's ``machine.Candidate`` fields now
        #: (given to each ``pick``, not kept: the book holds no reference to the link).
        self._facts: Callable[[str, Any], Facts] = _no_facts
        self.closed = False
        #: Sessions an event may have made due sooner since the last look.
        self._touched: set[str] = set()
        #: [others, those waiting for the probe].
        self._heaps: tuple[list[_Entry], list[_Entry]] = ([], [])
        #: Each placed session's one live entry (others in the heaps are stale).
        self._entries: dict[str, _Entry] = {}
        self._order = itertools.count()

    def touch(self, session_id: str) -> None:
        """An event may have made the session due sooner, or free to take."""
        if not self.closed:
            self._touched.add(session_id)

    def forget(self, session_id: str) -> None:
        """The link forgot the session (nothing refers to it): so does the book, so
        that what it keeps is bounded by the sessions the link holds, whether a look
        comes or not (a link without a background thread never looks)."""
        self._touched.discard(session_id)
        self._entries.pop(session_id, None)

    def close(self) -> None:
        """No look comes any more (the link has no background thread, or it ended):
        what the book holds goes, and touches are not kept."""
        self.closed = True
        self._touched = set()
        self._heaps = ([], [])
        self._entries = {}

    def __len__(self) -> int:
        """Sessions placed (those the background thread may take, or did at their last look)."""
        return len(self._entries)

    def held(self) -> int:
        """Entries the heaps hold, stale ones included: each at most 65 + twice ``len``."""
        return sum(len(heap) for heap in self._heaps)

    def pick(
        self,
        sessions: Mapping[str, Any],
        facts: Callable[[str, Any], Facts],
        now: float,
        probe_at: float | None,
    ) -> tuple[str | None, float | None]:
        """``machine.pick_due`` of ``sessions`` (session id -> state, ``facts`` giving
        each one's ``Candidate`` fields): the session longest due and ``now``, or None
        and when one will be (None: none will)."""
        self._facts = facts
        try:
            return self._pick(sessions, now, probe_at)
        finally:
            self._facts = _no_facts

    def _pick(
        self, sessions: Mapping[str, Any], now: float, probe_at: float | None
    ) -> tuple[str | None, float | None]:
        touched, self._touched = self._touched, set()
        for session_id in touched:
            self._place(session_id, sessions.get(session_id))
        due: _Entry | None = None
        later: float | None = None
        for failing, heap in enumerate(self._heaps):
            top = self._top(heap, bool(failing), sessions)
            if top is None:
                continue
            at = due_at(top[0], bool(failing), probe_at)
            if at > now:
                if later is None or at < later:
                    later = at
            elif due is None or top[0] < due[0]:
                due = top
        if due is None:
            return None, later
        return due[2], now

    def _place(self, session_id: str, state: Any) -> None:
        """Enter the session as it is now, if the background thread may take it."""
        if state is None:
            self._entries.pop(session_id, None)
            return
        owner, waiters, retry_at, failing, unconfirmed, has_work = self._facts(session_id, state)
        if owner is not Owner.NOBODY or waiters or unconfirmed or not has_work:
            self._entries.pop(session_id, None)
            return
        entry = self._entries.get(session_id)
        if entry is not None and entry[0] == retry_at and entry[3] is state and entry[4] == failing:
            return
        entry = (retry_at, next(self._order), session_id, state, failing)
        self._entries[session_id] = entry
        heap = self._heaps[failing]
        heapq.heappush(heap, entry)
        if len(heap) > 64 + 2 * len(self._entries):  # mostly stale: rebuild it
            heap[:] = [e for e in heap if self._entries.get(e[2]) is e]
            heapq.heapify(heap)

    def _top(self, heap: list[_Entry], failing: bool, sessions: Mapping[str, Any]) -> _Entry | None:
        """The heap's soonest entry that holds for its session now; the others on the
        way are dropped or placed again."""
        while heap:
            entry = heap[0]
            session_id, state = entry[2], entry[3]
            if self._entries.get(session_id) is not entry:
                heapq.heappop(heap)
                continue
            current = sessions.get(session_id)
            if current is state:
                owner, waiters, retry_at, now_failing, unconfirmed, has_work = self._facts(
                    session_id, state
                )
                if (
                    owner is Owner.NOBODY
                    and not waiters
                    and not unconfirmed
                    and has_work
                    and retry_at == entry[0]
                    and now_failing == failing
                ):
                    return entry
            heapq.heappop(heap)
            del self._entries[session_id]
            self._place(session_id, current)
        return None


def _no_facts(session_id: str, state: Any) -> Facts:
    raise RuntimeError("DueBook reads a session's facts only within pick")
