"""What a gateway holds in memory is in sight: while it runs, ``stats``, ``ls``,
``watch`` and ``metrics`` count the messages in its queues (lost if it is killed);
after a SIGKILL, exactly those are named as lost, until the next start says so in its
log and counts them; after a clean stop, none."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

from _helpers import run_runbook

from walspool import plugin

from ._gateway_process import HEAL
from ._gateways import (
    PROCESS_SECONDS,
    WORKER,
    Gateway,
    configure,
    env,
    gateway_process,
    run_walspool,
    run_worker,
    wait_for,
)

#: Messages sent to each of three sessions while state.db and the spool are locked:
#: under the cap, so every gateway keeps them all in its queues.
TURNS = 30
#: Messages sent to each session in the runbook drill: past the 200 cap, so a gateway
#: spools the oldest and holds the rest in its queue.
PAST = 260


def memory_of(gateway: Gateway, home: Path, pid: int) -> dict[str, Any] | None:
    """The entry ``walspool stats --json`` shows for gateway process ``pid``, or None."""
    done = run_walspool(gateway, home, "stats", str(home / "spool.db"), "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    found = [o for o in json.loads(done.stdout)["memory"] if o["pid"] == pid]
    return found[0] if found else None


def holding(gateway: Gateway, home: Path, then: str) -> tuple[list[str], Path]:
    """The worker that holds the backlog (``memory``), and the file it reports to."""
    configure(gateway, home, gateway.enable)
    out = home.parent / "held.json"
    return [str(gateway.python()), str(WORKER), str(out), "memory", str(TURNS), then], out


def test_a_gateways_in_memory_backlog_is_shown_and_after_a_sigkill_named_as_lost(
    gateway: Gateway, home: Path
) -> None:
    """Each session's queue holds ``TURNS`` messages; the operator's ``stats --json``
    shows exactly those (per session, and in total) for the gateway's pid, alive.
    After a real SIGKILL the same entry says the process is gone: ``stats``, ``ls``,
    ``watch --json`` and ``metrics`` name what was lost, message for message."""
    argv, out = holding(gateway, home, "kill")
    with gateway_process(home, *argv) as process:
        wait_for("holding", out.exists, process)
        held = json.loads(out.read_text())
        pid, queues = held["pid"], held["queues"]
        total = sum(queues.values())
        assert total == 3 * TURNS, queues  # every gateway kept them in memory

        def published() -> bool:
            entry = memory_of(gateway, home, pid)
            return entry is not None and entry["messages"] == total

        wait_for("published", published, process)
        live = memory_of(gateway, home, pid)
        spool = str(home / "spool.db")
        # The operator's text, while the gateway runs: what a kill would lose now.
        said = f"{total} messages in 3 sessions, oldest "
        alive = f"in the memory of pid {pid} (lost if the process is killed)"
        stats_text = run_walspool(gateway, home, "stats", spool).stdout.splitlines()
        (line,) = [line for line in stats_text if line.startswith("in memory")]
        assert line.startswith(f"in memory   {said}") and line.endswith(alive), line
        ls_text = run_walspool(gateway, home, "ls", spool).stdout.splitlines()
        (line,) = [line for line in ls_text if line.startswith("in memory: ")]
        assert line.startswith(f"in memory: {said}") and line.endswith(alive), line
        session, held = next(iter(queues.items()))  # nothing of it spooled yet
        shown = run_walspool(gateway, home, "show", spool, session)
        assert shown.returncode == 1
        assert f"; {held} messages of it are in the memory of pid {pid}, not spooled yet " \
            "(lost if the process is killed)" in shown.stderr  # fmt: skip
        metrics = run_walspool(gateway, home, "metrics", spool).stdout.splitlines()
        assert f'walspool_memory_messages{{spool="{spool}",pid="{pid}",alive="true"}} {total}' in (
            metrics
        )
        opened = f'walspool_open_processes{{spool="{spool}"}} '
        (count,) = [line.removeprefix(opened) for line in metrics if line.startswith(opened)]
        assert int(count) >= 1  # the gateway has it open: someone drains it
        process.kill()
        process.wait()
    assert live is not None and live["alive"] is True
    assert live["sessions"] == 3
    assert {s["session_id"]: s["messages"] for s in live["top"]} == queues
    assert live["bytes"] > 0 and live["oldest_age"] >= 0

    lost = memory_of(gateway, home, pid)
    assert lost is not None and lost["alive"] is False
    assert (lost["messages"], lost["sessions"]) == (total, 3)
    assert {s["session_id"]: s["messages"] for s in lost["top"]} == queues  # each session's
    listed = run_walspool(gateway, home, "ls", spool).stdout.splitlines()
    assert f"in memory: LOST: {total} messages in 3 sessions" in "\n".join(listed)
    watched = json.loads(run_walspool(gateway, home, "watch", spool, "--json").stdout)
    assert [(o["pid"], o["alive"], o["messages"]) for o in watched["memory"]] == [
        (pid, False, total)
    ]
    metrics = run_walspool(gateway, home, "metrics", spool).stdout.splitlines()
    assert f'walspool_memory_messages{{spool="{spool}",pid="{pid}",alive="false"}} {total}' in (
        metrics
    )

    # The next start says what was lost, counts it, and takes the entry in.
    started = run_worker(gateway, home, "probe")
    said = [line for line in started["log"] if f"(pid {pid}) ended without a clean stop" in line]
    assert len(said) == 1 and said[0].startswith("WARNING"), started["log"]
    assert f"held {total} transcript message(s) of 3 session(s) in memory" in said[0]
    stats = json.loads(run_walspool(gateway, home, "stats", spool, "--json").stdout)
    assert (stats["memory"], stats["memory_lost_total"]) == ([], total)
    metrics = run_walspool(gateway, home, "metrics", spool).stdout.splitlines()
    assert f'walspool_memory_lost_messages_total{{spool="{spool}"}} {total}' in metrics


def test_a_clean_stop_spools_the_backlog_and_leaves_nothing_in_memory(
    gateway: Gateway, home: Path
) -> None:
    """The same backlog, shown while the gateway runs; then a graceful stop: its queues
    go to the spool and its entry goes, so nothing is shown as held or lost."""
    argv, out = holding(gateway, home, "stop")
    with gateway_process(home, *argv) as process:
        wait_for("holding", out.exists, process)
        held = json.loads(out.read_text())
        pid, total = held["pid"], sum(held["queues"].values())
        wait_for(
            "published",
            lambda: (memory_of(gateway, home, pid) or {}).get("messages") == total,
            process,
        )
        Path(f"{out}.stop").touch()
        assert process.wait(timeout=120) == 0
    done = run_walspool(gateway, home, "stats", str(home / "spool.db"), "--json")
    stats = json.loads(done.stdout)
    assert stats["memory"] == []
    assert stats["rows"] == total  # the queues were spooled at the stop


def test_the_incident_runbook_after_a_sigkill_accounts_for_every_message(
    gateway: Gateway, home: Path, tmp_path: Path
) -> None:
    """README's runbook drilled on a real outage of each gateway: ``PAST`` messages to
    two sessions and 50 to a third while state.db refuses them (spooled past the cap,
    what the gateway queues held there: on 0.20 a session's messages after its first
    eviction go to the spool behind it; 0.22 hands its whole stalled backlog over), a
    real SIGKILL, state.db healed (the runbook's step 3); then each command of the
    runbook as written, by a shell in the gateway's environment: `stats` names exactly
    what the kill lost (nothing on 0.22), the replay and the check pass, and each
    session in state.db is what was sent up to what the kill lost, in order, none
    twice."""
    configure(gateway, home, gateway.enable)
    out = home.parent / "held.json"
    argv = [str(gateway.python()), str(WORKER), str(out), "memory-past", str(PAST), "kill"]
    with gateway_process(home, *argv) as process:
        wait_for("holding", out.exists, process)
        held = json.loads(out.read_text())
        pid, queues, sent = held["pid"], held["queues"], held["sent"]
        total = sum(queues.values())
        spooled = sum(len(messages) for messages in sent.values()) - total

        def settled() -> bool:
            done = run_walspool(gateway, home, "stats", str(home / "spool.db"), "--json")
            stats = json.loads(done.stdout)
            entry = [o for o in stats["memory"] if o["pid"] == pid]
            return stats["rows"] == spooled and [o["messages"] for o in entry] == (
                [total] if total else []
            )

        wait_for("spooled and published", settled, process)
        process.kill()
        process.wait()
    # 0.22 hands a stalled backlog to the spool (its own shutdown_flush's use): after
    # the outage it holds nothing, and the kill loses nothing. The others hold a queue.
    assert (total == 0) is (gateway.how == plugin.DROP_IN), queues
    state = sqlite3.connect(home / "state.db")
    try:
        state.execute(HEAL)
        state.commit()
    finally:
        state.close()

    operator = tmp_path / "operator"
    operator.mkdir()
    (operator / ".hermes").symlink_to(home)  # the runbook's ~/.hermes
    bin_dir = Path(gateway.python()).parent
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    # 0.20 and 0.22 refuse to open ~/.hermes/state.db from a process with a pytest
    # ancestor (their live-system guard); their documented bypass for a child process.
    shell = env(home, HOME=str(operator), PATH=path, HERMES_STATE_DB_GUARD_BYPASS="1")
    said = run_runbook(shell, operator, "s1", PROCESS_SECONDS)
    holding = sum(1 for queued in queues.values() if queued)
    lost = f"in memory   LOST: {total} messages in {holding} session{'s' * (holding > 1)}"
    if not total:
        lost = "in memory   nothing (no linked gateway holds transcript messages in memory)"
    assert lost in said["walspool stats"].stdout, said["walspool stats"].stdout
    replay = next(c for c in said if c.startswith("walspool replay") and "--dry" not in c)
    assert said[replay].returncode == 0, said[replay].stderr
    assert said["walspool check"].returncode == 0, said["walspool check"].stdout

    state = sqlite3.connect(f"file:{home / 'state.db'}?mode=ro", uri=True)
    try:
        for session, messages in sent.items():
            landed = state.execute(
                "SELECT role, content FROM messages WHERE session_id = ? ORDER BY id",
                (session,),
            ).fetchall()
            kept = len(messages) - queues[session]
            assert [list(row) for row in landed] == messages[:kept], session
    finally:
        state.close()
