"""What a gateway holds in memory is in sight: while it runs, ``stats``, ``ls``,
``watch`` and ``metrics`` count the messages in its queues (lost if it is killed);
after a SIGKILL, exactly those are named as lost, until the next start says so in its
log and counts them; after a clean stop, none."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ._gateways import (
    WORKER,
    Gateway,
    configure,
    gateway_process,
    run_walspool,
    run_worker,
    wait_for,
)

#: Messages sent to each of three sessions while state.db and the spool are locked:
#: under the cap, so every gateway keeps them all in its queues.
TURNS = 30


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
