"""How much disk the gateway link may fill: a cap on the spool, with room kept for the
sessions that have spooled little.

The link spools what the released gateway would drop. Without a cap, one session
flooded during a long outage fills the disk; with a plain cap, it takes all of it and
every other session's evictions are then refused. So the cap counts what the spool
really takes (its pages in use, free pages left by replays not counted, plus its
``-wal`` file, which a reader holding a snapshot lets grow), and its last
``RESERVE`` share is kept for small sessions: once the spool is past
``1 - RESERVE`` of the cap, only a session that has spooled less than ``SMALL`` of the
cap in this run may still spool. The chatty session is refused first; the others keep
their room until the reserve itself is used up (at least ``RESERVE / SMALL`` = 10
small sessions' worth). A refused eviction takes the released gateway's
drop-and-warn path, with a WARNING that names the reason.

Why not a fixed share per session: the number of sessions is not known in advance,
and an equal share would refuse a long conversation while most of the disk is free.

Not guaranteed: bytes of rows spooled by earlier runs count toward the cap but not
toward their session's share; the size of a row on disk is estimated by its payload
(times ``ON_DISK``) until the spool's writer measures the files after its next commit.
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
    ``session_bytes``: payload bytes the evicting session has spooled in this run.
    """
    if max_bytes is None:
        return None
    after = footprint + ON_DISK * (unconfirmed + nbytes)
    if after > max_bytes:
        return f"the spool is at the link's cap of {max_bytes} bytes"
    if after > max_bytes * (1 - RESERVE) and session_bytes + nbytes > max_bytes * SMALL:
        return (
            f"the last {RESERVE:.0%} of the link's cap of {max_bytes} bytes is kept for "
            f"sessions that spooled less than {SMALL:.0%} of it; this one spooled "
            f"{session_bytes} bytes"
        )
    return None
