"""Shutdown: what the gateway holds in memory when it stops during an outage is spooled,
in arrival order, and lands at the next start."""

from __future__ import annotations

import json

import apsw

import walspool

from ._gateways import (
    Gateway,
    configure,
    gateway_running,
    heal,
    run_walspool,
    run_worker,
    transcript,
    wait_for,
)

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


def test_a_stop_loses_only_the_slot_the_spool_refuses_and_says_so(gateway: Gateway, home) -> None:
    """Two sessions' turns wait in memory and each has a pending slot, the first past
    the spool's payload limit, when the gateway stops with state.db broken. That slot
    alone is lost, with an ERROR naming its key; at the next start the other slot lands
    after its turns, and each session's turns land (before: a refused slot failed the
    stop's one transaction, and on 0.19.0 every slot of the stop was lost)."""
    configure(gateway, home, gateway.enable)
    stopped = run_worker(gateway, home, "stop-refused", str(TURNS))
    big, small = stopped["sessions"]
    lost = [line for line in stopped["log"] if "it is lost" in line]
    assert len(lost) == 1 and lost[0].startswith("ERROR ") and repr(stopped["keys"][0]) in lost[0]
    # The spool's error names the session: by its id where the stop resolved the key
    # (0.19.0, through its store), else by the key.
    error = lost[0].split("it is lost: ", 1)[1]
    assert error.startswith(
        (f"message for session {big!r} is ", f"message for session key {stopped['keys'][0]!r} is ")
    )
    assert "over the spool's max_payload_bytes" in error
    heal(home)
    expected = {
        big: [tuple(t) for t in stopped["turns"][0]],
        small: [tuple(t) for t in stopped["turns"][1]] + [("user", stopped["slot"])],
    }
    with gateway_running(gateway, home) as process:
        wait_for(
            "recovered",
            lambda: all(len(transcript(home, s)) >= len(rows) for s, rows in expected.items()),
            process,
        )
    assert {s: transcript(home, s) for s in expected} == expected


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


def test_a_stop_waits_for_a_write_in_flight_once_not_at_each_flush_call(
    gateway: Gateway, home
) -> None:
    """Turns wait in the store's queue during an outage, and the session's next write
    (the message's own gateway thread on 0.20 and 0.22, the link's probe on 0.19.0) does
    not end until the stop has returned. The stop waits ``FLUSH_TIMEOUT`` for it once,
    then says so in one WARNING, on every gateway (the drop-in waited and warned at each
    of its flush calls, up to three times; the 0.19.0 link did not wait, and closed the
    spool its write needed); the write then fails, what waited behind it is spooled,
    and the next start lands every message once, in order."""
    configure(gateway, home, gateway.enable)
    stopped = run_worker(gateway, home, "long-write", str(TURNS))
    waited = [line for line in stopped["log"] if "was still being written to state.db" in line]
    assert len(waited) == 1, waited
    sid = stopped["session_id"]
    expected = [tuple(m) for m in stopped["sent"]]
    heal(home)
    with gateway_running(gateway, home) as process:
        wait_for("recovered", lambda: len(transcript(home, sid)) >= len(expected), process)
    assert transcript(home, sid) == expected


def test_a_stop_after_a_heal_that_met_a_locked_spool_keeps_what_waits_in_memory(
    gateway: Gateway, home
) -> None:
    """State.db heals while an operator's ``sqlite3`` shell holds the spool's write
    lock, and each session's next message meets it: the message, and whatever the
    session still has in memory, waits there. The lock goes, nothing more is sent, and
    the gateway stops. The next start lands every message once, in order (before: 0.22
    lost what it kept in memory at the stop, as no stop flushed its queues)."""
    configure(gateway, home, gateway.enable)
    stopped = run_worker(gateway, home, "locked-heal-stop", str(STOP_BURST))
    expected = {sid: [tuple(m) for m in sent] for sid, sent in stopped["sent"].items()}
    with gateway_running(gateway, home) as process:
        wait_for(
            "recovered",
            lambda: all(len(transcript(home, sid)) >= len(rows) for sid, rows in expected.items()),
            process,
        )
    for sid, rows in expected.items():
        assert transcript(home, sid) == rows, sid


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


def test_rows_edited_into_bytes_that_are_not_utf8_stop_no_start_and_block_no_session(
    gateway: Gateway, home
) -> None:
    """A gateway stopped during an outage left its turns in the spool; then a hand edit
    in the ``sqlite3`` shell gives one of them (the second turn) a reason that is not
    UTF-8, and another session's row an id that is not. At the next start, once state.db
    works, the other turns land in order, the edited row left out (before: the start's
    recovery failed on the first such row, at every start, and nothing landed); both
    edited rows stay in the spool, quarantined, and ``walspool check`` names them."""
    configure(gateway, home, gateway.enable)
    stopped = run_worker(gateway, home, "stop", str(TURNS))
    sid = stopped["session_id"]
    expected = [tuple(turn) for turn in stopped["turns"]] + [("user", stopped["slot"])]
    spool = home / "spool.db"
    with walspool.Spool(spool) as s:
        other = s.append("other", {"role": "user", "content": "other's"})
    with apsw.Connection(str(spool)) as conn:
        conn.execute(
            "UPDATE records SET reason = CAST(X'72ff' AS TEXT) WHERE session_id = ? AND seq = 2",
            (sid,),
        )
        conn.execute(
            "UPDATE records SET session_id = CAST(X'62ff' AS TEXT) WHERE id = ?", (other.id,)
        )
    del expected[1]
    heal(home)
    with gateway_running(gateway, home) as process:
        wait_for("recovered", lambda: len(transcript(home, sid)) >= len(expected), process)
    assert transcript(home, sid) == expected
    listed = run_walspool(gateway, home, "ls", str(spool), "--json")
    assert listed.returncode == 0, listed.stderr
    streams = json.loads(listed.stdout)
    assert {(s["session_id"], s["rows"], s["quarantined"]) for s in streams} == {
        ("b\udcff", 1, 1),
        (sid, 1, 1),
    }
    checked = run_walspool(gateway, home, "check", str(spool), "--json")
    assert checked.returncode == 1
    (problem,) = json.loads(checked.stdout)["problems"]
    assert problem.startswith("2 rows whose session id, reason or session key is not UTF-8")
