"""What the gateway link tells an operator about an outage of ``state.db``.

A few lines per outage, not one per message: a WARNING when a session starts spooling
(with the spool's path, named once), one when its spooled rows are all written back
(counts and duration), a progress line at most every ``REPORT_SECONDS`` while it
spools, and one "outage over" line with the totals once no session has rows left.
Repeated retry failures are said for the first ``QUIET_AFTER`` in a row, then at most
every ``REPORT_SECONDS``. Lines name sessions and counts, never object reprs; errors
keep their detail.

Every method is called with the link's lock held and returns the lines to log once it
is released (``LogLine``s, run by the caller).

Not guaranteed: the counts are this process's; rows another process replays (the CLI,
a recovery) are not counted as replayed here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path

from .. import text
from ..replay.replayer import ReplayReport

log = text.logger("walspool.hermes")

#: Seconds between two progress lines (and two repeats of a retry failure) per session.
REPORT_SECONDS = 60.0
#: Failed retries in a row of one session logged each; after them, one per
#: ``REPORT_SECONDS`` (the retry delay reaches ``retry_interval`` at the fourth).
QUIET_AFTER = 4

LogLine = Callable[[], None]


class Episode:
    """One session's spooling: from its first eviction committed until its spooled
    rows are all written (or superseded)."""

    __slots__ = ("started", "spooled", "replayed", "next_report")

    def __init__(self, now: float) -> None:
        self.started = now
        self.spooled = 0
        self.replayed = 0
        self.next_report = now + REPORT_SECONDS


class OutageLog:
    """The link's outage lines; one per link."""

    def __init__(self, spool_path: Path, cap: int) -> None:
        self.spool_path = spool_path
        self.cap = cap
        #: Sessions spooling now; the outage is over when the last one drains.
        self.open = 0
        self.started = 0.0
        self.spooled = 0
        self.replayed = 0
        self.superseded = 0

    def evicted(
        self, session_id: str, episode: Episode | None, count: int, now: float
    ) -> tuple[Episode, list[LogLine]]:
        """``count`` evictions of a session committed; its episode (new if None)."""
        lines: list[LogLine] = []
        if episode is None:
            episode = Episode(now)
            if not self.open:
                self.started, self.spooled, self.replayed, self.superseded = now, 0, 0, 0
            self.open += 1
            lines.append(
                partial(
                    log.warning,
                    "Session DB transcript pending queue full for %s (cap=%d); spooling the "
                    "oldest messages to %s until state.db takes them (one line when it has "
                    "drained)",
                    session_id,
                    self.cap,
                    self.spool_path,
                )
            )
        episode.spooled += count
        self.spooled += count
        if now >= episode.next_report:
            episode.next_report = now + REPORT_SECONDS
            lines.append(
                partial(
                    log.warning,
                    "Session DB transcript of %s still spooling: %d message(s) spooled in "
                    "%.0f s, %d replayed so far",
                    session_id,
                    episode.spooled,
                    now - episode.started,
                    episode.replayed,
                )
            )
        return episode, lines

    def replayed_rows(self, episode: Episode | None, count: int) -> None:
        """A drain of the session moved ``count`` spooled rows into state.db."""
        if episode is not None:
            episode.replayed += count
            self.replayed += count

    def ended(
        self, session_id: str, episode: Episode | None, now: float, *, superseded: bool = False
    ) -> list[LogLine]:
        """The session has no spooled rows left: written back, or superseded by a
        transcript rewrite (whose own WARNING says how many)."""
        if episode is None:
            return []
        lines: list[LogLine] = []
        if superseded:
            self.superseded += max(episode.spooled - episode.replayed, 0)
        else:
            lines.append(
                partial(
                    log.warning,
                    "Session DB transcript of %s drained: %d message(s) spooled, %d replayed "
                    "into state.db in %.1f s",
                    session_id,
                    episode.spooled,
                    episode.replayed,
                    now - episode.started,
                )
            )
        self.open -= 1
        if not self.open:
            rewritten = f", {self.superseded} superseded by rewrites" if self.superseded else ""
            lines.append(
                partial(
                    log.warning,
                    "walspool: outage over: %d spooled, %d replayed%s in %.1f s",
                    self.spooled,
                    self.replayed,
                    rewritten,
                    now - self.started,
                )
            )
        return lines


def repeat_due(failures: int, last: float, now: float) -> bool:
    """Whether the ``failures``-th failed retry in a row is said: each of the first
    ``QUIET_AFTER``, then one per ``REPORT_SECONDS`` (``last``: when one was last said
    after those)."""
    return failures <= QUIET_AFTER or now >= last + REPORT_SECONDS


def say_left_to_running_replay(spool: Path, held: int, logger: logging.Logger) -> None:
    """A start that found another replay of the spool running (an operator's
    ``walspool replay``, another gateway's start) left the rows to it, said by every
    gateway's path: ``held`` sessions drain theirs before their next message."""
    logger.warning(
        "Another replay of %s is running; %d session(s) will drain their spooled rows "
        "before their next message",
        spool,
        held,
    )


def say_recovered(
    report: ReplayReport, spool: Path, recovered: str, logger: logging.Logger
) -> None:
    """What a start's recovery (a replay of everything spooled) did, said to the
    operator by every gateway's path: ``recovered`` (its own words, with ``%d`` for the
    rows moved and ``%s`` for the spool) at INFO; then the rows held back with each
    session's error (INFO: the next start or drain tries again), the session keys no
    routing knows (WARNING: they stay), and the rows quarantined (WARNING)."""
    if report.moved or report.recovered:
        logger.info(recovered, report.moved + report.recovered, spool)
    if report.held:
        logger.info(
            "Held back %d spooled message(s) for the next start after a failed replay: %s",
            report.held,
            ", ".join(
                [f"{k} ({v})" for k, v in report.errors.items()]
                + [f"key:{k} ({v})" for k, v in report.key_errors.items()]
            ),
        )
    unresolved = {
        key: stream.held for key, stream in report.keys.items() if stream.session_id is None
    }
    if unresolved:
        logger.warning(
            "%d spooled message(s) of %d session key(s) found no session in the gateway's "
            "routing table and stay in %s; each start tries again (a new message from that "
            "chat routes its key), `walspool ls` shows them as key:<KEY>, `walspool export "
            "--session key:<KEY>` gives their text: %s",
            sum(unresolved.values()),
            len(unresolved),
            spool,
            ", ".join(sorted(unresolved)),
        )
    if report.quarantined:
        logger.warning(
            "Quarantined %d spooled message(s) in %s that state.db refused; see `walspool ls`",
            report.quarantined,
            spool,
        )
