"""The gateway link's cap (walspool.link.budget): ``refusal`` from a table, at its bounds."""

from __future__ import annotations

import pytest

from walspool.link.budget import ON_DISK, RESERVE, SMALL, refusal

CAP = 1_000_000
#: Where the reserve begins, and the largest share that still counts as small.
RESERVED_FROM = int(CAP * (1 - RESERVE))
SMALL_BYTES = int(CAP * SMALL)


@pytest.mark.parametrize(
    "footprint, unconfirmed, session_bytes, nbytes, why",
    [
        (0, 0, 0, 100, None),
        # Past the cap, counting what is accepted and not yet committed, on disk.
        (CAP - ON_DISK * 100, 0, 0, 100, None),
        (CAP - ON_DISK * 100, 0, 0, 101, "at the link's cap"),
        (CAP - ON_DISK * 200, 1, 0, 100, None),
        (CAP - ON_DISK * 200, 101, 0, 100, "at the link's cap"),
        # In the reserve: a session that stays small may spool; its own row counts.
        (RESERVED_FROM, 0, 0, 100, None),
        (RESERVED_FROM, 0, SMALL_BYTES - 100, 100, None),
        (RESERVED_FROM, 0, SMALL_BYTES - 100, 101, "is kept for sessions"),
        (RESERVED_FROM, 0, SMALL_BYTES + 1, 1, "is kept for sessions"),
        # Below the reserve, a big session spools as any other.
        (RESERVED_FROM - ON_DISK * 100, 0, SMALL_BYTES * 50, 100, None),
        # Past the cap too, a session big already is told it meets the reserve:
        # whichever its evictions meet first depends on how far the writer's commits lag.
        (CAP, 0, SMALL_BYTES + 1, 1, "is kept for sessions"),
        (CAP, 0, SMALL_BYTES, 1, "at the link's cap"),
        (CAP, 0, 0, SMALL_BYTES * 2, "at the link's cap"),
    ],
)
def test_an_eviction_is_refused_exactly_past_the_cap_or_into_the_reserve(
    footprint, unconfirmed, session_bytes, nbytes, why
):
    said = refusal(CAP, footprint, unconfirmed, session_bytes, nbytes)
    if why is None:
        assert said is None
    else:
        assert said is not None and why in said


def test_no_cap_refuses_nothing():
    assert refusal(None, 10**15, 10**15, 10**15, 10**15) is None


def test_the_reserve_refusal_says_the_share_held():
    said = refusal(CAP, RESERVED_FROM, 0, SMALL_BYTES, 1)
    assert said == (
        f"the last 10% of the link's cap of {CAP} bytes is kept for sessions that spooled "
        f"less than 1% of it; this one holds {SMALL_BYTES} bytes"
    )
