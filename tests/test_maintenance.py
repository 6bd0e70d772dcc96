"""walspool.store.maintenance and its commands: requeue, drop, vacuum, as an operator uses them."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import apsw
import pytest
from _helpers import MemorySink
from _lock_holder import read_snapshot_held, replay_lock_held
from _users import NOBODY, as_root, python_as, shared_directory, walspool_as

import walspool
from walspool.cli import main
from walspool.replay.sinks import RowRejected
from walspool.store import maintenance


def cli(*argv: object) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def raw(path: Path, sql: str) -> list[tuple[object, ...]]:
    conn = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def msg(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


@pytest.fixture
def quarantined(spool_path: Path) -> tuple[Path, MemorySink, list[int]]:
    """A spool whose replay quarantined s-1 and s-3 (state.db refused them) and moved
    the rest; returns the path, the sink and the two rows' ids."""
    sink = MemorySink()
    sink.refuse = lambda sid, rec: RowRejected("refused") if rec.seq in (2, 4) else None
    with walspool.Spool(spool_path) as spool:
        spool.append_many([("s", msg(f"s-{i}")) for i in range(5)])
        report = walspool.Replayer(spool, sink).replay()
        assert (report.moved, report.quarantined) == (3, 2)
        ids = [r.id for r in spool.records()]
    sink.refuse = lambda sid, rec: None
    return spool_path, sink, ids


def test_requeue_puts_quarantined_rows_back_and_records_who(quarantined):
    path, sink, ids = quarantined
    rc, out, err = cli("requeue", path, "--id", ids[0], "--id", ids[1], "--json")
    assert (rc, err) == (0, "")
    result = json.loads(out)
    assert result["requeued"] == ids and f"pid {os.getpid()}" in result["by"]
    with walspool.Spool(path) as spool:
        kept = list(spool.records())
        assert [(r.status, r.attempts, r.last_error) for r in kept] == [(None, 0, None)] * 2
        assert walspool.Replayer(spool, sink).replay().moved == 2
    assert sink.contents("s") == ["s-0", "s-2", "s-4", "s-1", "s-3"]
    audit = raw(path, "SELECT action, record_id, session_id, seq, actor, detail FROM audit")
    assert [a[:4] for a in audit] == [("requeue", ids[0], "s", 2), ("requeue", ids[1], "s", 4)]
    assert audit[0][4] == result["by"]
    detail = json.loads(audit[0][5])
    assert (detail["status"], detail["attempts"], detail["last_error"]) == (
        "quarantined",
        1,
        "RowRejected: refused",
    )


def test_requeue_is_all_or_nothing_and_names_each_bad_id(quarantined):
    path, _, ids = quarantined
    with walspool.Spool(path) as spool:
        replayable = spool.append("s", msg("new")).id
    before = raw(path, "SELECT * FROM records ORDER BY id")
    rc, out, err = cli("requeue", path, "--id", ids[0], "--id", replayable, "--id", 999)
    assert (rc, out) == (1, "")
    assert err.startswith("walspool requeue: ") and err.count("\n") == 1
    assert "nothing was changed" in err
    assert f"{replayable} (replayable, not set aside)" in err and "999 (no such row)" in err
    assert raw(path, "SELECT * FROM records ORDER BY id") == before
    assert raw(path, "SELECT count(*) FROM audit") == [(0,)]


def test_a_row_a_replay_has_out_is_neither_requeued_nor_dropped(quarantined):
    path, _, ids = quarantined
    with walspool.Spool(path) as spool:
        spool.transact(lambda c: c.execute("UPDATE records SET inflight = 7 WHERE id = ?", ids[:1]))
        out = f"{ids[0]} \\(a replay has it out\\)"
        for change in (maintenance.requeue, maintenance.drop):
            with pytest.raises(maintenance.NotSetAside, match=out):
                change(spool, ids)
        assert len(list(spool.records())) == 2


def test_drop_needs_yes_then_keeps_the_row_whole_in_the_audit_table(quarantined):
    path, _, ids = quarantined
    rc, out, err = cli("drop", path, "--id", ids[0])
    assert rc == 3 and "pass --yes" in err
    assert out.startswith(f"drop would take 1 row of {path}:\n")  # listed, not dropped
    assert len(raw(path, "SELECT id FROM records")) == 2
    rc, out, err = cli("drop", path, "--id", ids[0], "--yes")
    assert (rc, err) == (0, "") and f"dropped 1 row of {path}: {ids[0]}" in out
    assert raw(path, "SELECT id FROM records") == [(ids[1],)]
    ((action, detail),) = raw(path, "SELECT action, detail FROM audit")
    kept = json.loads(detail)
    assert action == "drop" and json.loads(kept["payload"]) == msg("s-1")
    assert kept["reason"] == walspool.CAP_DROP and kept["status"] == "quarantined"
    with walspool.Spool(path) as spool:
        spool.transact(lambda c: c.execute("DELETE FROM records"))  # s-3 too, by hand
        assert spool.append("s", msg("later")).seq == 6  # 2 and 4 stay used


def test_requeue_and_drop_wait_for_a_running_replay_as_replay_does(quarantined):
    """By default not at all (exit 4 at once, "not waiting"); with --wait a line says
    whom they wait for, then that it still holds the lock: replay's words and exit."""
    path, _, ids = quarantined
    with replay_lock_held(path) as holder:
        pid, lock = holder.proc.pid, f"{path}.replay-lock"
        rc, out, err = cli("drop", path, "--id", ids[0], "--yes", "--wait", "0.2")
        assert (rc, out) == (4, "")
        assert err.splitlines() == [
            f"walspool drop: waiting for another replay of {path} (process {pid} holds "
            f"{lock}), at most 0.2 s",
            f"walspool drop: nothing was changed: another replay of {path} (process {pid}) "
            f"still holds {lock} after 0.2 s; run again when it ends",
        ]
        for command, *sure in (["requeue"], ["drop", "--yes"]):
            rc, out, err = cli(command, path, "--id", ids[0], *sure)
            assert (rc, out) == (4, "")
            assert err == (
                f"walspool {command}: nothing was changed: another replay of {path} is "
                f"running (process {pid} holds {lock}); not waiting; run again when it "
                "ends, or give --wait SECONDS\n"
            )
        for bad in ("-1", "inf", "soon"):
            with pytest.raises(SystemExit) as usage:
                cli("requeue", path, "--id", ids[0], "--wait", bad)
            assert usage.value.code == 2
        # --json: the error object on stdout, as for every other error.
        rc, out, err = cli("requeue", path, "--id", ids[0], "--wait", "0", "--json")
        assert rc == 4 and "nothing was changed" in err
        assert json.loads(out) == {
            "command": "requeue",
            "error": err[len("walspool requeue: ") : -1],
            "exit": 4,
        }
    assert len(raw(path, "SELECT id FROM records")) == 2
    assert raw(path, "SELECT count(*) FROM audit") == [(0,)]
    assert cli("requeue", path, "--id", ids[0], "--wait", "0")[0] == 0


def test_row_ids_must_be_given_and_be_numbers(spool_path):
    with walspool.Spool(spool_path) as spool:
        spool.append("s", msg("x"))
        with pytest.raises(walspool.InvalidArgument, match="at least one row id"):
            maintenance.requeue(spool, [])
        with pytest.raises(walspool.InvalidArgument, match="positive integer"):
            maintenance.drop(spool, [0])
    with pytest.raises(SystemExit) as exc:
        cli("requeue", spool_path, "--id", "seven")
    assert exc.value.code == 2


def big_spool(path: Path, rows: int) -> None:
    with walspool.Spool(path, durability="normal") as spool:
        for start in range(0, rows, 1000):
            spool.append_many([(f"s{(start + i) % 7}", msg("x" * 400)) for i in range(1000)])


def test_vacuum_gives_a_drained_spools_space_back_and_loses_nothing(spool_path):
    big_spool(spool_path, 20_000)
    with walspool.Spool(spool_path) as spool:
        spool.transact(lambda c: c.execute("DELETE FROM records WHERE id > 70"))
        kept = [(r.id, r.session_id, r.seq, r.message) for r in spool.records()]
    before = spool_path.stat().st_size
    rc, out, err = cli("vacuum", spool_path, "--json")
    assert (rc, err) == (0, "")
    report = json.loads(out)
    assert report["db_bytes_before"] == before and report["checkpointed"] is True
    assert report["db_bytes"] < before / 20 and report["wal_bytes"] == 0
    assert spool_path.stat().st_size == report["db_bytes"]
    with walspool.Spool(spool_path) as spool:
        assert [(r.id, r.session_id, r.seq, r.message) for r in spool.records()] == kept
        assert spool.append("s0", msg("next")).seq == 20_000 // 7 + 2  # never reused
    assert raw(spool_path, "PRAGMA integrity_check") == [("ok",)]


def test_vacuum_refuses_a_full_spool_unless_forced(spool_path, monkeypatch):
    big_spool(spool_path, 3000)
    monkeypatch.setattr(maintenance, "VACUUM_MAX_LIVE_BYTES", 256 * 1024)
    rc, out, err = cli("vacuum", spool_path)
    assert (rc, out) == (1, "") and "replay it first, or stop the gateway and force it" in err
    rc, out, err = cli("vacuum", spool_path, "--force")
    assert (rc, err) == (0, "")
    assert raw(spool_path, "SELECT count(*) FROM records") == [(3000,)]


def test_vacuum_while_a_reader_holds_a_snapshot_finishes_later(spool_path):
    big_spool(spool_path, 5000)
    with walspool.Spool(spool_path) as spool:
        spool.transact(lambda c: c.execute("DELETE FROM records WHERE id > 10"))
    with read_snapshot_held(spool_path):
        rc, out, err = cli("vacuum", spool_path)
        assert (rc, err) == (0, "")
        assert "shrinks at a later checkpoint" in out
    assert raw(spool_path, "SELECT count(*) FROM records") == [(10,)]
    assert cli("vacuum", spool_path)[0] == 0
    assert spool_path.stat().st_size < 64 * 1024


@as_root
def test_root_maintenance_leaves_the_gateway_users_files_its_own():
    with shared_directory("walspool-maint-", 0o755) as top:
        home = top / "hermes"
        home.mkdir(mode=0o700)
        os.chown(home, NOBODY, NOBODY)
        path = home / "spool.db"
        code = (
            "import sys, walspool\n"
            "with walspool.Spool(sys.argv[1]) as s:\n"
            "    s.append_many([('s', {'n': i}) for i in range(3000)])\n"
            "    s.transact(lambda c: c.execute(\"UPDATE records SET status = 'quarantined'"
            ' WHERE id < 3"))\n'
            "    s.transact(lambda c: c.execute('DELETE FROM records WHERE id > 10'))\n"
        )
        made = python_as(NOBODY, code, str(path))
        assert made.returncode == 0, made.stderr
        assert cli("requeue", path, "--id", 1)[0] == 0  # as root
        assert cli("drop", path, "--id", 2, "--yes")[0] == 0
        assert cli("vacuum", path)[0] == 0
        for name in home.iterdir():
            assert name.stat().st_uid == NOBODY, name
        done = walspool_as(NOBODY, "requeue", path, "--id", 1)  # the gateway's user, after root
        assert done.returncode == 1 and "replayable, not set aside" in done.stderr


def drained_spool(path: Path) -> bytes:
    """A closed spool with free pages (a vacuum would shrink it); its bytes."""
    big_spool(path, 3000)
    with walspool.Spool(path) as spool:
        spool.transact(lambda c: c.execute("DELETE FROM records WHERE id > 10"))
    return path.read_bytes()


def move(directory: Path, name: str, to: str) -> None:
    """Rename a spool's database, -wal and -shm (those there) as one."""
    for suffix in ("", "-wal", "-shm"):
        if (directory / f"{name}{suffix}").exists():
            os.rename(directory / f"{name}{suffix}", directory / f"{to}{suffix}")


@pytest.mark.parametrize("swap", ["another spool", "a link", "a linked directory"])
def test_vacuum_runs_on_the_file_the_spool_holds_or_not_at_all(tmp_path, swap):
    """Between the spool's open and its vacuum, its name comes to mean another spool
    (renamed over it, linked in its place, or its directory replaced by a link to
    that spool's): the vacuum refuses and the other spool is left byte for byte as it
    was. Before, the vacuum opened the path again and rewrote what it found there,
    unless it was a link itself (SQLite's NOFOLLOW)."""
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    other = elsewhere / "spool.db"
    other_bytes = drained_spool(other)
    with walspool.Spool(home / "spool.db") as spool:
        spool.append("s", msg("mine"))
        if swap == "another spool":
            move(home, "spool.db", "moved.db")
            other = other.rename(home / "spool.db")
        elif swap == "a link":
            move(home, "spool.db", "moved.db")
            (home / "spool.db").symlink_to(other)
        else:
            home.rename(tmp_path / "moved")
            home.symlink_to(elsewhere)
        with pytest.raises((walspool.UntrustedSpool, walspool.SymlinkRefused)) as refused:
            maintenance.vacuum(spool)
        assert other.read_bytes() == other_bytes
        assert not Path(f"{other}-wal").exists()
    if swap == "a link":
        assert "is a symbolic link" in str(refused.value)
    else:
        assert "changed while walspool was opening it" in str(refused.value)


@as_root
def test_root_vacuums_the_spool_it_holds_while_its_owner_swaps_its_name():
    """The gateway's user exchanges ``spool.db`` with another spool of its own (one with
    free pages), over and over (a real second process, ``renameat2``), while root
    vacuums the spool it holds open: each vacuum runs on that spool or is refused, and
    the other spool is never rewritten."""
    from test_directories import OWNER, TRIES, gateway_spool, owned_dir, swapping

    with shared_directory("walspool-vacuum-", 0o711) as top:
        home = owned_dir(top / "hermes", OWNER)
        spool_path = gateway_spool(home)
        code = (
            "import sys, walspool\n"
            "with walspool.Spool(sys.argv[1]) as s:\n"
            "    s.append_many([('o', {'n': i}) for i in range(3000)])\n"
            "    s.transact(lambda c: c.execute('DELETE FROM records WHERE id > 10'))\n"
        )
        made = python_as(OWNER, code, str(home / "other.db"))
        assert made.returncode == 0, made.stderr
        other, before = os.stat(home / "other.db").st_ino, (home / "other.db").read_bytes()
        refused = 0
        with walspool.Spool(spool_path) as spool:
            with swapping(home, "spool.db", "other.db", "def setup(): pass"):
                for _ in range(TRIES):
                    try:
                        maintenance.vacuum(spool)
                    except walspool.UntrustedSpool:
                        refused += 1
            (now,) = [p for p in home.glob("*.db") if p.stat().st_ino == other]
            assert now.read_bytes() == before
            # Through the spool's own connection: its reader, opened later by the path,
            # may be the other spool's now.
            rows = spool.transact(lambda c: c.execute("SELECT payload FROM records").fetchall())
            assert rows == [('{"role":"user","content":"x"}',)]
        assert refused < TRIES  # the race ran against vacuums that also succeed
