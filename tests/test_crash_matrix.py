"""Crash matrix: SIGKILL a worker that appends, replays, drains through the gateway link
or imports upstream's JSON spool, at chosen points and at random times; after each kill
check the invariants, restart, and at the end recover everything and check again.

Invariants after every kill (DESIGN.md, issue 6):

* no acknowledged append is lost: each is in state.db or in the spool;
* no message is in state.db twice, and each session's rows there are in append order;
* a session's rows still to replay all come after its rows already in state.db;
* ``walspool check`` passes and the spool opens again;
* import: nothing lost; a file is duplicated only when a kill fell between its batch's
  commit and its unlink (at most ``batch_files`` new duplicates per kill).

The worker (tests/_crash_worker.py) prints every acknowledgement after the call that
gave it returned; lines printed before the kill are read to the end of the pipe. One
spool and one state.db serve a whole sequence of kills, so most of the time goes to
kills rather than to fresh setups. ``KILLS`` counts them; the summary is printed at the
end of the module (each test asserts that all its planned kills were made).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import apsw
import pytest
from _helpers import ROOT, terminal_line
from _old_schemas import DOWNGRADE_TO_V1_SQL, make_v2_spool

import walspool
from walspool import CAP_DROP, SHUTDOWN
from walspool.cli import main as cli_main

hermes_state = pytest.importorskip("hermes_state")

WORKER = Path(__file__).with_name("_crash_worker.py")
#: Longest a worker may run before the test calls it hung.
TIMEOUT = 90
#: Kills made so far, by scenario; checked per test and summed at the end.
KILLS: Counter[str] = Counter()
PLANNED: Counter[str] = Counter()

Key = tuple[int, int]  # (run, index within the owning thread): a session's append order


@pytest.fixture(scope="module", autouse=True)
def kill_summary(request: pytest.FixtureRequest):
    yield
    total = sum(KILLS.values())
    line = (
        f"crash matrix: {total} SIGKILLs "
        f"({', '.join(f'{k}: {v}' for k, v in sorted(KILLS.items()))}); planned "
        f"{sum(PLANNED.values())}"
    )
    terminal_line(request.config, line)


# -- running the worker -----------------------------------------------------------------


@dataclass
class Outcome:
    lines: list[str]
    returncode: int
    stderr: str
    timed_out: bool

    def killed(self) -> bool:
        return self.returncode == -signal.SIGKILL and not self.timed_out

    def lines_of(self, kind: str) -> list[list[str]]:
        return [line.split()[1:] for line in self.lines if line.startswith(kind + " ")]


def run_worker(
    *args: Any, crash: str | None = None, kill_after: int | None = None, same_ts: bool = False
) -> Outcome:
    """Run the worker to its end, or until it kills itself (``crash``) or the parent
    kills it after ``kill_after`` lines following its "ready" line. ``same_ts``: its
    messages come in turns sharing one role and whole-second timestamp."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WALSPOOL_SAME_TS": "1" if same_ts else "0"}
    env.pop("WALSPOOL_CRASH", None)
    if crash is not None:
        env["WALSPOOL_CRASH"] = crash
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
        timed_out = threading.Event()

        def hung() -> None:
            timed_out.set()
            proc.kill()

        watchdog = threading.Timer(TIMEOUT, hung)
        watchdog.start()
        lines: list[str] = []
        ready = None
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if not line.endswith("\n"):
                    continue
                lines.append(line[:-1])
                if ready is None and line == "P ready\n":
                    ready = len(lines)
                if kill_after is not None and ready is not None:
                    if len(lines) - ready >= kill_after:
                        proc.send_signal(signal.SIGKILL)
                        kill_after = None  # keep reading what was printed before it landed
            proc.wait(TIMEOUT)
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait(TIMEOUT)
            proc.stdout.close()
        err.seek(0)
        return Outcome(lines, proc.returncode, err.read(), timed_out.is_set())


#: In a worker's stderr, signs of a failure that a kill must never cause.
FORBIDDEN = ("Traceback", "moved it aside")


def expect_kill(scenario: str, outcome: Outcome, what: str) -> None:
    assert outcome.killed(), (what, outcome.returncode, outcome.timed_out, outcome.stderr[-3000:])
    for word in FORBIDDEN:
        assert word not in outcome.stderr, (what, outcome.stderr[-3000:])
    KILLS[scenario] += 1


def expect_clean(outcome: Outcome, what: str) -> None:
    assert outcome.returncode == 0 and not outcome.timed_out, (
        what,
        outcome.returncode,
        outcome.stderr[-3000:],
    )
    for word in FORBIDDEN:
        assert word not in outcome.stderr, (what, outcome.stderr[-3000:])


# -- reading what survived ------------------------------------------------------------------


def key_of(content: str) -> tuple[int, int, int]:
    run, t, i = content.split(":")
    return int(run), int(t), int(i)


def spool_rows(path: Path) -> list[walspool.Record]:
    """``walspool check`` passes and the spool opens again; return its records."""
    assert cli_main(["check", str(path)]) == 0
    with walspool.Spool(path) as spool:
        return list(spool.records())


def state_rows(path: Path) -> dict[str, list[tuple[int, int, int]]]:
    """Each session's messages in state.db, in transcript order (``ORDER BY id``)."""
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT session_id, content FROM messages ORDER BY id").fetchall()
    finally:
        conn.close()
    by_session: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for session_id, content in rows:
        by_session[session_id].append(key_of(content))
    return by_session


def create_sessions(state_db: Path, sessions: list[str]) -> None:
    db = hermes_state.SessionDB(db_path=state_db)
    for s in sessions:
        db.create_session(s, "telegram")
    db.close()


@dataclass
class Ledger:
    """What the workers acknowledged, across a sequence of kills."""

    #: (session, run, thread, index) of every acknowledged message.
    acked: set[tuple[str, int, int, int]] = field(default_factory=set)
    #: receipts: (session, seq) -> (run, thread, index)
    receipts: dict[tuple[str, int], tuple[int, int, int]] = field(default_factory=dict)
    #: (session, run, index) -> how it was acknowledged: [(worker run, line kind)]
    how: dict[tuple[str, int, int], list[tuple[int, str]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    runs: int = 0

    def add(self, outcome: Outcome, keep: Path | None = None) -> int:
        """Record a worker's acknowledgements; keep its output in ``keep`` if given."""
        self.runs += 1
        if keep is not None:
            keep.mkdir(exist_ok=True)
            (keep / f"{self.runs}.out").write_text("\n".join(outcome.lines))
            (keep / f"{self.runs}.err").write_text(outcome.stderr)
        n = 0
        for session, seq, run, t, i in outcome.lines_of("A"):
            self.acked.add((session, int(run), int(t), int(i)))
            self.receipts[(session, int(seq))] = (int(run), int(t), int(i))
            n += 1
        for kind in ("S", "W", "L"):
            for session, run, i, *_ in outcome.lines_of(kind):  # S adds the record's id
                self.acked.add((session, int(run), -1, int(i)))  # thread unknown: -1
                self.how[(session, int(run), int(i))].append((self.runs, kind))
                n += 1
        return n


def check_world(
    spool_path: Path, state_db: Path, ledger: Ledger, *, prefix: bool, final: bool = False
) -> tuple[int, int]:
    """Check every invariant on the spool and state.db as a kill left them."""
    records = spool_rows(spool_path)
    state = state_rows(state_db)
    spooled: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for rec in records:
        spooled[rec.session_id].append(key_of(rec.message["content"]))
        # an acknowledged receipt names this very message
        want = ledger.receipts.get((rec.session_id, rec.seq))
        if want is not None:
            assert key_of(rec.message["content"]) == want, (rec.session_id, rec.seq)
    if final:
        assert records == [], f"{len(records)} rows left in the spool after recovery"
    for session, keys in state.items():
        order = [(run, i) for run, _, i in keys]
        # no message twice, and append order (run, index) kept
        assert order == sorted(set(order)), f"state.db {session}: duplicate or out of order"
    for session, keys in spooled.items():
        order = [(run, i) for run, _, i in keys]
        assert order == sorted(set(order)), f"spool {session}: duplicate or out of order"
        landed = {(run, i) for run, _, i in state.get(session, [])}
        waiting = [k for k in order if k not in landed]
        if waiting and landed:
            # rows still to replay must not be older than rows already in state.db
            assert max(landed) < min(waiting), f"{session}: a spooled row fell behind"
    present = {(s, run, i) for s, keys in state.items() for run, _, i in keys}
    present |= {(s, run, i) for s, keys in spooled.items() for run, _, i in keys}
    lost = sorted((s, run, i) for s, run, _, i in ledger.acked if (s, run, i) not in present)
    assert lost == [], (
        f"{len(lost)} acknowledged messages lost, e.g. {lost[:5]}, acknowledged by "
        f"(worker run, line kind) {[ledger.how.get(k) for k in lost[:5]]} of {ledger.runs}"
    )
    if prefix:
        # a thread appends message i only after i-1 was taken in order, so what
        # survived of one thread's run is a prefix: a hole is a lost commit
        by_thread: dict[tuple[int, int], set[int]] = defaultdict(set)
        for keys in [*state.values(), *spooled.values()]:
            for run, t, i in keys:
                by_thread[(run, t)].add(i)
        for (run, t), got in by_thread.items():
            assert got == set(range(len(got))), f"run {run} thread {t}: a hole in {sorted(got)}"
    return sum(len(v) for v in state.values()), len(records)


# -- (a) appends: threads and submit ------------------------------------------------------

APPEND_THREADS, APPEND_SESSIONS = 8, 2  # sessions a<t>-<k>, k < 2, owned by thread t


def replay_to_the_end(spool_path: Path, state_db: Path) -> None:
    expect_clean(run_worker("replay", spool_path, state_db, 0, 64, 0, 2), "clean replay")


@pytest.mark.parametrize(
    "kills, seed",
    [pytest.param(8, 1, id="quick"), pytest.param(50, 11, id="full", marks=pytest.mark.slow)],
)
def test_appends_killed_lose_nothing_acknowledged(tmp_path, kills, seed):
    PLANNED["append"] += kills
    rng = random.Random(seed)
    spool_path, state_db = tmp_path / "spool" / "spool.db", tmp_path / "state.db"
    sessions = [f"a{t}-{k}" for t in range(APPEND_THREADS) for k in range(APPEND_SESSIONS)]
    create_sessions(state_db, sessions)
    ledger = Ledger()
    for run in range(1, kills + 1):
        point = ["commit", "committed", "ack", "random"][run % 4]
        durability = rng.choice(["full", "normal"])
        crash, kill_after = None, None
        if point in ("commit", "committed"):
            crash = f"{point}:{rng.randint(1, 40)}"
        elif point == "ack":
            crash = f"ack:{rng.randint(1, 2000)}"
        else:
            kill_after = rng.randint(1, 2500)
        outcome = run_worker(
            "append",
            spool_path,
            run,
            APPEND_THREADS,
            APPEND_SESSIONS,
            durability,
            crash=crash,
            kill_after=kill_after,
        )
        expect_kill("append", outcome, crash or f"random after {kill_after}")
        ledger.add(outcome)
        check_world(spool_path, state_db, ledger, prefix=True)
        if run % 10 == 0:
            replay_to_the_end(spool_path, state_db)
            check_world(spool_path, state_db, ledger, prefix=True, final=True)
    replay_to_the_end(spool_path, state_db)
    in_state, _ = check_world(spool_path, state_db, ledger, prefix=True, final=True)
    assert in_state >= len(ledger.acked) > 0
    assert KILLS["append"] >= PLANNED["append"]


# -- (b) replay into a real SessionDB, appends going on --------------------------------------

PREFILL_SESSIONS, PREFILL_EACH = 6, 400
REPLAY_APPENDERS = 2  # sessions r<t>-<k>, k < 2


def prefill(spool_path: Path, ledger: Ledger, same_ts: bool = False) -> None:
    """Rows every replay starts from: six sessions interleaved, some with their own time
    (``same_ts``: all, in turns of eight sharing one role and whole second)."""
    with walspool.Spool(spool_path) as spool:
        items = []
        for i in range(PREFILL_EACH):
            for k in range(PREFILL_SESSIONS):
                t = 100 + k
                message = {"role": "assistant" if i % 2 else "user", "content": f"0:{t}:{i}"}
                if same_ts:
                    message = {"role": "tool", "content": f"0:{t}:{i}"}
                    message["timestamp"] = 1_700_000_000 + i // 8
                elif i % 3 == 0:
                    message["timestamp"] = 1_700_000_000 + i * 7 + k
                items.append((f"p{k}", message))
        for receipt, (session, message) in zip(spool.append_many(items), items, strict=True):
            run, t, i = key_of(message["content"])
            ledger.acked.add((session, run, t, i))
            ledger.receipts[(session, receipt.seq)] = (run, t, i)


@pytest.mark.parametrize(
    "kills, seed, same_ts",
    [
        pytest.param(8, 2, False, id="quick"),
        pytest.param(8, 5, True, id="quick-same-ts"),
        pytest.param(60, 12, False, id="full", marks=pytest.mark.slow),
        pytest.param(60, 15, True, id="full-same-ts", marks=pytest.mark.slow),
    ],
)
def test_replay_killed_moves_everything_exactly_once(tmp_path, kills, seed, same_ts):
    """``same_ts``: every row of a turn has the same role and whole-second timestamp,
    the traffic a guess from (role, timestamp) gets wrong."""
    PLANNED["replay"] += kills
    rng = random.Random(seed)
    spool_path, state_db = tmp_path / "spool" / "spool.db", tmp_path / "state.db"
    sessions = [f"p{k}" for k in range(PREFILL_SESSIONS)]
    sessions += [f"r{t}-{k}" for t in range(REPLAY_APPENDERS) for k in range(2)]
    create_sessions(state_db, sessions)
    ledger = Ledger()
    prefill(spool_path, ledger, same_ts)
    points = [
        "before_write",
        "after_write",
        "after_mark",
        "during_settle",
        "commit",
        "committed",
        "random",
    ]
    for run in range(1, kills + 1):
        point = points[run % len(points)]
        batch_rows = rng.choice([1, 4, 16, 64])
        crash, kill_after = None, None
        if point in ("before_write", "after_write"):
            crash = f"{point}:{rng.randint(1, 60)}"
        elif point in ("after_mark", "during_settle"):
            crash = f"{point}:{rng.randint(1, 6)}"
        elif point in ("commit", "committed"):
            crash = f"{point}:{rng.randint(1, 40)}"
        else:
            kill_after = rng.randint(1, 400)
        outcome = run_worker(
            "replay",
            spool_path,
            state_db,
            run,
            batch_rows,
            REPLAY_APPENDERS,
            2,
            crash=crash,
            kill_after=kill_after,
            same_ts=same_ts,
        )
        expect_kill("replay", outcome, crash or f"random after {kill_after}")
        ledger.add(outcome)
        check_world(spool_path, state_db, ledger, prefix=True)
        if run % 15 == 0:
            replay_to_the_end(spool_path, state_db)
            check_world(spool_path, state_db, ledger, prefix=True, final=True)
    replay_to_the_end(spool_path, state_db)
    in_state, _ = check_world(spool_path, state_db, ledger, prefix=True, final=True)
    assert in_state >= PREFILL_SESSIONS * PREFILL_EACH
    prefilled = state_rows(state_db)
    for k in range(PREFILL_SESSIONS):
        assert prefilled[f"p{k}"] == [(0, 100 + k, i) for i in range(PREFILL_EACH)]
    assert KILLS["replay"] >= PLANNED["replay"]


# -- (c) drain through the gateway link on a real 0.19.0 SessionStore ------------------------

GATEWAY_THREADS = 2  # sessions g<t>-<k>, k < 2, fed by thread t


@pytest.mark.parametrize(
    "kills, seed, same_ts",
    [
        pytest.param(7, 3, False, id="quick"),
        pytest.param(7, 6, True, id="quick-same-ts"),
        pytest.param(50, 13, False, id="full", marks=pytest.mark.slow),
        pytest.param(50, 16, True, id="full-same-ts", marks=pytest.mark.slow),
    ],
)
def test_gateway_killed_while_outages_come_and_go(tmp_path, kills, seed, same_ts):
    PLANNED["gateway"] += kills
    rng = random.Random(seed)
    home = tmp_path / "hermes"
    home.mkdir()
    spool_path, state_db = home / "spool.db", home / "state.db"
    create_sessions(state_db, [f"g{t}-{k}" for t in range(GATEWAY_THREADS) for k in range(2)])
    ledger = Ledger()
    points = [
        "before_write",
        "after_write",
        "during_settle",
        "commit",
        "committed",
        "after_mark",
        "random",
    ]
    drained = evicted = 0
    for run in range(1, kills + 1):
        point = points[run % len(points)]
        start = rng.choice(["broken", "healed"])
        phase = rng.choice([500, 900])
        crash, kill_after = None, None
        if point == "before_write":  # failed attempts during an outage count too
            crash = f"{point}:{rng.randint(1, 400)}"
        elif point == "after_write":  # writes that committed: drains
            crash = f"{point}:{rng.randint(1, 300)}"
        elif point in ("after_mark", "during_settle"):
            crash = f"{point}:{rng.randint(1, 6)}"
        elif point in ("commit", "committed"):
            crash = f"{point}:{rng.randint(1, 60)}"
        else:
            kill_after = rng.randint(1, 2000)
        outcome = run_worker(
            "gateway",
            home,
            run,
            GATEWAY_THREADS,
            phase,
            start,
            crash=crash,
            kill_after=kill_after,
            same_ts=same_ts,
        )
        expect_kill("gateway", outcome, crash or f"random after {kill_after}")
        ledger.add(outcome, keep=tmp_path / "runs")
        drained += len(outcome.lines_of("W"))
        evicted += len(outcome.lines_of("S"))
        check_world(spool_path, state_db, ledger, prefix=False)
        if run % 10 == 0:
            finish_gateway(home, ledger)
    finish_gateway(home, ledger)
    # the checks saw committed evictions (S lines), not only the gateway's own writes
    assert evicted > 0 and drained > 0
    assert KILLS["gateway"] >= PLANNED["gateway"]


def finish_gateway(home: Path, ledger: Ledger) -> None:
    """Heal state.db and start once more: ``install`` recovers every spooled row."""
    outcome = run_worker("finish", home)
    expect_clean(outcome, "gateway recovery")
    ledger.add(outcome, keep=home.parent / "runs")
    (report,) = outcome.lines_of("R")
    assert json.loads(report[0])["held"] == 0
    check_world(home / "spool.db", home / "state.db", ledger, prefix=False, final=True)


# -- (d) import of upstream's JSON spool ---------------------------------------------------

TS = 1_760_000_000
IMPORT_SESSIONS = 5


def write_files(directory: Path, first: int, count: int) -> None:
    """Files as upstream's shutdown_flush writes them; drop order is index order.

    Shutdown slots come in blocks of 20 among cap drops, so batches fill up to
    ``batch_files`` between the reason changes that split them.
    """
    for i in range(first, first + count):
        session = f"s{i % IMPORT_SESSIONS}"
        ts, seq = TS + i // 50, i % 50
        if i % 200 >= 180:
            payload: dict[str, Any] = {
                "session_key": f"agent:main:telegram:dm:{session}",
                "reason": SHUTDOWN,
                "ts": ts,
                "seq": seq,
                "data": {"text": "x" * 200, "i": i, "session_id": session},
            }
        else:
            payload = {
                "session_key": session,
                "reason": CAP_DROP,
                "ts": ts,
                "seq": seq,
                "data": {
                    "session_id": session,
                    "message": {"role": "user", "content": "y" * 200, "i": i},
                },
            }
        path = directory / f"pending-{uuid.uuid4().hex}.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with open(fd, "w") as f:
            json.dump(payload, f, indent=2, ensure_ascii=False)


def files_left(directory: Path) -> dict[int, str]:
    left = {}
    for path in directory.glob("pending-*.json"):
        payload = json.loads(path.read_text())
        data = payload["data"]
        left[data["message"]["i"] if "message" in data else data["i"]] = path.name
    return left


@pytest.mark.parametrize(
    "kills, seed",
    [pytest.param(7, 4, id="quick"), pytest.param(50, 14, id="full", marks=pytest.mark.slow)],
)
def test_import_killed_loses_nothing_and_duplicates_only_in_the_window(tmp_path, kills, seed):
    PLANNED["import"] += kills
    rng = random.Random(seed)
    spool_path, directory = tmp_path / "spool" / "spool.db", tmp_path / "pending_messages"
    directory.mkdir(mode=0o700)
    written = 0
    last_overlap: dict[int, int] = {}  # file index -> its rows in the spool at that kill
    previous: set[int] = set()
    points = ["before_append", "after_append", "unlink", "random"]
    for run in range(1, kills + 1):
        if len(files_left(directory)) < 400:
            write_files(directory, written, 600)
            written += 600
        point = points[run % len(points)]
        batch = rng.choice([4, 16, 64])
        crash, kill_after = None, None
        if point in ("before_append", "after_append"):
            crash = f"{point}:{rng.randint(1, 4)}"
        elif point == "unlink":
            crash = f"unlink:{rng.randint(1, 60)}"
        else:
            kill_after = rng.randint(1, 8)
        outcome = run_worker(
            "import", spool_path, directory, batch, crash=crash, kill_after=kill_after
        )
        what = crash or f"random after {kill_after}"
        expect_kill("import", outcome, what)
        rows = Counter(rec.message["i"] for rec in spool_rows(spool_path))
        left = files_left(directory)
        lost = set(range(written)) - set(rows) - set(left)
        assert not lost, f"{what}: lost {sorted(lost)[:10]}"
        overlap = set(rows) & set(left)
        # committed by this run and not unlinked: new to the overlap, or imported once
        # more since the last kill left it behind
        fresh = {i for i in overlap if i not in previous or rows[i] > last_overlap[i]}
        if point == "before_append":
            assert not fresh, what  # nothing new is committed at this point
        if point == "after_append":
            assert fresh, what  # the batch is committed, none of it unlinked
        assert len(fresh) <= batch, what
        for i in overlap:
            last_overlap[i] = rows[i]
        previous = overlap
    expect_clean(run_worker("import", spool_path, directory, 256), "final import")
    assert files_left(directory) == {}
    records = spool_rows(spool_path)
    occurrences = Counter(rec.message["i"] for rec in records)
    assert set(occurrences) == set(range(written))
    # each file is in the spool once, plus once more for each time a kill left it
    # behind after its row was committed
    for i, n in occurrences.items():
        assert n == last_overlap.get(i, 0) + 1, (i, n, last_overlap.get(i))
    for s in range(IMPORT_SESSIONS):
        firsts = list(dict.fromkeys(r.message["i"] for r in records if r.session_id == f"s{s}"))
        assert firsts == sorted(firsts), f"s{s}: drop order not kept"
    assert KILLS["import"] >= PLANNED["import"]


# -- found by the matrix ------------------------------------------------------------------


def test_a_spool_written_before_the_size_column_keeps_its_rows(spool_path):
    # The file as schema 1 wrote it (before the size column and its indexes).
    make_v2_spool(spool_path, [("s", 1, '{"content": "spooled by the previous version"}', None)])
    conn = apsw.Connection(str(spool_path))
    conn.execute(DOWNGRADE_TO_V1_SQL)
    conn.close()
    with walspool.Spool(spool_path) as spool:
        kept = [r.message["content"] for r in spool.records()]
    assert kept == ["spooled by the previous version"]
    assert not [p for p in spool_path.parent.iterdir() if ".damaged-" in p.name]
