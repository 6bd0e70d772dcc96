"""An outage of state.db: what the gateway would drop at its cap is spooled and lands
in drop order, each message once; a rewrite during it supersedes the spooled rows."""

from __future__ import annotations

import json
from pathlib import Path

import apsw
import pytest

import walspool
from walspool import plugin
from walspool.link.outage import QUIET_AFTER

from ._gateways import (
    Gateway,
    after_the_heal,
    configure,
    linked_lines,
    run_walspool,
    run_worker,
    run_workers_together,
    transcript,
)

#: Messages sent to each of three sessions during the outage: past the 200 cap.
BURST = 450
#: Messages sent to each session before a stop during an outage: past the cap too.
TURNS_AT_STOP = 230


def test_an_enabled_plugin_carries_an_outage_into_state_db(gateway: Gateway, home: Path) -> None:
    configure(gateway, home, gateway.enable)
    after = "quiet" if gateway.how == plugin.LINK else "message"
    result = run_worker(gateway, home, "outage", str(BURST), after)

    if gateway.how == plugin.LINK:
        assert result["before"]["store_linked"] is True
    else:
        assert result["before"]["shutdown_flush"] == "walspool.shutdown_flush"
    assert result["during"] == {"s1": 0, "s2": 0, "s3": 0}  # the outage was real
    spool = home / "spool.db"
    (line,) = linked_lines(gateway, result["log"])
    assert str(spool) in line
    for session, sent in result["sent"].items():  # each once, in order
        assert result["landed"][session] == sent, after_the_heal(result, session)
    # A drain that fails because state.db does is said a few times, not once a message
    # (before: 0.20 warned at every message past a session's first eviction).
    for session in result["sent"]:
        failed = [
            line
            for line in result["log"]
            if line.startswith("WARNING Replay of ") and f" for {session} failed" in line
        ]
        assert len(failed) <= QUIET_AFTER + 1, failed[: QUIET_AFTER + 2]
    with walspool.Spool(spool) as s:
        assert s.stats().rows == 0
    # The metrics' drained total counts every row the spool took (each stream's next
    # seq, kept once its rows left, says how many), as the operator reads it.
    with apsw.Connection(
        f"file:{spool}?mode=ro", flags=apsw.SQLITE_OPEN_URI | apsw.SQLITE_OPEN_READONLY
    ) as conn:
        spooled = conn.execute("SELECT coalesce(sum(next_seq - 1), 0) FROM sequences").get
    stats = run_walspool(gateway, home, "stats", str(spool), "--json")
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["drained_total"] == spooled > 0


def test_a_rewrite_during_an_outage_supersedes_the_sessions_spooled_rows(
    gateway: Gateway, home: Path
) -> None:
    configure(gateway, home, gateway.enable)
    result = run_worker(gateway, home, "rewrite", str(BURST))

    assert result["landed"]["s1"] == [["user", "s1-last"]]  # nothing from before the rewrite
    for session in ("s2", "s3"):
        assert result["landed"][session] == result["sent"][session]
    with apsw.Connection(str(home / "spool.db"), flags=apsw.SQLITE_OPEN_READONLY) as db:
        kept = dict(
            db.execute(
                "SELECT coalesce(status, 'replayable'), count(*) FROM records "
                "WHERE session_id = 's1' GROUP BY 1"
            ).fetchall()
        )
    assert list(kept) == ["superseded"]  # kept for operators, never replayed
    assert kept["superseded"] >= BURST - 200


def test_a_dropped_ticket_table_stops_no_transcript_write(gateway: Gateway, home: Path) -> None:
    """After an outage has drained, an operator drops ``walspool_landed`` (the table of
    replay tickets) from state.db with the sqlite3 shell: every session's next message
    still lands, once, in order (before: on 0.19.0 every transcript write of the running
    gateway failed with "no such table" until a restart, healthy sessions included)."""
    configure(gateway, home, gateway.enable)
    result = run_worker(gateway, home, "drop-tickets", str(BURST))
    for session, sent in result["sent"].items():
        assert result["landed"][session] == sent, session


def test_an_operators_replay_during_the_outage_leaves_the_gateway_to_land_everything(
    gateway: Gateway, home: Path
) -> None:
    """During the outage the operator runs ``walspool replay`` beside the gateway: it
    is held (exit 3: state.db refuses the first row) and leaves that row in flight.
    Once state.db heals, the gateway lands everything, that row too, once, in drop
    order, and nothing stays in the spool (before: on 0.20 the plugin's drain, whose
    callback walspool did not track, quarantined the row in flight although its ticket
    answered whether it had landed)."""
    configure(gateway, home, gateway.enable)
    result = run_worker(gateway, home, "operator", str(BURST))
    assert result["replay_status"] == 3
    for session, sent in result["sent"].items():
        assert result["landed"][session] == sent, session
    with walspool.Spool(home / "spool.db") as s:
        assert s.stats().rows == 0


def test_replays_run_beside_the_gateway_during_an_outage_cost_no_eviction(
    gateway: Gateway, home: Path
) -> None:
    """The operator's ``walspool replay`` runs over and over beside the gateway while
    the outage overflows its cap; each replay holds the spool's write lock for moments.
    Every eviction is still kept, and everything lands once, in drop order (before: on
    0.20 an eviction that met the lock taken marked the spool busy until walspool's
    next commit, and the drop-in refused, so the gateway dropped, every eviction
    meanwhile)."""
    configure(gateway, home, gateway.enable)
    result = run_worker(gateway, home, "beside", str(BURST))
    assert result["replays"] > 0
    assert not [line for line in result["log"] if "dropping oldest" in line]
    for session, sent in result["sent"].items():
        assert result["landed"][session] == sent, session


def test_live_messages_wait_behind_spooled_rows_while_another_replay_holds_the_spool(
    gateway: Gateway, home: Path
) -> None:
    """After an outage past the cap, another process holds the spool's replay lock (a
    running ``walspool replay``): a session's drain before its live write cannot run,
    and the live message waits behind the spooled rows, then lands after them."""
    configure(gateway, home, gateway.enable)
    result = run_worker(gateway, home, "held-replay", str(BURST))

    assert result["while_held"] == {"s1": 0, "s2": 0, "s3": 0}
    for session, sent in result["sent"].items():
        assert result["landed"][session] == sent, session  # each once, in order


def test_a_heal_while_nobody_writes_lands_the_messages_a_held_replay_put_off(
    gateway: Gateway, home: Path
) -> None:
    """As above, but nothing is sent once the other replay lets the lock go: each
    session's message that waited behind its spooled rows, and those rows, land all the
    same, in order, with no new message to carry them (0.20 and 0.22 try a queue again
    only at its next write: the plugin tries a skipped session again itself)."""
    configure(gateway, home, gateway.enable)
    result = run_worker(gateway, home, "held-quiet", str(BURST))

    assert result["while_held"] == {"s1": 0, "s2": 0, "s3": 0}
    for session, sent in result["sent"].items():
        assert sent[-1] == ["user", f"{session}-while-held"]
        assert result["landed"][session] == sent, after_the_heal(result, session)


def test_a_heal_while_another_process_holds_state_dbs_lock_lands_everything_once_it_goes(
    gateway: Gateway, home: Path
) -> None:
    """An outage past the cap heals; another process (a second gateway's write) then
    holds state.db's lock while each session's next message arrives, past the
    gateway's busy timeout (on 0.20's rollback journal even walspool's read of its
    tickets waits), and nothing more is sent once it lets go. Each session's spooled
    rows, queue and last message land once, in order, during the run: a drain held by
    a lock is tried again (0.19.0: the link's background thread; 0.20 and 0.22: the
    plugin's retry), not left for a next message that never comes."""
    configure(gateway, home, gateway.enable)
    result = run_worker(gateway, home, "statedb-locked-quiet", str(BURST))

    for session, sent in result["sent"].items():
        assert sent[-1] == ["user", f"{session}-last"]
        assert result["landed"][session] == sent, after_the_heal(result, session)


@pytest.mark.parametrize("locked", ["after the start", "from before the start"])
def test_rows_held_at_a_start_stay_ahead_of_live_messages_while_another_replay_holds_the_spool(
    gateway: Gateway, home: Path, locked: str
) -> None:
    """A gateway stopped during an outage starts again on the still-broken state.db (its
    start-up recovery holds the spooled rows, or finds another replay holding the
    spool and leaves them to it); state.db heals while that replay lock is held, and
    each session gets a message: it waits behind the rows of the last run, then
    everything lands once, in order. A session with nothing spooled writes at once."""
    configure(gateway, home, gateway.enable)
    before = run_worker(gateway, home, "outage-stop", str(TURNS_AT_STOP))
    mode = "held-start" if locked == "after the start" else "locked-start"
    after = run_worker(gateway, home, mode, str(TURNS_AT_STOP))

    assert after["while_held"] == {"s1": 0, "s2": 0, "s3": 0}
    if locked == "from before the start":
        # A session with nothing spooled does not wait for the replay (before: 0.19.0's
        # start waited up to REPLAY_WAIT for it, holding every session meanwhile).
        assert after["fresh_while_held"] == 1
    for session, sent in before["sent"].items():
        assert after["landed"][session] == sent + after["sent"][session], session


def test_a_spool_locked_by_another_process_during_an_outage_loses_nothing(
    gateway: Gateway, home: Path
) -> None:
    """An operator's ``sqlite3 spool.db`` holds a transaction open while the first half
    of an outage's messages arrive (the gateway evicts past its cap meanwhile), then
    closes it: every message lands once, in order, as without the lock."""
    configure(gateway, home, gateway.enable)
    result = run_worker(gateway, home, "spool-locked", str(BURST))

    assert result["during"] == {"s1": 0, "s2": 0, "s3": 0}
    for session, sent in result["sent"].items():
        assert result["landed"][session] == sent, session


def test_two_gateways_on_one_home_through_an_outage_lose_nothing(
    gateway: Gateway, home: Path
) -> None:
    """Two gateway processes share one home (one state.db, one spool) through one outage
    past the cap, each with sessions of its own: both evict into the spool at once, each
    commit holding its write lock for a moment while the other waits. Both heal at once,
    so each session's last message meets the other gateway's drain (the spool's replay
    lock held).

    A drain that met the other's is skipped and tried again once the lock is free, with
    no new message (0.19.0: the link's background thread; 0.20 and 0.22, which try a
    queue again only at its next write: the plugin's retry), so everything lands during
    the run; and the runbook's replay afterwards finds nothing left to double."""
    configure(gateway, home, gateway.enable)
    results = run_workers_together(gateway, home, ["a", "b"], "outage", str(BURST), "message")

    for result in results:
        for session, sent in result["sent"].items():
            assert result["landed"][session] == sent, after_the_heal(result, session)
    spool, state_db = str(home / "spool.db"), str(home / "state.db")
    done = run_walspool(gateway, home, "replay", spool, "--into", state_db, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    for result in results:
        for session, sent in result["sent"].items():
            assert transcript(home, session) == [tuple(m) for m in sent], session
    with walspool.Spool(home / "spool.db") as s:
        assert s.stats().rows == 0


def test_a_spool_deleted_while_the_gateway_runs_costs_only_its_rows(
    gateway: Gateway, home: Path
) -> None:
    """An operator deletes spool.db (and its -wal, -shm) two thirds into an outage past
    the cap. The rows in it are gone with it; everything evicted afterwards goes to a
    fresh spool at that path and lands, with the queue and the last message, once and
    in order, and the gateway says once that it opened a fresh spool."""
    configure(gateway, home, gateway.enable)
    result = run_worker(gateway, home, "spool-deleted", str(BURST))

    for session, sent in result["sent"].items():
        # The deleted rows were the oldest; the rest lands, once, in order.
        assert result["landed"][session] == sent[result["deleted_rows"][session] :], session
    fresh = [line for line in result["log"] if "a fresh one is open" in line]
    assert len(fresh) == 1 and fresh[0].startswith("WARNING"), fresh
    assert not [line for line in result["log"] if "no longer names" in line]
