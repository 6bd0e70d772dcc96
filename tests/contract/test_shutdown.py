"""Shutdown: what the gateway holds in memory when it stops during an outage is spooled,
in arrival order, and lands at the next start."""

from __future__ import annotations

from ._gateways import Gateway, configure, gateway_running, heal, run_worker, transcript, wait_for

#: Rows of agent turns queued in the store while state.db refuses them (under the cap).
TURNS = 6
#: Messages a session gets in an outage before a stop: past the cap, so some are spooled.
STOP_BURST = 230


def test_a_stop_during_an_outage_keeps_queued_turns_before_the_slot_they_preceded(
    gateway: Gateway, home
) -> None:
    """Turns wait in the store's queue, then a user message arrives while the agent is
    busy (a pending slot), then the gateway stops with state.db still broken. At the
    next start, once state.db works, the transcript is the turns, then the slot: each
    once, in arrival order (before: 0.19.0 spooled the slot first and it landed before
    the turns; 0.20 lost the queued turns)."""
    configure(gateway, home, gateway.enable)
    stopped = run_worker(gateway, home, "stop", str(TURNS))
    sid = stopped["session_id"]
    expected = [tuple(turn) for turn in stopped["turns"]] + [("user", stopped["slot"])]
    heal(home)
    with gateway_running(gateway, home) as process:
        wait_for("recovered", lambda: len(transcript(home, sid)) >= len(expected), process)
    assert transcript(home, sid) == expected


def test_a_graceful_stop_with_a_write_in_flight_loses_nothing(gateway: Gateway, home) -> None:
    """Turns wait in the store's queue during an outage; then another process holds
    state.db's write lock and a gateway thread is inside its write of one more message
    when the gateway stops. Once the lock is gone, the next start lands every message
    once, in order: the one being written included, whether its write failed or not."""
    configure(gateway, home, gateway.enable)
    stopped = run_worker(gateway, home, "in-flight", str(TURNS))
    sid = stopped["session_id"]
    expected = [tuple(m) for m in stopped["sent"]]
    with gateway_running(gateway, home) as process:
        wait_for("recovered", lambda: len(transcript(home, sid)) >= len(expected), process)
    assert transcript(home, sid) == expected


def test_a_stop_after_the_spool_was_deleted_spools_the_queues_into_a_fresh_one(
    gateway: Gateway, home
) -> None:
    """An outage past the cap; the operator deletes spool.db (and its -wal, -shm), and
    the gateway stops before it evicts again, state.db still broken. The stop opens a
    fresh spool at the path for the queues (nothing evicted since told it that the file
    was gone); at the next start, once state.db works, every session's transcript is
    what was sent after the deleted rows, each once, in order."""
    configure(gateway, home, gateway.enable)
    stopped = run_worker(gateway, home, "deleted-stop", str(STOP_BURST))
    heal(home)
    with gateway_running(gateway, home) as process:
        for session, sent in stopped["sent"].items():
            expected = [tuple(m) for m in sent[stopped["deleted_rows"][session] :]]

            def landed(session: str = session, count: int = len(expected)) -> bool:
                return len(transcript(home, session)) >= count

            wait_for("recovered", landed, process)
            assert transcript(home, session) == expected, session
