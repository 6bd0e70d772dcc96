"""The account of rows handed to the spool's writer (``walspool.link.handoffs``), which
the 0.19.0 link and the 0.20/0.22 drop-in both keep: counts, supersede on rewrite,
and the bounded wait a drain makes for them. The gateways' own use of it is tested
through the plugin in ``tests/contract``."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from walspool.link.handoffs import HandOffs


def account() -> HandOffs:
    return HandOffs(threading.Condition())


@pytest.mark.parametrize(
    "before, after, superseded",
    [
        # (hand-offs before the rewrite, after it) -> the settles, in order, that find
        # the hand-off superseded
        (0, 2, [False, False]),
        (3, 0, [True, True, True]),
        (2, 2, [True, True, False, False]),
    ],
)
def test_the_hand_offs_a_rewrite_supersedes_are_the_first_to_settle(before, after, superseded):
    """The spool's writer settles a session's hand-offs in the order they came: those
    handed over before a rewrite settle first, and only they read as superseded."""
    handoffs = account()
    with handoffs.condition:
        for _ in range(before):
            handoffs.handed("s")
        handoffs.rewritten("s")
        for _ in range(after):
            handoffs.handed("s")
        seen = []
        for _ in range(before + after):
            seen.append(handoffs.superseded("s"))
            handoffs.settled("s")
        assert seen == superseded
        assert (handoffs.pending("s"), handoffs.superseded("s")) == (0, False)


def test_a_hand_off_settled_out_of_order_keeps_its_own_superseded_mark():
    """The drop-in's two paths (an eviction settled by the writer's callback, 0.22's
    stalled backlog settled as its bounded put returns) can settle a key's hand-offs
    out of order: each settle names its token, and a hand-off handed before the
    rewrite reads superseded however many later ones settled first."""
    handoffs = account()
    with handoffs.condition:
        older = handoffs.handed("s")
        handoffs.rewritten("s")
        newer = handoffs.handed("s")
        assert handoffs.counts("s") == (2, 1)
        assert not handoffs.superseded("s", newer)
        assert handoffs.settled("s", newer) is False
        assert handoffs.superseded("s", older)
        assert handoffs.counts("s") == (1, 1)
        assert handoffs.settled("s", older) is True
        assert handoffs.counts("s") == (0, 0)
        # A later hand-off of the key is not superseded by the rewrite before it.
        assert not handoffs.superseded("s", handoffs.handed("s"))


OPS = st.lists(
    st.tuples(
        st.sampled_from(["handed", "settled", "settled oldest", "rewritten"]),
        st.sampled_from("ab"),
        st.integers(min_value=0, max_value=40),
    ),
    max_size=40,
)


@given(OPS)
def test_each_key_is_accounted_for_on_its_own_as_a_set_of_hand_offs(ops):
    """Any sequence of hand-offs, settles (of a pending one, named by its token or the
    oldest: the writer settles what it was handed) and rewrites, on two keys: each key
    reads as a model list of hand-offs, each marked superseded if a rewrite of its key
    came after it; a settle says whether it was the key's last."""
    handoffs = account()
    model: dict[str, list[list]] = {"a": [], "b": []}  # [token, superseded], oldest first
    with handoffs.condition:
        for op, key, pick in ops:
            pending = model[key]
            if op == "handed":
                pending.append([handoffs.handed(key), False])
            elif op == "rewritten":
                handoffs.rewritten(key)
                for entry in pending:
                    entry[1] = True
            elif pending:
                index = 0 if op == "settled oldest" else pick % len(pending)
                token, superseded = pending.pop(index)
                if op == "settled oldest":
                    assert handoffs.superseded(key) is superseded
                    assert handoffs.settled(key) is (not pending)
                else:
                    assert handoffs.superseded(key, token) is superseded
                    assert handoffs.settled(key, token) is (not pending)
            for k, entries in model.items():
                assert handoffs.counts(k) == (len(entries), sum(s for _, s in entries))
                assert handoffs.superseded(k) is bool(entries and entries[0][1])


class Ticks:
    """A clock that moves ``step`` seconds at each reading: a wait measured on it ends
    after a known number of looks, whatever real time does."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


@pytest.mark.parametrize(
    "seconds, busy, looked_until",
    [
        # none commits: the start, three looks, the one past the bound
        (0.35, False, 0.5),
        # a write lock held elsewhere notifies nobody and may be held long: no wait
        (60.0, True, 0.1),
    ],
)
def test_a_wait_for_hand_offs_ends_at_its_bound_or_at_once_while_the_spool_is_busy(
    seconds, busy, looked_until
):
    handoffs = account()
    clock = Ticks(0.1)
    with handoffs.condition:
        handoffs.handed("s")
        assert handoffs.wait("s", seconds, lambda: busy, clock) is False
    assert clock.now == pytest.approx(looked_until)


def test_a_wait_for_hand_offs_ends_when_the_last_one_of_its_key_settles():
    """Another key's settle does not end it; the key's last one does, through the
    condition (the waiter holds no lock while it waits)."""
    handoffs = account()
    with handoffs.condition:
        handoffs.handed("s")
        handoffs.handed("s")
        handoffs.handed("other")
    waited: list[bool] = []
    waiting = threading.Event()

    def busy() -> bool:
        waiting.set()  # looked at under the lock, before each wait
        return False

    def waiter() -> None:
        with handoffs.condition:
            waited.append(handoffs.wait("s", 3600.0, busy, Ticks(0.0)))

    thread = threading.Thread(target=waiter)
    thread.start()
    assert waiting.wait(10)
    for key in ("other", "s"):
        with handoffs.condition:
            assert handoffs.settled(key) is (key == "other")
    assert thread.is_alive()
    with handoffs.condition:
        assert handoffs.settled("s") is True
    thread.join(10)
    assert waited == [True]
