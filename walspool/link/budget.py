"""How much disk the gateway link may fill: a cap on the spool, with room kept for the
sessions that have spooled little.

The link spools what the released gateway would drop. Without a cap, one session
flooded during a long outage fills the disk; with a plain cap, it takes all of it and
every other session's evictions are then refused. So the cap counts what the spool
really takes (its pages in use, free pages left by replays not counted, plus its
``-wal`` file, which a reader holding a snapshot lets grow), and its last
``RESERVE`` share is kept for small sessions: once the spool is past
``1 - RESERVE`` of the cap, only a session whose share is less than ``SMALL`` of the
cap may still spool. The chatty session is refused first; the others keep their room
until the reserve itself is used up (at least ``RESERVE / SMALL`` = 10 small sessions'
worth). A refused eviction takes the released gateway's drop-and-warn path, with a
WARNING that names the reason.

A session's share (``Shares``) is the payload bytes its rows hold in the spool, whatever
their status (replayable, quarantined, superseded) and whichever run spooled them, plus
those of its evictions not yet committed. A transcript rewrite does not lower it (the
superseded rows stay on disk), nor does a restart (the link counts the spool once when
it starts); only rows leaving the spool do, as the link's own drains and recoveries
move them.

Why not a fixed share per session: the number of sessions is not known in advance,
and an equal share would refuse a long conversation while most of the disk is free.

Not guaranteed: rows removed by anything but this link (``walspool replay`` or
``drop``, another process, a hand edit) stay in their session's share until the next
start counts the spool again, as do rows this link drained while its start's count ran;
rows the shutdown hooks spool (pending slots, agent histories) count from the next
start. Until the start's count is done (on the link's background thread; 0.6 to 0.8 s
for a million rows), a session's share is what it spooled in this run. The size of a
row on disk is estimated by its payload (times ``ON_DISK``) until the spool's writer
measures the files after its next commit.
"""

from __future__ import annotations

#: The gateway link's default cap on the spool (``install(..., max_bytes=...)``).
DEFAULT_MAX_BYTES = 4 * 2**30
#: The share of the cap kept for sessions that have spooled little.
RESERVE = 0.10
#: A session that has spooled less than this share of the cap counts as small.
SMALL = 0.01
#: Disk bytes per payload byte of a row accepted and not yet committed: its database
#: pages and their ``-wal`` frames (about 1.5x each for a row of a few KB); the
#: writer measures the files again after each commit.
ON_DISK = 3


def refusal(
    max_bytes: int | None, footprint: int, unconfirmed: int, session_bytes: int, nbytes: int
) -> str | None:
    """Why an eviction of ``nbytes`` may not be spooled now, or None if it may.

    ``footprint``: what the spool took on disk after its last commit;
    ``unconfirmed``: payload bytes accepted since and not yet committed;
    ``session_bytes``: the evicting session's share (``Shares.of``).
    """
    if max_bytes is None:
        return None
    after = footprint + ON_DISK * (unconfirmed + nbytes)
    big = session_bytes > max_bytes * SMALL
    # A session that is big already is told it meets the reserve even past the cap
    # itself: which of the two its evictions meet first depends on how far the
    # writer's commits lag behind.
    if after > max_bytes and not big:
        return f"the spool is at the link's cap of {max_bytes} bytes"
    if after > max_bytes * (1 - RESERVE) and session_bytes + nbytes > max_bytes * SMALL:
        return (
            f"the last {RESERVE:.0%} of the link's cap of {max_bytes} bytes is kept for "
            f"sessions that spooled less than {SMALL:.0%} of it; this one holds "
            f"{session_bytes} bytes"
        )
    return None


class Shares:
    """Each session's share of the link's cap, in payload bytes: its rows in the spool
    plus its evictions not yet committed. Plain bookkeeping, guarded by the store's lock.

    The start's count (``load``) reads the spool once while the link already runs. It
    notes the largest row id it saw, and is applied only once every commit it may have
    seen has been reported here (``settled``). Commits reported before it is applied are
    kept with their row ids: those above the count's largest id came after it and are
    added to it. A drain reports the rows that left with the ``epoch`` it saw when it
    first took one; a drain that began before the count was applied is left out (the
    rows it moved before the count are not in it; those it moved after the count read
    the spool stay counted: the share errs high, never low).
    """

    __slots__ = ("_committed", "_unconfirmed", "_early", "epoch")

    def __init__(self) -> None:
        #: Payload bytes of each session's rows in the spool, as far as the link knows.
        self._committed: dict[str, int] = {}
        #: Payload bytes of each session's accepted rows not yet committed (or failed).
        self._unconfirmed: dict[str, int] = {}
        #: While the start's count runs: the rows committed meanwhile (session, row id,
        #: bytes); None once it is applied or when there is nothing to count.
        self._early: list[tuple[str, int, int]] | None = None
        #: Bumped when the start's count is applied.
        self.epoch = 0

    @property
    def counting(self) -> bool:
        """Whether the start's count is awaited."""
        return self._early is not None

    def start_count(self) -> None:
        """The spool holds rows from earlier runs: a count (``load``) will follow."""
        self._early = []

    def of(self, session_id: str) -> int:
        """The session's share now."""
        return self._committed.get(session_id, 0) + self._unconfirmed.get(session_id, 0)

    def accepted(self, session_id: str, nbytes: int) -> None:
        """The spool's writer accepted a row of the session (not yet committed)."""
        _add(self._unconfirmed, session_id, nbytes)

    def settled(self, session_id: str, nbytes: int, row_id: int | None) -> None:
        """An accepted row was committed as ``row_id``, or failed (None)."""
        _add(self._unconfirmed, session_id, -nbytes)
        if row_id is None:
            return
        _add(self._committed, session_id, nbytes)
        if self._early is not None:
            self._early.append((session_id, row_id, nbytes))

    def removed(self, gone: dict[str, int], epoch: int) -> None:
        """Rows left the spool: their bytes per session, moved by a replay that took
        them at ``epoch``. Ignored if the start's count was applied since (it saw
        them gone)."""
        if epoch != self.epoch:
            return
        for session_id, nbytes in gone.items():
            _add(self._committed, session_id, -nbytes)

    def load(self, counted: dict[str, int], max_id: int) -> None:
        """Apply the start's count: ``counted`` bytes per session, ``max_id`` the
        largest row id it saw. Every commit it may have seen has been ``settled``."""
        committed = {s: n for s, n in counted.items() if n > 0}
        for session_id, row_id, nbytes in self._early or ():
            if row_id > max_id:
                _add(committed, session_id, nbytes)
        self._committed = committed
        self._early = None
        self.epoch += 1

    def give_up(self) -> None:
        """The start's count failed: the shares stay what this run spooled."""
        self._early = None


def _add(counts: dict[str, int], session_id: str, nbytes: int) -> None:
    """Add ``nbytes`` (may be negative) to a count; a count at or below 0 is dropped."""
    value = counts.get(session_id, 0) + nbytes
    if value > 0:
        counts[session_id] = value
    else:
        counts.pop(session_id, None)
