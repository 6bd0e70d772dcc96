"""The gateway link's lines for a session's repeated conditions (a busy spool, drops,
a message it cannot spool, replays): each said in full the first time, then counted
into a line at most every ``REPEAT_SECONDS`` (``walspool.link.repeats``). Each method
returns the lines to log once the store's lock is released; it is held when they are
called.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from .core import Core
from .outage import LogLine
from .repeats import Kind, Said
from .state import log

#: The link's repeated conditions of a session (``walspool.link.repeats``), each told in
#: a few lines: its spool busy (the oldest message stays in memory), its evictions
#: dropped, its oldest message not spoolable, its spooled rows replayed.
KEPT, DROPPED, UNSPOOLABLE, REPLAYED = "kept", "dropped", "unspoolable", "replayed"
#: The summary lines of a session's repeated conditions (but replays), by condition and
#: whether it goes on (a summary of the occurrences since the last line) or has ended:
#: their level and text. Fields: the session, the cap and twice it (``limit``), the
#: spool's ``path``, the occurrences since the last line (``count``) and since the
#: condition began (``total``) in ``seconds``, and the latest one's ``detail``.
REPEAT_LINES: dict[tuple[str, bool], tuple[int, str]] = {
    (DROPPED, True): (
        logging.WARNING,
        "Session DB transcript pending queue full for %(session)s (cap=%(cap)d); dropped "
        "%(count)d more oldest message(s) (%(total)d in %(seconds).0f s; on-disk spool "
        "unavailable: %(detail)s)",
    ),
    (DROPPED, False): (
        logging.WARNING,
        "Session DB transcript of %(session)s: the spool %(path)s takes its evictions again; "
        "%(total)d oldest message(s) were dropped in %(seconds).1f s (%(count)d not said "
        "before)",
    ),
    (KEPT, True): (
        logging.WARNING,
        "Session DB transcript pending queue full for %(session)s (cap=%(cap)d); the spool "
        "%(path)s is still busy: the oldest message was kept in memory %(count)d more "
        "time(s) (%(total)d in %(seconds).0f s; the oldest is dropped past %(limit)d)",
    ),
    (KEPT, False): (
        logging.WARNING,
        "Session DB transcript pending queue of %(session)s is back within its cap "
        "(%(cap)d): the oldest message was kept in memory %(total)d time(s) in "
        "%(seconds).1f s while the spool %(path)s was busy (%(count)d not said before)",
    ),
    (UNSPOOLABLE, True): (
        logging.ERROR,
        "walspool still could not spool the oldest queued message of session %(session)s; "
        "it stays in memory (%(count)d more time(s), %(total)d in %(seconds).0f s): "
        "%(detail)s",
    ),
    (UNSPOOLABLE, False): (
        logging.WARNING,
        "The queue of session %(session)s no longer holds a message walspool could not "
        "spool over the cap: its oldest could not be spooled %(total)d time(s) in "
        "%(seconds).1f s (%(count)d not said before)",
    ),
}
#: The INFO lines of a session's spooled rows replayed, by ``Kind``: the first chunk,
#: a summary of the chunks since the last line, and the end (said only if it has
#: rows not said yet). Fields as in ``REPEAT_LINES``.
REPLAYED_LINES: dict[Kind, str] = {
    Kind.FIRST: (
        "Replayed %(count)d spooled transcript message(s) for %(session)s after DB recovery"
    ),
    Kind.AGAIN: (
        "Replayed %(count)d more spooled transcript message(s) for %(session)s after DB "
        "recovery (%(total)d in %(seconds).0f s)"
    ),
    Kind.ENDED: (
        "Replayed %(count)d more spooled transcript message(s) for %(session)s after DB "
        "recovery (%(total)d in all, in %(seconds).1f s)"
    ),
}


class Lines:
    """The link's lines of repeated conditions, one per session and condition."""

    def __init__(self, core: Core) -> None:
        self.core = core

    def dropped(self, session_id: str, why: str, *, own: bool = False) -> list[LogLine]:
        """The oldest message of the session was dropped: its first drop said in full,
        then a summary at most every ``REPEAT_SECONDS``; ``own`` (the message's own
        fault, ``OWN_FAULT``) is said each time."""
        if own:
            return [partial(self.report_drop, session_id, why)]
        said = self.core.repeats.seen((DROPPED, session_id), self.core.clock(), detail=why)
        return [] if said is None else [self.line((DROPPED, session_id), said)]

    def kept(self, session_id: str, queued: int) -> list[LogLine]:
        said = self.core.repeats.seen((KEPT, session_id), self.core.clock())
        if said is None:
            return []
        if said.kind is Kind.FIRST:
            return [partial(self._report_kept, session_id, queued)]
        return [self.line((KEPT, session_id), said)]

    def unspoolable(self, session_id: str, exc: BaseException) -> list[LogLine]:
        said = self.core.repeats.seen(
            (UNSPOOLABLE, session_id), self.core.clock(), detail=repr(exc)
        )
        if said is None:
            return []
        if said.kind is Kind.FIRST:
            return [partial(report_unspoolable, session_id, exc)]
        return [self.line((UNSPOOLABLE, session_id), said)]

    def ended(self, session_id: str, conditions: tuple[str, ...]) -> list[LogLine]:
        """The session's ``conditions`` are over: their heals (held back while a line of
        theirs is recent: see ``Repeats.ended``)."""
        if not self.core.repeats.active:
            return []
        now = self.core.clock()
        lines = []
        for condition in conditions:
            said = self.core.repeats.ended((condition, session_id), now)
            if said is not None:
                lines.append(self.line((condition, session_id), said))
        return lines

    def due(self) -> list[LogLine]:
        """The held-back lines whose time has come (one comparison when none is)."""
        if not self.core.repeats.holding:
            return []
        return [self.line(key, said) for key, said in self.core.repeats.due(self.core.clock())]

    def line(self, key: Any, said: Said) -> LogLine:
        """The line that tells ``said`` of ``key`` (a condition and a session)."""
        condition, session_id = key
        if condition == REPLAYED:
            return partial(self._report_replayed, session_id, said)
        if said.kind is Kind.FIRST and condition == DROPPED:
            return partial(self.report_drop, session_id, said.detail or "")
        return partial(self._report_repeat, condition, session_id, said)

    def _report_repeat(self, condition: str, session_id: str, said: Said) -> None:
        say_repeat(log, condition, session_id, said, cap=self.core.cap, path=self.core.spool.path)

    def _report_replayed(self, session_id: str, said: Said) -> None:
        if said.kind is Kind.ENDED and not said.count:
            return
        fields = {
            "session": session_id,
            "count": said.count,
            "total": said.total,
            "seconds": said.seconds,
        }
        log.info(REPLAYED_LINES[said.kind], fields)

    def report_drop(self, session_id: str, why: str) -> None:
        say_drop(log, session_id, why, cap=self.core.cap)

    def _report_kept(self, session_id: str, queued: int) -> None:
        log.warning(
            "Session DB transcript pending queue full for %s (cap=%d); the spool %s is busy, "
            "so the oldest message stays in memory (%d queued; the oldest is dropped past %d)",
            session_id,
            self.core.cap,
            self.core.spool.path,
            queued,
            2 * self.core.cap,
        )


def say_drop(logger: logging.Logger, session_id: str, why: str, *, cap: int) -> None:
    """A session's oldest message dropped (the first of a condition, or one the message's
    own fault), in every gateway's words."""
    logger.warning(
        "Session DB transcript pending queue full for %s (cap=%d); dropping oldest "
        "message to make room (on-disk spool unavailable: %s)",
        session_id,
        cap,
        why,
    )


def say_repeat(
    logger: logging.Logger, condition: str, session_id: str, said: Said, *, cap: int, path: Any
) -> None:
    """A summary or the heal of a session's repeated ``condition`` (``REPEAT_LINES``);
    for ``DROPPED`` the first occurrence too (``say_drop``)."""
    if said.kind is Kind.FIRST and condition == DROPPED:
        say_drop(logger, session_id, said.detail or "", cap=cap)
        return
    level, line = REPEAT_LINES[condition, said.kind is Kind.AGAIN]
    fields = {
        "session": session_id,
        "cap": cap,
        "path": path,
        "count": said.count,
        "total": said.total,
        "seconds": said.seconds,
        "detail": said.detail,
        "limit": 2 * cap,
    }
    logger.log(level, line, fields)


def report_unspoolable(session_id: str, exc: BaseException) -> None:
    """The session's oldest queued message could not be spooled (a bad value)."""
    log.error(
        "walspool could not spool the oldest queued message of session %s; it stays in memory: %s",
        session_id,
        repr(exc),  # formatted here: the log filter makes every argument text first
    )
