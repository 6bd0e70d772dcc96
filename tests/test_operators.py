"""The command line as an operator meets it in an incident (issue: operators)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import apsw
import pytest
from _helpers import run_python
from _users import NOBODY, as_root, shared_directory, walspool_as

import walspool
from walspool.cli import main


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory other users can reach (pytest's own tmp_path is root's, 0700)."""
    with shared_directory("walspool-ops-", 0o755) as top:
        yield top


def spool_of(uid: int, directory: Path, rows: int = 3) -> Path:
    """A spool of ``rows`` messages for session s1 in ``directory``, owned by ``uid``."""
    directory.mkdir(mode=0o700)
    with walspool.Spool(directory / "spool.db") as spool:
        spool.append_many([("s1", {"role": "user", "content": f"m{i}"}) for i in range(rows)])
    for path in (directory, *directory.iterdir()):
        os.chown(path, uid, uid)
    return directory / "spool.db"


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


#: Opens state.db, reads, and dies without closing it: its -wal and -shm stay.
KILLED_READER = """
import os, sqlite3, sys
sqlite3.connect(sys.argv[1]).execute("SELECT count(*) FROM sessions").fetchall()
os._exit(0)
"""


def spool_with_a_bad_payload(path: Path, rows: int = 3200, bad_at: int = 802) -> None:
    with walspool.Spool(path) as spool:
        spool.append_many([("s", {"role": "user", "content": f"m{i}"}) for i in range(rows)])
    conn = apsw.Connection(str(path))
    conn.execute(
        "UPDATE records SET payload = 'not json {', size = 10 WHERE seq = ?", (bad_at + 1,)
    )
    conn.close()


def test_one_payload_that_is_not_json_does_not_stop_export_or_show(tmp_path, capsys):
    """Every row comes out, the bad one flagged with its raw text; exit 1 naming it."""
    path = tmp_path / "spool.db"
    spool_with_a_bad_payload(path)
    assert main(["export", str(path)]) == 1
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == 3200
    assert lines[802]["message"] is None
    assert lines[802]["bad_payload"]["raw"] == "not json {"
    assert [r["message"]["content"] for r in lines[803:805]] == ["m803", "m804"]
    assert err.startswith("walspool export: 1 row with a payload that is not valid JSON")
    assert "(session s, seq 803)" in err
    assert main(["show", str(path), "s"]) == 1
    out, err = capsys.readouterr()
    assert "[NOT JSON] not json {" in out and "user: m3199" in out
    assert "(session s, seq 803)" in err
    assert main(["show", str(path), "s", "--full"]) == 1
    assert "not json {" in capsys.readouterr().out


def test_python_m_walspool_and_python_m_walspool_cli_run_the_command(tmp_path):
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append("s", {"role": "user", "content": "x"})
    for module in ("walspool", "walspool.cli"):
        done = run_python(f"import runpy; runpy.run_module({module!r}, run_name='__main__')",
                          "stats", str(path), "--json")  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["rows"] == 1


@as_root
def test_a_state_db_the_user_cannot_write_is_refused_before_the_spool_is_touched(shared_tmp):
    """Defect 5: root's state.db (with its -wal and -shm, as a running or killed gateway
    leaves them) replayed into by another user: one line, rc 1, the spool unchanged."""
    hermes_state = pytest.importorskip("hermes_state")
    state = shared_tmp / "state.db"
    db = hermes_state.SessionDB(db_path=state)
    db.create_session("s1", "telegram")
    db.close()
    assert run_python(KILLED_READER, str(state)).returncode == 0
    assert Path(f"{state}-wal").exists() and Path(f"{state}-shm").exists()
    path = spool_of(NOBODY, shared_tmp / "home")
    before = digest(path)
    done = walspool_as(NOBODY, "replay", path, "--into", state)
    assert (done.returncode, done.stdout) == (1, ""), done.stderr
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"walspool replay: cannot write state.db at {state}")
    assert digest(path) == before
    assert not Path(f"{path}-wal").exists()


READ_COMMANDS = (
    ["stats"], ["ls"], ["show", "s1", "--full"], ["export"], ["check"],
    ["watch", "--interval", "0.1"],
)  # fmt: skip


def test_read_commands_create_no_file_beside_a_closed_spool(tmp_path, capsys):
    """Defect 6: a cleanly closed spool has no -wal; reading it creates none, nor -shm."""
    path = tmp_path / "home" / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append_many([("s1", {"role": "user", "content": f"m{i}"}) for i in range(3)])
    before = sorted(os.listdir(path.parent)), digest(path)
    for argv in READ_COMMANDS:
        assert main([argv[0], str(path), *argv[1:], "--json"]) == 0, argv
        assert (sorted(os.listdir(path.parent)), digest(path)) == before, argv
    out = capsys.readouterr().out
    assert '"rows":3' in out and out.count('"content":"m2"') == 2


@as_root
def test_read_commands_work_in_a_directory_the_user_cannot_write(shared_tmp):
    """Defect 6: root's spool, readable by others, in root's read-only directory."""
    home = shared_tmp / "home"
    path = spool_of(0, home)
    os.chmod(home, 0o755)
    os.chmod(path, 0o644)
    for argv in READ_COMMANDS:
        done = walspool_as(NOBODY, argv[0], path, *argv[1:], "--json")
        assert (done.returncode, done.stderr) == (0, ""), argv
    assert json.loads(walspool_as(NOBODY, "stats", path, "--json").stdout)["rows"] == 3
    assert sorted(os.listdir(home)) == ["spool.db", "spool.db.open-lock"]


#: Opens the spool, appends one row and closes it, as a gateway starting would.
APPEND_ONE = """
import sys, walspool
with walspool.Spool(sys.argv[1]) as spool:
    spool.append("s1", {"role": "user", "content": "late"})
"""


def test_a_writer_during_an_immutable_read_is_seen_and_its_wal_kept(tmp_path):
    """The read of a spool without a -wal holds SQLite's shared lock itself: a writer
    that comes and goes meanwhile cannot checkpoint its -wal away, and the next read
    notices the -wal and reads again through it."""
    from walspool.store.reader import SpoolReader

    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append_many([("s1", {"n": i}) for i in range(3)])
    count = lambda conn: conn.execute("SELECT count(*) FROM records").get  # noqa: E731
    reader = SpoolReader(path)
    try:
        assert reader.immutable and reader.read(count) == 3
        done = run_python(APPEND_ONE, str(path))
        assert (done.returncode, done.stderr) == (0, "")
        assert Path(f"{path}-wal").exists()  # the writer could not finish its checkpoint
        assert reader.read(count) == 4
        assert not reader.immutable
    finally:
        reader.close()


def test_an_unknown_reason_is_refused_with_the_known_ones(tmp_path, capsys):
    """Defect 7: a --reason that can match nothing is a usage error naming the known
    reasons; one of walspool's or one found in the spool is fine even with no row."""
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append("s1", {"role": "user", "content": "x"})
        spool.append("s1", {"role": "user", "content": "y"}, reason="custom-reason")
    state = tmp_path / "state.db"
    pytest.importorskip("hermes_state").SessionDB(db_path=state).close()
    for argv in (["export", path], ["replay", path, "--into", state, "--dry-run"]):
        assert main([str(a) for a in argv] + ["--reason", "shutdwon"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1
        assert err.startswith(f"walspool {argv[0]}: unknown reason 'shutdwon'; known reasons: ")
        assert "transcript_cap_drop, shutdown, shutdown-with-unpersisted-agent-history" in err
        assert "custom-reason" in err
    assert main(["export", str(path), "--reason", "custom-reason"]) == 0
    assert main(["export", str(path), "--reason", "shutdown"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1


def test_replay_of_a_session_with_no_rows_fails_as_show_does(tmp_path, capsys):
    """Defect 7: `replay --session nosuch` and `show nosuch` both exit 1, same words."""
    hermes_state = pytest.importorskip("hermes_state")
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append("s1", {"role": "user", "content": "x"})
    state = tmp_path / "state.db"
    hermes_state.SessionDB(db_path=state).close()
    before = digest(path)
    for argv in (["show", path, "nosuch"], ["replay", path, "--into", state, "--session",
                                             "nosuch"]):  # fmt: skip
        assert main([str(a) for a in argv]) == 1
        out, err = capsys.readouterr()
        assert out == "" and err == f"walspool {argv[0]}: no rows for session 'nosuch' in {path}\n"
    assert digest(path) == before


def test_check_names_bad_rows_and_notices_a_wrong_size(tmp_path, capsys):
    """Defect 11: each bad payload and each wrong size named by id, session and seq."""
    path = tmp_path / "spool.db"
    spool_with_a_bad_payload(path, rows=40, bad_at=7)
    conn = apsw.Connection(str(path))
    conn.execute("UPDATE records SET size = size + 1 WHERE seq = 30")
    conn.close()
    assert main(["check", str(path), "--json"]) == 1
    out, err = capsys.readouterr()
    problems = json.loads(out)["problems"]
    assert problems == [
        "1 rows whose payload is not valid JSON: id 8 (session s, seq 8)",
        "1 rows whose size is not their payload's length in bytes: id 30 (session s, seq 30)",
    ]
    assert err.count("\n") == 1 and "id 8 (session s, seq 8)" in err


def test_check_json_prints_json_whatever_is_wrong(tmp_path, capsys):
    """Defect 11: --json is an object even for no file, not a spool, a damaged spool;
    and the damaged spool's problem does not advise running check."""
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    damaged = tmp_path / "damaged.db"
    with walspool.Spool(damaged) as spool:
        spool.append("s", {"role": "user", "content": "x"})
    with open(damaged, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 3000)
    for path in (tmp_path / "missing.db", text, damaged):
        assert main(["check", str(path), "--json"]) == 1
        out, err = capsys.readouterr()
        result = json.loads(out)
        assert result["ok"] is False and result["spool"] == str(path), path
        assert len(result["problems"]) == 1 and err.count("\n") == 1
        assert "run `walspool check" not in out + err


def test_import_json_into_a_damaged_spool_fails_as_every_command_does(tmp_path, capsys):
    """Defect 13: the damaged spool stays where it is; rc 1 and one prefixed line."""
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append_many([("s", {"role": "user", "content": "m" * 500}) for _ in range(200)])
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 8000)
    pending = tmp_path / "pending"
    pending.mkdir()
    (pending / "pending-1.json").write_text(json.dumps({"session_key": "k", "data": {}}))
    before = sorted(os.listdir(tmp_path)), digest(path)
    assert main(["import-json", str(path), str(pending)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"walspool import-json: spool {path} is damaged")
    assert (sorted(os.listdir(tmp_path)), digest(path)) == before
    assert (pending / "pending-1.json").exists()


def test_log_lines_reach_stderr_prefixed(tmp_path, capsys):
    """A library error during a command is one `walspool COMMAND:` line, escaped;
    warnings (which the command's own report covers) and below are not shown."""
    import logging

    class Logs:
        def run(self, args):
            logging.getLogger("walspool.test").error("odd name %s", "a\nb")
            logging.getLogger("hermes_state").warning("not shown")
            return 0

    from walspool.cli import _output

    with _output.log_lines("stats"):
        Logs().run(None)
    assert capsys.readouterr().err == "walspool stats: odd name a\\nb\n"


def test_ls_stats_and_show_print_one_time_for_one_row(tmp_path, capsys):
    """Defect 9: one rule for times (truncated to the millisecond) in every command;
    SQLite's strftime in the backlog view would round .9996 up to the next second."""
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append("s1", {"role": "user", "content": "x"})
    conn = apsw.Connection(str(path))
    conn.execute("UPDATE records SET created_at = 1700000000.9996")
    conn.close()
    shown = "2023-11-14T22:13:20.999Z"
    for argv in (["stats"], ["show", "s1"]):  # ls prints ages; its --json the times
        assert main([argv[0], str(path), *argv[1:]]) == 0
        assert shown in capsys.readouterr().out, argv
    assert main(["ls", str(path), "--json"]) == 0
    (stream,) = json.loads(capsys.readouterr().out)
    assert stream["oldest"] == stream["newest"] == shown


def test_a_session_id_equal_to_a_session_key_stays_a_stream_of_its_own(tmp_path, capsys):
    """Defect 10: `show NAME` shows the session id's stream only (and says the other
    exists), --key the key's; the dry run's report keeps both streams, apart."""
    hermes_state = pytest.importorskip("hermes_state")
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append_many([("same", {"role": "user", "content": f"id {i}"}) for i in range(2)])
        spool.append(None, "slot", reason=walspool.SHUTDOWN, session_key="same")
    assert main(["show", str(path), "same", "--json", "--full"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["session_id"], r["message"]["content"]) for r in rows] == [
        ("same", "id 0"), ("same", "id 1"),
    ]  # fmt: skip
    assert main(["show", str(path), "same"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("session same: 2 rows") and "show it with --key" in out
    assert main(["show", str(path), "same", "--key", "--json", "--full"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["session_id"], row["session_key"], row["message"]) == (None, "same", "slot")

    state = tmp_path / "state.db"
    db = hermes_state.SessionDB(db_path=state)
    db.create_session("same", "telegram")
    db.close()
    argv = ["replay", str(path), "--into", str(state), "--dry-run", "--reason", "shutdown",
            "--reason", "transcript_cap_drop"]  # fmt: skip
    assert main([*argv, "--json"]) == 3
    report = json.loads(capsys.readouterr().out)
    assert (report["moved"], report["held"]) == (2, 1)
    assert report["sessions"] == {"same": stream("same", None, moved=2)}
    assert report["keys"] == {"same": stream(None, "same", held=1, error=DRY_UNRESOLVED)}
    assert (report["errors"], report["key_errors"]) == ({}, {"same": DRY_UNRESOLVED})
    assert main(argv) == 3
    out, err = capsys.readouterr()
    assert "key:same  1" in out and "1 row would be held in 1 session" in err
    # The replay itself (the library's report) keeps them apart the same way.
    assert main([*(a for a in argv if a != "--dry-run"), "--json"]) == 3
    report = json.loads(capsys.readouterr().out)
    assert (report["moved"], report["held"], report["dry_run"]) == (2, 1, False)
    assert report["sessions"] == {"same": stream("same", None, moved=2)}
    assert report["keys"] == {"same": stream(None, "same", held=1, error=UNRESOLVED)}


#: The gateway routes no session to the key "same" (state.db's gateway_routing and
#: sessions/sessions.json know none): the dry run and the replay say the same.
DRY_UNRESOLVED = UNRESOLVED = "resolver found no session for session_key 'same'"


def stream(session_id, session_key, moved=0, held=0, error=None):
    return {
        "session_id": session_id, "session_key": session_key, "moved": moved, "held": held,
        "error": error, "quarantined": 0,
    }  # fmt: skip


def test_version_default_spool_and_top_level_help(tmp_path, capsys, monkeypatch):
    """--version; SPOOL defaults to $HERMES_HOME/spool.db; the help lists every
    command and the known reasons."""
    from walspool.cli import COMMANDS

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("walspool ")
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = capsys.readouterr().out
    for name, *_ in COMMANDS:
        assert f"    {name}" in help_text
    for reason in (walspool.CAP_DROP, walspool.SHUTDOWN, walspool.AGENT_HISTORY):
        assert f"  {reason} " in help_text
    assert "$HERMES_HOME/spool.db" in help_text

    monkeypatch.setenv("HERMES_HOME", str(tmp_path / "hermes"))
    with walspool.Spool(tmp_path / "hermes" / "spool.db") as spool:
        spool.append("s1", {"role": "user", "content": "x"})
    assert main(["stats", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 1
    assert main(["show", "s1", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 1


def test_show_and_export_limit_tail_since_failing(tmp_path, capsys):
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append_many([("s1", {"role": "user", "content": f"m{i}"}) for i in range(10)])
    conn = apsw.Connection(str(path))
    conn.execute("UPDATE records SET created_at = 1700000000 + seq")
    conn.execute("UPDATE records SET last_error = 'boom', attempts = 1 WHERE seq IN (3, 8)")
    conn.close()

    def seqs(*argv: str) -> list[int]:
        assert main(["export", str(path), *argv]) == 0
        return [json.loads(line)["seq"] for line in capsys.readouterr().out.splitlines()]

    assert seqs("--limit", "3") == [1, 2, 3]
    assert seqs("--tail", "2") == [9, 10]
    assert seqs("--failing") == [3, 8]
    assert seqs("--since", "2023-11-14T22:13:28Z") == [8, 9, 10]
    assert seqs("--since", "1700000009") == [9, 10]
    assert seqs("--since", "1700000002", "--failing", "--tail", "1") == [8]
    assert main(["show", str(path), "s1", "--json", "--tail", "1"]) == 0
    assert [r["seq"] for r in json.loads(capsys.readouterr().out)] == [10]
    assert main(["show", str(path), "s1", "--since", "1800000000"]) == 1
    assert "no rows of session 's1' match the filters" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(path), "--since", "yesterday"])
    assert exit_.value.code == 2
