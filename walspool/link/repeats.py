"""The gateway link's repeated conditions, told in a few lines: a session's spool busy
(its oldest message stays in memory), its evictions dropped, its spooled rows replayed.

Each condition of each session (a key) is said at its first occurrence, then at most
once per ``REPEAT_SECONDS`` with the count since its last line, and once when it ends
(its heal), with the count not said yet. Every occurrence is counted in exactly one
line. A condition that comes and goes faster than that (a spool writer's queue full
now and then) is said no more often: a heal within ``REPEAT_SECONDS`` of the key's last
line waits for that time (``due``), and the condition coming back meanwhile only goes
on counting.

Pure bookkeeping: time is an argument (the link's clock), the link's lock guards it,
and each method returns what to say (``Said``), which the link logs once the lock is
released.

Not guaranteed: a line that is due is said at the link's next use (a message, a
commit, a drain: see ``due``) or at ``close`` (``flush``), not by a timer.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from typing import NamedTuple

#: Seconds between two lines of one condition of one session.
REPEAT_SECONDS = 60.0


class Kind(enum.Enum):
    FIRST = "first"  # the condition began: said at once, in full
    AGAIN = "again"  # a summary: the occurrences since the key's last line
    ENDED = "ended"  # the heal: the occurrences not said yet


class Said(NamedTuple):
    """A line to log for ``key``."""

    kind: Kind
    #: Occurrences this line tells of: since the key's last line (the first: 1 or its count).
    count: int
    #: Occurrences since the condition began.
    total: int
    #: Seconds from its beginning to now (to its heal, for ``ENDED``).
    seconds: float
    #: The detail of its latest occurrence (why a message was dropped), if any.
    detail: str | None


class _Condition:
    __slots__ = ("began", "said_at", "unsaid", "total", "on", "ended_at", "detail")

    def __init__(self, now: float, count: int, detail: str | None) -> None:
        self.began = now
        self.said_at = now
        self.unsaid = 0
        self.total = count
        self.on = True
        self.ended_at = now
        self.detail = detail


class Repeats:
    """The tallies of the conditions going on (or whose heal is not said yet)."""

    def __init__(self, interval: float = REPEAT_SECONDS) -> None:
        self.interval = interval
        self._tallies: dict[Hashable, _Condition] = {}
        #: The soonest time a held line is due (None: none is held).
        self._due_at: float | None = None

    def seen(
        self, key: Hashable, now: float, count: int = 1, detail: str | None = None
    ) -> Said | None:
        """``count`` occurrences of ``key``'s condition at ``now``: the first line, a
        summary once ``interval`` has passed since the key's last line, else None (they
        are counted for the next line)."""
        tally = self._tallies.get(key)
        if tally is None:
            self._tallies[key] = _Condition(now, count, detail)
            return Said(Kind.FIRST, count, count, 0.0, detail)
        # Back on before its heal was said: the heal is not said, the count goes on.
        tally.on = True
        tally.unsaid += count
        tally.total += count
        if detail is not None:
            tally.detail = detail
        if now < tally.said_at + self.interval:
            self._hold(tally.said_at + self.interval)
            return None
        return self._say(tally, Kind.AGAIN, now)

    def ended(self, key: Hashable, now: float, *, at_once: bool = False) -> Said | None:
        """``key``'s condition is over: its heal, with the occurrences not said yet;
        None if it was not going on, or if a line of it was said less than ``interval``
        ago (then ``due`` says the heal, unless it comes back first). With ``at_once``
        (a condition that cannot come and go quickly), the heal is said now."""
        tally = self._tallies.get(key)
        if tally is None or not tally.on:
            return None
        tally.on = False
        tally.ended_at = now
        if at_once or now >= tally.said_at + self.interval:
            del self._tallies[key]
            return self._said(tally, Kind.ENDED, now)
        self._hold(tally.said_at + self.interval)
        return None

    @property
    def active(self) -> bool:
        """Whether any condition is going on or has a line held back."""
        return bool(self._tallies)

    @property
    def holding(self) -> bool:
        """Whether a line is held back (``due`` has something to say at some time)."""
        return self._due_at is not None

    def going_on(self, key: Hashable) -> bool:
        """Whether ``key``'s condition is going on (seen and not ended)."""
        tally = self._tallies.get(key)
        return tally is not None and tally.on

    def due(self, now: float) -> list[tuple[Hashable, Said]]:
        """The lines held back whose time has come: heals, and the summaries of
        conditions going on that had no occurrence since their time came. Cheap when
        none is due (one comparison)."""
        if self._due_at is None or now < self._due_at:
            return []
        self._due_at = None
        lines: list[tuple[Hashable, Said]] = []
        for key, tally in list(self._tallies.items()):
            held = tally.unsaid or not tally.on
            if not held:
                continue
            if now < tally.said_at + self.interval:
                self._hold(tally.said_at + self.interval)
                continue
            if tally.on:
                lines.append((key, self._say(tally, Kind.AGAIN, now)))
            else:
                del self._tallies[key]
                lines.append((key, self._said(tally, Kind.ENDED, tally.ended_at)))
        return lines

    def flush(self, now: float) -> list[tuple[Hashable, Said]]:
        """Every line held back, said now whatever the interval (the link's ``close``):
        heals, and a summary of each condition going on with occurrences not said."""
        lines: list[tuple[Hashable, Said]] = []
        for key, tally in list(self._tallies.items()):
            if not tally.on:
                del self._tallies[key]
                lines.append((key, self._said(tally, Kind.ENDED, tally.ended_at)))
            elif tally.unsaid:
                lines.append((key, self._say(tally, Kind.AGAIN, now)))
        self._due_at = None
        return lines

    def _hold(self, at: float) -> None:
        if self._due_at is None or at < self._due_at:
            self._due_at = at

    def _say(self, tally: _Condition, kind: Kind, now: float) -> Said:
        said = self._said(tally, kind, now)
        tally.said_at = now
        tally.unsaid = 0
        return said

    @staticmethod
    def _said(tally: _Condition, kind: Kind, at: float) -> Said:
        return Said(kind, tally.unsaid, tally.total, at - tally.began, tally.detail)
