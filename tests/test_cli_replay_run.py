"""The real ``walspool replay`` in an incident: another replay running (``--wait``),
SIGINT and SIGTERM, and progress with rate and ETA."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import apsw
import pytest
from _gateway import state_db
from _helpers import ROOT
from _lock_holder import replay_lock_held

import walspool
from walspool.cli import main
from walspool.cli._output import Progress
from walspool.store.checks import BOOKKEEPING_CHECKS

hermes_state = pytest.importorskip("hermes_state")

#: Bound on every wait for a child process.
CHILD_TIMEOUT = 120.0


def spool_of(path: Path, rows: int, session: str = "s1") -> Path:
    with walspool.Spool(path) as spool:
        spool.append_many([(session, {"role": "user", "content": f"m{i}"}) for i in range(rows)])
    return path


def messages(path: Path, session: str) -> list[str]:
    db = hermes_state.SessionDB(db_path=path)
    try:
        return [m["content"] for m in db.get_messages(session)]
    finally:
        db.close()


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def child(*argv: Any, code: str | None = None) -> subprocess.Popen[str]:
    """``walspool ARGV`` (or ``code`` with ARGV) in a child; killed if it outlives the bound."""
    command = ["-m", "walspool"] if code is None else ["-c", code]
    proc = subprocess.Popen(
        [sys.executable, *command, *map(str, argv)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    killer = threading.Timer(CHILD_TIMEOUT, proc.kill)
    killer.daemon = True
    killer.start()
    return proc


# -- exit status ---------------------------------------------------------------------------


def test_rows_both_held_and_quarantined_exit_3_for_the_held(tmp_path, capsys):
    """One session's row is quarantined (its payload is not JSON: a hand edit) while
    another session is held (missing from state.db): the replay exits 3, not 5, since
    what is held needs the operator first and a rerun moves it."""
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append("s1", {"role": "user", "content": "fine"})
        bad = spool.append("s1", {"role": "user", "content": "edited by hand"})
        spool.append("gone", {"role": "user", "content": "no session in state.db"})
    with apsw.Connection(str(path)) as conn:
        conn.execute("UPDATE records SET payload = '{not json' WHERE id = ?", (bad.id,))
    state = state_db(tmp_path / "state.db", "s1")
    rc, out, _ = run(capsys, "replay", path, "--into", state, "--json")
    report = json.loads(out)
    assert (report["moved"], report["held"], report["quarantined"]) == (1, 1, 1)
    assert rc == 3
    assert messages(state, "s1") == ["fine"]


@pytest.mark.parametrize("how", ["SPOOL given", "HERMES_HOME alone"])
def test_replay_goes_into_the_state_db_beside_the_spool_without_into(
    tmp_path, capsys, monkeypatch, how
):
    """No --into: the state.db beside SPOOL, which with the default SPOOL is
    $HERMES_HOME/state.db (the spool argument and the state.db follow one home)."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    monkeypatch.setenv("HERMES_HOME", str(home if how == "HERMES_HOME alone" else elsewhere))
    state = state_db(home / "state.db", "s1")
    with walspool.Spool(home / "spool.db") as spool:
        spool.append("s1", {"role": "user", "content": "kept"})
    argv = ["replay", "--json"] + ([home / "spool.db"] if how == "SPOOL given" else [])
    rc, out, err = run(capsys, *argv)
    assert (rc, err) == (0, "")
    assert json.loads(out)["state_db"] == str(state)
    assert messages(state, "s1") == ["kept"]
    assert not (elsewhere / "state.db").exists()


# -- another replay running --------------------------------------------------------------


def test_a_second_replay_does_not_wait_by_default(tmp_path, capsys):
    path = spool_of(tmp_path / "spool.db", 3)
    state = state_db(tmp_path / "state.db", "s1")
    lock = f"{path}.replay-lock"
    with replay_lock_held(path) as holder:
        before = digest(path)
        rc, out, err = run(capsys, "replay", path, "--into", state)
        assert (rc, out) == (4, "")
        assert err == (
            f"walspool replay: another replay of {path} is running (process "
            f"{holder.proc.pid} holds {lock}); not waiting; run again when it ends, or give "
            "--wait SECONDS\n"
        )
        # It never ran: no progress line ("replay: 0 rows, took 0s") before the refusal.
        again = run(capsys, "replay", path, "--into", state, "--progress")
        assert again == (rc, out, err)
        assert digest(path) == before
        # --json: the error object on stdout, as for every other error.
        rc, out, err = run(capsys, "replay", path, "--into", state, "--json")
        assert rc == 4
        error = err[len("walspool replay: ") : -1]
        assert json.loads(out) == {"command": "replay", "error": error, "exit": 4}
    # A holder that wrote no pid (not walspool): the message says how to find it.
    with replay_lock_held(path, anonymous=True):
        rc, out, err = run(capsys, "replay", path, "--into", state)
        assert (rc, out) == (4, "")
        assert err == (
            f"walspool replay: another replay of {path} is running (it holds {lock}); not "
            f"waiting; run again when it ends, or give --wait SECONDS (`fuser {lock}` names "
            "its process)\n"
        )
    assert messages(state, "s1") == []
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    assert "exit 4 at once" in " ".join(capsys.readouterr().out.split())


def test_wait_gives_up_after_its_seconds(tmp_path, capsys):
    path = spool_of(tmp_path / "spool.db", 3)
    state = state_db(tmp_path / "state.db", "s1")
    lock = f"{path}.replay-lock"
    with replay_lock_held(path) as holder:
        rc, out, err = run(capsys, "replay", path, "--into", state, "--wait", "0.2")
    pid = holder.proc.pid
    assert (rc, out) == (4, "")
    assert err.splitlines() == [
        f"walspool replay: waiting for another replay of {path} (process {pid} holds {lock}), "
        "at most 0.2 s",
        f"walspool replay: another replay of {path} (process {pid}) still holds {lock} after "
        "0.2 s; run again when it ends",
    ]
    assert messages(state, "s1") == []


def test_wait_outlasts_the_other_replay(tmp_path):
    """The waiting replay says so, and runs once the other lets go."""
    path = spool_of(tmp_path / "spool.db", 3)
    state = state_db(tmp_path / "state.db", "s1")
    with replay_lock_held(path) as holder:
        proc = child("replay", path, "--into", state, "--wait", "600")
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert line.startswith(f"walspool replay: waiting for another replay of {path}")
        holder.release()
        out, err = proc.communicate(timeout=CHILD_TIMEOUT)
    assert (proc.returncode, out, err) == (0, f"moved 3 rows from {path} into {state}\n", "")
    assert messages(state, "s1") == ["m0", "m1", "m2"]


def test_bad_wait_is_bad_usage(capsys):
    for wait in ("-1", "soon", "nan", "inf"):
        with pytest.raises(SystemExit) as exit_:
            main(["replay", "spool.db", "--into", "state.db", "--wait", wait])
        assert exit_.value.code == 2
        assert "is not a number of seconds" in capsys.readouterr().err


# -- SIGINT and SIGTERM ------------------------------------------------------------------

#: The CLI, with hermes' append_message stopping after its 2nd commit until the test
#: signals it (it prints ``wrote 2`` on stderr first): a replay caught mid-batch, one
#: row landed but still in flight in the spool.
STOPPING_CHILD = """
import functools, sys
import hermes_state
from walspool.cli import main

original = hermes_state.SessionDB.append_message
writes = 0

@functools.wraps(original)
def append_message(self, *args, **kwargs):
    global writes
    result = original(self, *args, **kwargs)
    writes += 1
    if writes == 2:
        print("wrote 2", file=sys.stderr, flush=True)
        sys.stdin.readline()
    return result

hermes_state.SessionDB.append_message = append_message
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_reports_what_moved_and_what_is_in_flight(tmp_path, capsys, signum, status):
    """A real replay process stopped by the signal in its first batch: it says it moved
    no row, left 5 in flight of which 2 are in state.db, and exits 128 + signal; the
    spool checks clean; the next replay recovers the 2 without writing them again and
    moves the other 3: each message once."""
    path = spool_of(tmp_path / "spool.db", 5)
    state = state_db(tmp_path / "state.db", "s1")
    proc = child("replay", path, "--into", state, code=STOPPING_CHILD)
    assert proc.stderr is not None
    assert proc.stderr.readline() == "wrote 2\n"
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=CHILD_TIMEOUT)
    name = signal.Signals(signum).name
    assert proc.returncode == status, err
    # The rows written are the progress line's count: 2 written, none of them gone yet.
    assert out.splitlines() == [
        f"interrupted by {name} after writing 2 rows into {state}: 0 of them left {path}",
        "5 rows still in flight, 2 of them already in state.db: the next replay removes "
        "those without writing them again and writes the others first",
    ]
    assert err == f"walspool replay: interrupted by {name}; run the replay again to finish\n"
    assert messages(state, "s1") == ["m0", "m1"]
    assert run(capsys, "check", path)[0] == 0

    rc, out, err = run(capsys, "replay", path, "--into", state, "--json")
    report = json.loads(out)
    assert (rc, err) == (0, "")
    assert (report["recovered"], report["moved"], report["inflight"]) == (2, 3, 0)
    assert report["interrupted"] is None
    assert messages(state, "s1") == [f"m{i}" for i in range(5)]
    assert json.loads(run(capsys, "stats", path, "--json")[1])["rows"] == 0


#: A BEFORE INSERT trigger that keeps SQLite busy in C for a few seconds: a signal sent
#: meanwhile is handled at the next Python code, the sink's ticket function that the
#: same INSERT calls.
SLOW_INSERT = """
CREATE TRIGGER slow_insert BEFORE INSERT ON messages BEGIN
    SELECT count(*) FROM (
        WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 20000000)
        SELECT x FROM c
    );
END
"""


def write_lock_taken(path: Path) -> bool:
    """Whether another connection holds state.db's write lock now."""
    import sqlite3

    conn = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
        return False
    except sqlite3.OperationalError as exc:
        assert "locked" in str(exc), exc
        return True
    finally:
        conn.close()


def test_a_sigterm_during_a_rows_insert_stops_the_replay_after_that_row(tmp_path):
    """SIGTERM while the replay is inside a row's INSERT (a slow trigger of state.db's
    own runs): the row is written, with its ticket, and the replay stops there, exit
    143, saying so; the next replay writes the rest, each message once (before: the
    signal's exception was raised inside the ticket function, sqlite3 swallowed it,
    the row was held with "user-defined function raised exception", later signals were
    ignored and the replay ran to its end, exit 3). A SIGTERM that lands while the
    replay still checks state.db (its trial write takes the write lock too, briefly)
    stops it the same way, with nothing written (before: the signal's default action
    killed it, no report)."""
    import sqlite3

    path = spool_of(tmp_path / "spool.db", 3)
    state = state_db(tmp_path / "state.db", "s1")
    conn = sqlite3.connect(state)
    conn.executescript(SLOW_INSERT)
    conn.close()
    proc = child("replay", path, "--into", state, "--json")
    deadline = time.monotonic() + CHILD_TIMEOUT
    while not write_lock_taken(state):  # the first row's transaction has begun
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the replay never took state.db's write lock"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=CHILD_TIMEOUT)
    assert proc.returncode == 143, out + err
    report = json.loads(out)
    assert report["interrupted"] == "SIGTERM" and report["held"] == 0, report
    assert "user-defined function" not in out + err
    conn = sqlite3.connect(state)
    conn.execute("DROP TRIGGER slow_insert")
    conn.commit()
    conn.close()
    done = subprocess.run(
        [sys.executable, "-m", "walspool", "replay", str(path), "--into", str(state)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert messages(state, "s1") == ["m0", "m1", "m2"]


def test_after_a_signal_the_progress_line_and_the_summary_agree(tmp_path, capsys):
    """The signal cuts the 2nd write short after its commit: the progress line had
    counted 1, the summary says 2 are in state.db; the line ends on that 2 as well.
    The rerun finds those 2 in state.db (recovered, not written again) and writes the
    other 3: its line ends on all 5, not 3 of 5."""
    path = spool_of(tmp_path / "spool.db", 5)
    state = state_db(tmp_path / "state.db", "s1")
    proc = child("replay", path, "--into", state, "--progress", code=STOPPING_CHILD)
    assert proc.stderr is not None
    drawn = ""
    while not drawn.endswith("wrote 2\n"):  # the progress line comes first on stderr
        line = proc.stderr.readline()
        assert line, drawn  # the child ended (or was killed at its bound) first
        drawn += line
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=CHILD_TIMEOUT)
    assert proc.returncode == 130, err
    # Text mode reads the progress line's \r as a line end: its last draw is a line.
    last = [line.rstrip() for line in err.splitlines() if line.startswith("replay: ")][-1]
    assert re.fullmatch(r"replay: 2/5 \(40%\), [\d,]+ rows/s, took \d+s", last), err
    assert out.splitlines()[0].startswith("interrupted by SIGINT after writing 2 rows into ")
    assert messages(state, "s1") == ["m0", "m1"]

    rc, out, err = run(capsys, "replay", path, "--into", state, "--progress")
    assert rc == 0, err
    last = err.split("\r")[-1].splitlines()[0].rstrip()
    assert re.fullmatch(r"replay: 5/5 \(100%\), [\d,]+ rows/s, took \d+s", last), err
    assert messages(state, "s1") == ["m0", "m1", "m2", "m3", "m4"]


def test_the_line_drawn_after_a_ctrl_c_covers_the_echoed_c():
    """A terminal echoes ^C where the cursor is, at the end of the progress line; the
    final line covers those two characters too, so it never reads "took 22s ^C"."""
    stream = io.StringIO()
    progress = Progress("replay", stream, enabled=True)
    progress(1, 10)
    first = stream.getvalue()  # "\r" and the line
    progress.close(interrupted=True)
    final = stream.getvalue()[len(first) :]  # "\r", the line, spaces, "\n"
    assert final.startswith("\rreplay: 1/10 (10%)") and final.endswith("\n")
    assert len(final) - 2 >= len(first) - 1 + 2


def test_a_signal_with_json_prints_the_partial_report(tmp_path):
    path = spool_of(tmp_path / "spool.db", 5)
    state = state_db(tmp_path / "state.db", "s1")
    proc = child("replay", path, "--into", state, "--json", code=STOPPING_CHILD)
    assert proc.stderr is not None and proc.stderr.readline() == "wrote 2\n"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=CHILD_TIMEOUT)
    assert proc.returncode == 143
    report = json.loads(out)
    assert (report["moved"], report["inflight"], report["inflight_landed"]) == (0, 5, 2)
    assert report["written"] == 2
    assert report["interrupted"] == "SIGTERM"


# -- progress ----------------------------------------------------------------------------

LINE = r"{label}: {done}/{total} \({pct}%\), [\d,]+ {unit}/s, {tail}"


def test_progress_forced_shows_rate_and_eta(tmp_path, capsys):
    """--progress draws on stderr even when it is not a terminal: the first write at
    once, with its rate and an ETA, and the final count with the time taken."""
    path = spool_of(tmp_path / "spool.db", 3)
    state = state_db(tmp_path / "state.db", "s1")
    rc, out, err = run(capsys, "replay", path, "--into", state, "--progress")
    assert (rc, out) == (0, f"moved 3 rows from {path} into {state}\n")
    drawn = [d.rstrip() for d in err.split("\r")]
    assert drawn[0] == "" and err.endswith("\n")
    first = LINE.format(label="replay", done=1, total=3, pct=33, unit="rows", tail=r"ETA \d+s")
    assert re.fullmatch(first, drawn[1]), drawn
    last = LINE.format(label="replay", done=3, total=3, pct=100, unit="rows", tail=r"took \d+s")
    assert re.fullmatch(last, drawn[-1]), drawn

    pending = tmp_path / "pending"
    pending.mkdir()
    for i in range(2):
        entry = {"session_id": "s1", "message": {"role": "user", "content": f"x{i}"}}
        data = {"session_key": "s1", "reason": "transcript_cap_drop", "ts": 1000 + i, "seq": i}
        (pending / f"pending-{i}.json").write_text(json.dumps({**data, "data": entry}))
    rc, out, err = run(capsys, "import-json", tmp_path / "new.db", pending, "--progress")
    assert rc == 0
    last = LINE.format(label="import", done=2, total=2, pct=100, unit="files", tail=r"took \d+s")
    assert re.fullmatch(last, err.split("\r")[-1].rstrip()), err
    rc, out, err = run(capsys, "export", path, "--progress")
    assert (rc, out) == (0, "")
    assert re.fullmatch(r"\rexport: 0 rows, took \d+s\n", err), err


def test_check_and_vacuum_progress_name_each_step_as_it_begins(tmp_path, capsys):
    """``check --progress`` and ``vacuum --progress`` (tasks of named steps, with no
    count to give) draw each step as it begins, numbered, with the time so far, then
    the steps done and the time taken; stdout is what it is without them."""
    path = spool_of(tmp_path / "spool.db", 300)
    rc, plain, _ = run(capsys, "check", path)
    rc, out, err = run(capsys, "check", path, "--progress")
    assert (rc, out) == (0, plain)
    drawn = [d.rstrip() for d in err.split("\r")][1:]
    total = 4 + len(BOOKKEEPING_CHECKS)
    assert re.fullmatch(rf"check: step 1/{total}, PRAGMA integrity_check, \d+s", drawn[0])
    numbers = [int(m[1]) for d in drawn if (m := re.match(rf"check: step (\d+)/{total}, ", d))]
    assert sorted(set(numbers)) == list(range(1, total + 1)) and numbers == sorted(numbers)
    assert re.fullmatch(rf"check: {total} steps, took \d+s", drawn[-1]) and err.endswith("\n")

    with walspool.Spool(path) as spool:
        spool.transact(lambda c: c.execute("DELETE FROM records WHERE id > 10"))
    rc, out, err = run(capsys, "vacuum", path, "--progress")
    assert rc == 0 and out.startswith(f"{path}: ")
    drawn = [d.rstrip() for d in err.split("\r")][1:]
    assert re.fullmatch(r"vacuum: step 1/2, copying [\d.]+ MiB of rows, \d+s", drawn[0]), drawn
    assert re.fullmatch(r"vacuum: step 2/2, truncating the -wal, \d+s", drawn[-2]), drawn
    assert re.fullmatch(r"vacuum: 2 steps, took \d+s", drawn[-1]) and err.endswith("\n")
    rc, out, err = run(capsys, "vacuum", path, "--progress")  # nothing freed since
    assert rc == 0 and "vacuum: step 1/2, no free pages" in err
