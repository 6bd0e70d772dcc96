"""``walspool replay --dry-run`` is honest: each session's first row is tried against
state.db and rolled back, so what would be held is what a replay holds, and neither
the spool nor state.db changes."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import apsw
import pytest
from _gateway import state_db
from _helpers import run_python
from test_operators import KILLED_READER, NOBODY, as_root, shared_tmp, spool_of, walspool_as

import walspool
from walspool.cli import _statedb, main
from walspool.replay.replayer import Replayer
from walspool.replay.sinks import SessionDBSink

__all__ = ["shared_tmp"]  # a fixture, used by name

hermes_state = pytest.importorskip("hermes_state")

TRIGGER = """
CREATE TRIGGER refuse_s2 BEFORE INSERT ON messages WHEN new.session_id = 's2'
BEGIN SELECT RAISE(ABORT, 'messages of s2 are refused here'); END
"""


def files_of(directory: Path) -> dict[str, str]:
    """Every file in ``directory`` by name, with its content's digest."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


def spool_of_two(path: Path) -> Path:
    with walspool.Spool(path) as spool:
        for i in range(3):
            spool.append("s1", {"role": "user", "content": f"s1 #{i}"})
            spool.append("s2", {"role": "user", "content": f"s2 #{i}"})
    return path


def replay_json(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    rc = main(["replay", *map(str, argv), "--json"])
    return rc, json.loads(capsys.readouterr().out)


def messages(path: Path, session: str) -> list[str]:
    db = hermes_state.SessionDB(db_path=path)
    try:
        return [m["content"] for m in db.get_messages(session)]
    finally:
        db.close()


def without(report: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in report.items() if k not in keys}


def test_a_trigger_that_refuses_inserts_shows_as_would_be_held(tmp_path, capsys):
    """The dry run meets the trigger as the replay does: s2 would be held with the
    trigger's error, s1 would move; nothing changes; then the replay does just that."""
    spool_dir, state_dir = tmp_path / "spool", tmp_path / "state"
    spool_dir.mkdir()
    state_dir.mkdir()
    path = spool_of_two(spool_dir / "spool.db")
    state = state_db(state_dir / "state.db", "s1", "s2")
    conn = sqlite3.connect(state)
    conn.execute(TRIGGER)
    conn.close()
    before = files_of(spool_dir), files_of(state_dir)

    rc, dry = replay_json(capsys, path, "--into", state, "--dry-run")
    assert rc == 3
    assert (dry["moved"], dry["held"]) == (3, 3)
    assert dry["errors"] == {"s2": "IntegrityError: messages of s2 are refused here"}
    assert (files_of(spool_dir), files_of(state_dir)) == before
    capsys.readouterr()
    assert main(["replay", str(path), "--into", str(state), "--dry-run"]) == 3
    out, err = capsys.readouterr()
    assert "would hold 3 rows in 1 session:" in out
    assert "messages of s2 are refused here" in out
    assert err == "walspool replay: 3 rows would be held in 1 session\n"
    assert (files_of(spool_dir), files_of(state_dir)) == before

    rc, real = replay_json(capsys, path, "--into", state)
    assert rc == 3
    assert without(real, "dry_run", "inflight") == without(dry, "dry_run", "inflight")
    assert real["inflight"] == 1  # s2's failed row, its ticket looked up before a retry
    assert messages(state, "s1") == ["s1 #0", "s1 #1", "s1 #2"]
    assert messages(state, "s2") == []


def test_create_missing_is_tried_too_and_rolled_back(tmp_path, capsys):
    """A missing session would be held; with --create-missing the session is created
    and the row written inside the trial, and both are rolled back."""
    path = spool_of_two(tmp_path / "spool.db")
    state = state_db(tmp_path / "state.db", "s1")
    before = hashlib.sha256(state.read_bytes()).hexdigest()
    rc, dry = replay_json(capsys, path, "--into", state, "--dry-run")
    assert rc == 3 and list(dry["errors"]) == ["s2"] and "FOREIGN KEY" in dry["errors"]["s2"]
    rc, dry = replay_json(capsys, path, "--into", state, "--dry-run", "--create-missing")
    assert (rc, dry["moved"], dry["held"]) == (0, 6, 0)
    assert hashlib.sha256(state.read_bytes()).hexdigest() == before
    db = hermes_state.SessionDB(db_path=state)
    try:
        assert db.get_session("s2") is None
        assert db.get_session("s1")["message_count"] == 0
    finally:
        db.close()


def test_a_locked_state_db_shows_as_would_be_held(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(_statedb, "STATE_DB_WAIT_SECONDS", 0.2)
    path = spool_of_two(tmp_path / "spool.db")
    state = state_db(tmp_path / "state.db", "s1", "s2")
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(state)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        rc, dry = replay_json(capsys, path, "--into", state, "--dry-run")
    finally:
        holder.communicate("", timeout=30)
    assert holder.returncode == 0
    assert (rc, dry["moved"], dry["held"]) == (3, 0, 6)
    assert dry["errors"] == {s: "OperationalError: database is locked" for s in ("s1", "s2")}


LOCK_HOLDER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.read()
conn.execute("ROLLBACK")
"""


@as_root
def test_a_state_db_the_user_cannot_write_shows_as_would_be_held(shared_tmp):
    """root's state.db (its -wal and -shm left by a killed reader), dry-run by nobody:
    every session would be held with SQLite's read-only error; nothing changes."""
    state = state_db(shared_tmp / "state.db", "s1")
    assert run_python(KILLED_READER, str(state)).returncode == 0
    path = spool_of(NOBODY, shared_tmp / "home")
    before = files_of(shared_tmp), files_of(path.parent)
    done = walspool_as(NOBODY, "replay", path, "--into", state, "--dry-run", "--json")
    assert done.returncode == 3, done.stderr
    report = json.loads(done.stdout)
    assert (report["moved"], report["held"]) == (0, 3)
    assert report["errors"] == {"s1": "OperationalError: attempt to write a readonly database"}
    assert done.stderr == "walspool replay: 3 rows would be held in 1 session\n"
    assert (files_of(shared_tmp), files_of(path.parent)) == before


class StopAfter(SessionDBSink):
    """Writes, and after the ``n``-th committed write stops the replay (as a signal
    would), leaving the batch in flight."""

    def __init__(self, db: Any, n: int) -> None:
        super().__init__(db)
        self.n, self.writes = n, 0

    def write(self, session_id: str, record: Any, ticket: Any) -> None:
        super().write(session_id, record, ticket)
        self.writes += 1
        if self.writes == self.n:
            raise KeyboardInterrupt


def test_rows_in_flight_and_bad_payloads_are_reported(tmp_path, capsys):
    """An interrupted replay left 5 rows in flight, 2 of them in state.db; one payload is
    not JSON. The dry run says 2 would be recovered, 1 quarantined, 2 moved; the
    replay then does exactly that, each message landing once."""
    path = tmp_path / "spool.db"
    state = state_db(tmp_path / "state.db", "s1")
    with walspool.Spool(path) as spool:
        spool.append_many([("s1", {"role": "user", "content": f"m{i}"}) for i in range(5)])
        db = hermes_state.SessionDB(db_path=state)
        with pytest.raises(KeyboardInterrupt):
            Replayer(spool, StopAfter(db, 2)).replay()
        db.close()
    conn = apsw.Connection(str(path))
    conn.execute("UPDATE records SET payload = 'not json {', size = 10 WHERE seq = 4")
    conn.close()
    spool_before = files_of(tmp_path)

    # Exit 5: nothing held, but a row would be (then was) quarantined.
    rc, dry = replay_json(capsys, path, "--into", state, "--dry-run")
    assert rc == 5
    assert (dry["inflight"], dry["recovered"], dry["quarantined"], dry["moved"]) == (5, 2, 1, 2)
    assert files_of(tmp_path) == spool_before
    capsys.readouterr()
    assert main(["replay", str(path), "--into", str(state), "--dry-run"]) == 5
    out = capsys.readouterr().out
    assert (
        "5 rows in flight (out with a replay or the gateway's drain now, or left by one that "
        "failed or was stopped): 2 already in state.db"
    ) in out
    assert "would quarantine 1 row: a payload that is not JSON" in out

    rc, real = replay_json(capsys, path, "--into", state)
    assert rc == 5
    assert (real["recovered"], real["quarantined"], real["moved"], real["inflight"]) == (2, 1, 2, 0)
    assert messages(state, "s1") == ["m0", "m1", "m2", "m4"]


def test_without_hermes_the_dry_run_judges_by_sessions(tmp_path, capsys, monkeypatch):
    """No hermes to try rows with: the dry run still says which sessions are missing."""
    path = spool_of_two(tmp_path / "spool.db")
    state = state_db(tmp_path / "state.db", "s1")
    before = files_of(tmp_path)
    monkeypatch.setitem(sys.modules, "hermes_state", None)
    rc, dry = replay_json(capsys, path, "--into", state, "--dry-run")
    assert (rc, dry["moved"], dry["held"], list(dry["errors"])) == (3, 3, 3, ["s2"])
    assert files_of(tmp_path) == before
