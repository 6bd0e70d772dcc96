"""The ``walspool`` command line, through ``main(argv)``: output, errors, exit codes.

The spool is only ever opened with apsw in this process; the stdlib ``sqlite3``
module touches the spool only in the ``sqlite3`` shell (a separate process), and
state.db locks are held by a child process.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import apsw
import pytest
from _helpers import ROOT, child_deadline, doc_section

import walspool
from walspool import AGENT_HISTORY, CAP_DROP, SHUTDOWN
from walspool.cli import COMMANDS, EXAMPLES, TOP_EXAMPLES, _statedb, build_parser, main
from walspool.cli.ls import BACKLOG_KEYS
from walspool.replay.replayer import Replayer
from walspool.store.schema import SCHEMA_VERSION

KEY = "agent:main:telegram:dm:42"

STATS_KEYS = {
    "spool", "rows", "sessions", "bytes", "oldest", "newest", "by_reason", "bytes_by_reason",
    "failing", "failing_sessions", "inflight", "db_bytes", "wal_bytes", "quarantined",
    "superseded", "quarantined_bytes", "superseded_bytes", "oldest_age",
    "newest_age", "open_by", "last_errors", "drained_total", "quarantined_total",
    "memory_lost_total", "memory",
}  # fmt: skip
LS_KEYS = {
    "session_id", "session_key", "rows", "bytes", "oldest", "newest", "max_attempts",
    "last_error", "quarantined", "superseded", "inflight", "retrying", "oldest_age",
    "newest_age",
}  # fmt: skip
#: The error object every command prints on stdout with --json.
ERROR_KEYS = {"command", "error", "exit"}
RECORD_KEYS = {
    "id", "session_id", "session_key", "seq", "reason", "created_at", "attempts",
    "last_error", "last_attempt_at", "inflight", "status", "message",
}  # fmt: skip
CHECK_KEYS = {"spool", "ok", "application_id", "schema_version", "rows", "problems", "notes"}
REPLAY_KEYS = {
    "spool", "state_db", "dry_run", "moved", "held", "errors", "recovered", "sessions",
    "quarantined", "keys", "key_errors", "inflight", "inflight_landed", "interrupted",
}  # fmt: skip
IMPORT_KEYS = {"spool", "directory", "imported", "skipped", "by_reason", "quarantined"}
#: ``drop`` without ``--yes``: the error object and what it would take.
DROP_LISTING_KEYS = ERROR_KEYS | {"spool", "would_drop", "rows", "missing"}
DROP_ROW_KEYS = {"id", "session_id", "session_key", "seq", "reason", "status", "inflight",
                 "last_error"}  # fmt: skip
ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


# -- helpers -------------------------------------------------------------------------


def run(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    """``main(argv)``; its exit status, stdout and stderr."""
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def one_error_line(err: str) -> str:
    """stderr holds exactly one line, no traceback; return it."""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def section(title: str) -> str:
    """The text of one ``## title`` section of the docs (README.md, docs/*.md)."""
    return doc_section(title)


class FailingSink:
    """A sink whose every write fails: the replay holds the row with ``last_error``,
    in flight (the sink can tell nothing landed)."""

    def write(self, session_id: str, record: Any, ticket: Any) -> None:
        raise RuntimeError("state.db is locked")

    def landed(self, tickets: Any) -> set[Any]:
        return set()


def build_spool(path: Path) -> Path:
    """A closed spool: session-1 (3 messages and an agent history), session-2 (2
    messages, the first with a failed replay attempt) and a row spooled by key only."""
    with walspool.Spool(path) as spool:
        spool.append("session-1", {"role": "user", "content": "hello"})
        spool.append("session-2", {"role": "user", "content": "other one"})
        spool.append("session-1", {"role": "assistant", "content": "hi, how can I help?"})
        spool.append("session-2", {"role": "assistant", "content": "other two"})
        spool.append("session-1", {"role": "user", "content": "I want a refund\nplease"})
        spool.append(None, "slot text", reason=SHUTDOWN, session_key=KEY)
        spool.append(
            "session-1",
            {"session_id": "session-1", "messages": [{"role": "user", "content": "x"}]},
            reason=AGENT_HISTORY,
        )
        Replayer(spool, FailingSink()).replay(session_id="session-2")
    # One second apart in append order, so "oldest first" has one right answer however
    # fast the appends ran (rows of one millisecond tie, and ties sort by session).
    patch(path, "UPDATE records SET created_at = 1700000000 + id")
    return path


@pytest.fixture
def spool_file(tmp_path: Path) -> Path:
    return build_spool(tmp_path / "spool.db")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def patch(path: Path, *sql: str) -> None:
    """Edit a closed spool with apsw (never the stdlib sqlite3 in this process)."""
    conn = apsw.Connection(str(path))
    try:
        for statement in sql:
            conn.execute(statement)
    finally:
        conn.close()


def damaged_copy(tmp_path: Path) -> Path:
    """A copy of a 4,000-row spool with garbage written into pages of its middle third."""
    source = tmp_path / "big" / "spool.db"
    with walspool.Spool(source, durability="normal") as spool:
        spool.append_many(
            [(f"s{i % 20}", {"role": "user", "content": "m" * 400 + str(i)}) for i in range(4000)]
        )
    copy = tmp_path / "damaged.db"
    shutil.copyfile(source, copy)
    pages = copy.stat().st_size // 4096
    garbage = bytes(range(256)) * 4
    with open(copy, "r+b") as f:
        for page in range(pages // 3, 2 * pages // 3, 5):
            f.seek(page * 4096 + 200)
            f.write(garbage)
    return copy


# -- help and README -------------------------------------------------------------------


def test_every_command_has_help_and_a_readme_entry(capsys: pytest.CaptureFixture[str]) -> None:
    commands = section("Commands")
    assert {name for name, *_ in COMMANDS} == {
        "stats", "ls", "show", "replay", "export", "import-json", "check", "requeue",
        "drop", "vacuum", "watch", "metrics", "demo",
    }  # fmt: skip
    for name, fn, *_ in COMMANDS:
        assert fn.__doc__ and fn.__doc__.strip(), name
        with pytest.raises(SystemExit) as exit_:
            main([name, "--help"])
        assert exit_.value.code == 0
        out = capsys.readouterr().out
        assert f"usage: walspool {name}" in out
        assert fn.__doc__.strip().splitlines()[0] in out
        assert f"`walspool {name}" in commands, f"docs/cli.md's Commands lack walspool {name}"
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    overview = capsys.readouterr().out
    assert all(name in overview for name, *_ in COMMANDS)


def test_every_command_help_ends_with_examples_that_parse(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each --help, ``walspool --help`` too, ends with examples; each is a command line
    walspool accepts as typed (the shell's redirection left to the shell): its command
    and arguments."""
    parser = build_parser()
    for name, *_ in COMMANDS:
        examples = EXAMPLES[name]
        with pytest.raises(SystemExit):
            main([name, "--help"])
        out = capsys.readouterr().out
        assert out.endswith("examples:\n" + "".join(f"  {e}\n" for e in examples)), name
        for example in examples:
            words = shlex.split(example)
            words = words[: words.index(">")] if ">" in words else words
            assert words[0] == "walspool", example
            args = parser.parse_args(words[1:])
            assert args.command == name, example
    assert set(EXAMPLES) == {name for name, *_ in COMMANDS}
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    head = "examples (an outage, as README's incident runbook walks it):\n"
    assert out.endswith(head + "".join(f"  {e}\n" for e in TOP_EXAMPLES))
    for example in TOP_EXAMPLES:
        assert parser.parse_args(shlex.split(example)[1:]).command, example


def test_bad_usage_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    # SPOOL may be left out (it defaults to $HERMES_HOME/spool.db); SESSION may not.
    for argv in ([], ["show"], ["nope"], ["replay", "spool.db", "--into"], ["stats", "--nope"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert "usage:" in capsys.readouterr().err


def test_json_contract_is_documented() -> None:
    contract = section("Commands")
    for keys in (
        STATS_KEYS,
        LS_KEYS,
        RECORD_KEYS,
        CHECK_KEYS,
        REPLAY_KEYS,
        IMPORT_KEYS,
        ERROR_KEYS,
        DROP_LISTING_KEYS,
        DROP_ROW_KEYS,
    ):
        for key in keys:
            assert f'"{key}"' in contract, key


# -- read commands ---------------------------------------------------------------------


def test_stats(capsys: pytest.CaptureFixture[str], spool_file: Path) -> None:
    rc, out, err = run(capsys, "stats", spool_file)
    assert (rc, err) == (0, "")
    assert "7 in 3 sessions" in out
    assert "5 transcript_cap_drop" in out and "1 shutdown\n" in out
    assert "with errors 1 row\n" in out
    assert "WAL" in out

    rc, out, err = run(capsys, "stats", spool_file, "--json")
    assert (rc, err) == (0, "")
    stats = json.loads(out)
    assert set(stats) == STATS_KEYS
    assert stats["open_by"] == []  # closed: no process has it open
    assert stats["rows"] == 7 and stats["sessions"] == 3 and stats["failing"] == 1
    assert stats["by_reason"] == {CAP_DROP: 5, SHUTDOWN: 1, AGENT_HISTORY: 1}
    assert ISO.match(stats["oldest"]) and ISO.match(stats["newest"])
    assert stats["db_bytes"] > 0
    # The failed write keeps its row in flight (its ticket), to be probed first by the
    # next replay: FailingSink can look tickets up, so the failure is not trusted blindly.
    assert stats["inflight"] == 1


def test_ls_reads_what_the_backlog_view_shows(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """ls reads only indexes; the backlog view reads every row: both say the same of
    a spool with every kind of stream and row (several reasons in one session, a
    session id that also carries a key, key-only streams, one named like a session,
    rows with errors, quarantined and superseded rows)."""
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append_many([("s1", {"n": i}) for i in range(5)])
        spool.append("s1", {"n": 5}, reason=SHUTDOWN, session_key="k1")
        spool.append("s2", "x" * 300, reason=AGENT_HISTORY)
        spool.append_many([(None, "slot", "same"), (None, "slot2", "k3"), ("same", "id")])
        spool.append_many([("s3", {"n": i}) for i in range(4)], reason=SHUTDOWN)
    patch(
        path,
        "UPDATE records SET attempts = 3, last_error = 'locked' WHERE session_id = 's1' "
        "AND seq IN (2, 4)",
        "UPDATE records SET attempts = 1, last_error = 'first' WHERE session_id = 's1' AND seq = 3",
        "UPDATE records SET status = 'quarantined', attempts = 2, last_error = 'bad' "
        "WHERE session_key = 'same'",
        "UPDATE records SET status = 'superseded' WHERE session_id = 's3' AND seq < 3",
    )
    conn = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        view = [
            dict(zip(BACKLOG_KEYS, row, strict=True))
            for row in conn.execute(f"SELECT {', '.join(BACKLOG_KEYS)} FROM backlog")
        ]
    finally:
        conn.close()
    rc, out, _ = run(capsys, "ls", path, "--json")
    listed = json.loads(out)
    assert rc == 0 and len(listed) == 6

    def by_stream(rows: list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
        return {(r["session_id"], r["session_key"]): r for r in rows}

    def ms(text: str) -> float:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()

    shown, seen = by_stream(listed), by_stream(view)
    assert shown.keys() == seen.keys()
    for stream, row in shown.items():
        times = ("oldest", "newest")
        assert {k: v for k, v in row.items() if k in BACKLOG_KEYS and k not in times} == {
            k: v for k, v in seen[stream].items() if k not in times
        }, stream
        # The view's strftime rounds to the millisecond where walspool truncates.
        assert all(0 <= ms(seen[stream][t]) - ms(row[t]) <= 0.0011 for t in times), stream
    assert by_stream(listed)["s1", None]["last_error"] == "locked"  # the first by seq
    assert by_stream(listed)["s1", None]["max_attempts"] == 3


def test_ls(capsys: pytest.CaptureFixture[str], spool_file: Path) -> None:
    rc, out, err = run(capsys, "ls", spool_file)
    assert (rc, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["SESSION", "ROWS", "RETRYING"]
    assert [line.split()[0] for line in lines[1:]] == ["session-1", "session-2", f"key:{KEY}"]
    assert "state.db is locked" in lines[2]
    # session-2's first row failed and waits to be tried again, in flight (its ticket).
    assert lines[2].split()[1:8] == ["2", "1", "0", "0", "1", "79", "B"]

    rc, out, err = run(capsys, "ls", spool_file, "--json")
    assert (rc, err) == (0, "")
    backlog = json.loads(out)
    assert all(set(b) == LS_KEYS for b in backlog)
    by_name = {b["session_id"] or b["session_key"]: b for b in backlog}
    assert by_name["session-1"]["rows"] == 4
    assert by_name["session-2"]["max_attempts"] == 1
    assert by_name["session-2"]["last_error"] == "RuntimeError: state.db is locked"
    assert by_name[KEY]["session_id"] is None and by_name[KEY]["session_key"] == KEY


def test_ls_empty_spool(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    walspool.Spool(tmp_path / "empty.db").close()
    assert run(capsys, "ls", tmp_path / "empty.db") == (0, f"no rows in {tmp_path}/empty.db\n", "")
    assert run(capsys, "ls", tmp_path / "empty.db", "--json") == (0, "[]\n", "")


def test_show(capsys: pytest.CaptureFixture[str], spool_file: Path) -> None:
    rc, out, err = run(capsys, "show", spool_file, "session-1")
    assert (rc, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"session session-1: 4 rows in {spool_file}"
    assert [line.split()[0] for line in lines[2:]] == ["1", "2", "3", "4"]
    assert "user: I want a refund please" in lines[4]

    rc, out, err = run(capsys, "show", spool_file, "session-2")
    assert "RuntimeError: state.db is locked" in out.splitlines()[2]

    rc, out, err = run(capsys, "show", spool_file, "session-1", "--full")
    assert (rc, err) == (0, "")
    assert '"content": "I want a refund\\nplease"' in out
    assert out.count("seq ") == 4

    rc, out, err = run(capsys, "show", spool_file, "session-1", "--json")
    rows = json.loads(out)
    assert [r["seq"] for r in rows] == [1, 2, 3, 4]
    assert all(set(r) == RECORD_KEYS - {"message"} for r in rows)
    rc, out, err = run(capsys, "show", spool_file, KEY, "--json", "--full")
    (row,) = json.loads(out)
    assert set(row) == RECORD_KEYS and row["message"] == "slot text"

    rc, out, err = run(capsys, "show", spool_file, "nobody")
    assert (rc, out) == (1, "")
    assert "no rows for session 'nobody'" in one_error_line(err)


def test_export(capsys: pytest.CaptureFixture[str], spool_file: Path) -> None:
    rc, out, err = run(capsys, "export", spool_file)
    assert (rc, err) == (0, "")
    records = [json.loads(line) for line in out.splitlines()]
    assert all(set(r) == RECORD_KEYS for r in records)
    assert [(r["session_id"] or r["session_key"], r["seq"]) for r in records] == [
        ("session-1", 1), ("session-1", 2), ("session-1", 3), ("session-1", 4),
        ("session-2", 1), ("session-2", 2), (KEY, 1),
    ]  # fmt: skip
    assert records[2]["message"] == {"role": "user", "content": "I want a refund\nplease"}
    assert records[4]["attempts"] == 1 and records[4]["last_attempt_at"] > 0

    rc, out, _ = run(capsys, "export", spool_file, "--session", "session-2")
    assert [json.loads(line)["message"]["content"] for line in out.splitlines()] == [
        "other one", "other two",
    ]  # fmt: skip
    rc, out, _ = run(capsys, "export", spool_file, "--reason", SHUTDOWN, "--reason", AGENT_HISTORY)
    assert sorted(json.loads(line)["reason"] for line in out.splitlines()) == [
        SHUTDOWN, AGENT_HISTORY,
    ]  # fmt: skip
    # A session with no row is a typo: exit 1, as show, replay, requeue and drop say it.
    rc, out, err = run(capsys, "export", spool_file, "--json", "--session", "nobody")
    error = f"no rows for session 'nobody' in {spool_file}"
    assert (rc, err) == (1, f"walspool export: {error}\n")
    assert json.loads(out) == {"command": "export", "error": error, "exit": 1}
    rc, out, _ = run(capsys, "export", spool_file, "--session", f"key:{KEY}")
    assert rc == 0 and [json.loads(line)["session_key"] for line in out.splitlines()] == [KEY]


def test_export_pages_through_many_rows(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "many.db"
    with walspool.Spool(path, durability="normal") as spool:
        spool.append_many([(f"s{i % 3}", {"n": i}) for i in range(1500)])
        spool.append_many([(None, {"n": i}, "key") for i in range(600)], reason=SHUTDOWN)
    rc, out, _ = run(capsys, "export", path)
    records = [json.loads(line) for line in out.splitlines()]
    assert len(records) == 2100 and len({r["id"] for r in records}) == 2100
    for name in ("s0", "s1", "s2", "key"):
        seqs = [r["seq"] for r in records if (r["session_id"] or r["session_key"]) == name]
        assert seqs == list(range(1, len(seqs) + 1))


def test_check_healthy(capsys: pytest.CaptureFixture[str], spool_file: Path) -> None:
    rc, out, err = run(capsys, "check", spool_file)
    assert (rc, err) == (0, "")
    assert out.rstrip().endswith("ok") and "schema version 5" in out
    rc, out, err = run(capsys, "check", spool_file, "--json")
    result = json.loads(out)
    assert set(result) == CHECK_KEYS
    assert result["ok"] is True and result["problems"] == []
    assert result["application_id"] == 0x5753504C
    assert result["schema_version"] == SCHEMA_VERSION == 5
    assert result["rows"] == 7


def test_check_bookkeeping_problems(capsys: pytest.CaptureFixture[str], spool_file: Path) -> None:
    patch(
        spool_file,
        "UPDATE records SET seq = 10 WHERE session_id = 'session-2' AND seq = 1",
        "UPDATE records SET payload = '{\"role\": ' WHERE session_id = 'session-1' AND seq = 1",
        "UPDATE records SET inflight = 7 WHERE session_id = 'session-1' AND seq = 2",
    )
    rc, out, err = run(capsys, "check", spool_file, "--json")
    assert rc == 1
    result = json.loads(out)
    assert result["ok"] is False
    problems = "\n".join(result["problems"])
    assert "1 rows whose seq is not above the seq of the row before them" in problems
    assert "1 rows whose payload is not valid JSON: id 1 (session session-1, seq 1)" in problems
    # The hand edit left the row's size as it was: that is a problem of its own.
    assert "1 rows whose size is not their payload's length in bytes: id 1 (" in problems
    assert len(result["problems"]) == 3
    # A gateway's drains (the link's, walspool.shutdown_flush) leave rows in flight too.
    assert result["notes"] == [
        "2 rows in flight: out with a replay or a gateway's drain now, or left by one that "
        "failed or was stopped; each is checked against state.db before it is written again"
    ]
    assert "has 3 problems" in one_error_line(err)

    rc, out, err = run(capsys, "export", spool_file)
    assert rc == 1 and "not valid JSON" in one_error_line(err)


def test_check_names_a_dropped_next_seq_trigger(
    capsys: pytest.CaptureFixture[str], spool_file: Path
) -> None:
    """Without it a drained stream would reuse seqs: a schema problem, named."""
    patch(spool_file, "DROP TRIGGER records_keep_next_seq_on_delete")
    rc, out, err = run(capsys, "check", spool_file, "--json")
    assert rc == 1
    assert json.loads(out)["problems"] == [
        "the schema lacks the trigger `records_keep_next_seq_on_delete`"
    ]


def test_check_seq_order(capsys: pytest.CaptureFixture[str], spool_file: Path) -> None:
    # Swap two rows' seqs, as a hand edit would: ids and seqs then disagree.
    patch(
        spool_file,
        "UPDATE records SET seq = 100 WHERE session_id = 'session-1' AND seq = 1",
        "UPDATE records SET seq = 1 WHERE session_id = 'session-1' AND seq = 2",
        "UPDATE records SET seq = 2 WHERE session_id = 'session-1' AND seq = 100",
    )
    rc, out, err = run(capsys, "check", spool_file)
    assert rc == 1
    assert "problem: 1 rows whose seq is not above the seq of the row before them" in out


def test_check_damaged_copy(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    copy = damaged_copy(tmp_path)
    rc, out, err = run(capsys, "check", copy)
    assert rc == 1
    assert "problem: integrity_check" in out or "integrity_check failed" in out
    assert f"spool {copy} has" in one_error_line(err)
    rc, out, err = run(capsys, "check", copy, "--json")
    result = json.loads(out)
    assert result["ok"] is False and result["problems"]
    assert rc == 1 and set(result) == CHECK_KEYS


# -- errors ----------------------------------------------------------------------------


def test_spool_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    other = tmp_path / "other.db"
    patch(other, "CREATE TABLE t (x)")
    damaged = damaged_copy(tmp_path)
    cases = {
        missing: f"no spool at {missing} (no such file)",
        text: f"{text} is not a SQLite database, so not a walspool spool",
        other: f"{other} is a SQLite database but not a walspool spool",
        damaged: f"spool {damaged} is damaged",
    }
    for command in ("stats", "ls", "export"):
        for path, message in cases.items():
            rc, out, err = run(capsys, command, path)
            assert (rc, out) == (1, ""), (command, path)
            assert one_error_line(err).startswith(f"walspool {command}: {message}")
    assert not missing.exists()
    rc, _, err = run(capsys, "show", missing, "s")
    assert rc == 1 and "no spool at" in one_error_line(err)


def test_read_commands_never_write(capsys: pytest.CaptureFixture[str], spool_file: Path) -> None:
    before = digest(spool_file)
    for argv in (
        ["stats"], ["ls"], ["show", "session-1", "--full"], ["export"], ["check"],
    ):  # fmt: skip
        assert run(capsys, argv[0], spool_file, *argv[1:], "--json")[0] == 0
    assert digest(spool_file) == before
    wal = Path(f"{spool_file}-wal")
    assert not wal.exists() or wal.stat().st_size == 0


#: Appends and exits without closing the spool: its last rows exist only in the -wal.
KILLED_WRITER = """
import os, sys
import walspool

spool = walspool.Spool(sys.argv[1])
for i in range(30):
    spool.append(f"s{i % 3}", {"role": "user", "content": f"m{i}"})
os._exit(0)
"""


def test_read_commands_never_write_a_spool_with_a_live_wal(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A writer that died leaves committed rows in the -wal: a read command must read
    them and leave both files as they are (a read-write open would checkpoint the -wal
    into the database and delete it when it closes)."""
    path = tmp_path / "spool.db"
    child = subprocess.run(
        [sys.executable, "-c", KILLED_WRITER, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert (child.returncode, child.stderr) == (0, "")
    wal = Path(f"{path}-wal")
    assert wal.stat().st_size > 0
    before = (digest(path), digest(wal))
    for argv in (
        ["stats"], ["ls"], ["show", "s1", "--full"], ["export"], ["check"],
    ):  # fmt: skip
        rc, out, err = run(capsys, argv[0], path, *argv[1:], "--json")
        assert (rc, err) == (0, ""), argv
        if argv[0] == "stats":
            assert json.loads(out)["rows"] == 30  # the rows only the -wal holds were read
        assert (digest(path), digest(wal)) == before, argv


# -- replay ----------------------------------------------------------------------------


@pytest.fixture
def state_db(tmp_path: Path) -> Path:
    hermes_state = pytest.importorskip("hermes_state")
    path = tmp_path / "state.db"
    db = hermes_state.SessionDB(db_path=path)
    db.create_session("s1", "telegram")
    db.close()
    return path


def contents(state_db: Path, session_id: str) -> list[str]:
    import hermes_state

    db = hermes_state.SessionDB(db_path=state_db)
    try:
        return [m["content"] for m in db.get_messages(session_id)]
    finally:
        db.close()


def test_replay_into_session_db(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, state_db: Path
) -> None:
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        for i in range(5):
            spool.append("s1", {"role": "user", "content": f"s1 #{i}"})
            spool.append("s2", {"role": "assistant", "content": f"s2 #{i}"})
        spool.append("s1", {"session_id": "s1", "messages": []}, reason=AGENT_HISTORY)
    exported = run(capsys, "export", path)[1]

    # A dry run writes nothing and says what would happen.
    rc, out, err = run(capsys, "replay", path, "--into", state_db, "--dry-run")
    assert rc == 3
    assert out.splitlines()[0] == f"would move 5 rows from {path} into {state_db}"
    assert "s2" in out and "FOREIGN KEY" in out
    assert "--create-missing" in one_error_line(err)
    rc, out, _ = run(capsys, "replay", path, "--into", state_db, "--dry-run", "--json")
    report = json.loads(out)
    assert set(report) == REPLAY_KEYS and report["dry_run"] is True
    assert (report["moved"], report["held"]) == (5, 5)
    assert set(report["sessions"]["s1"]) == {
        "session_id", "session_key", "moved", "held", "error", "quarantined"
    }  # fmt: skip
    rc, out, _ = run(
        capsys, "replay", path, "--into", state_db, "--dry-run", "--create-missing", "--json"
    )
    assert (rc, json.loads(out)["moved"], json.loads(out)["held"]) == (0, 10, 0)
    assert run(capsys, "export", path)[1] == exported
    assert contents(state_db, "s1") == []

    # The real replay: s1 lands in order, s2 is held with the FOREIGN KEY message.
    rc, out, err = run(capsys, "replay", path, "--into", state_db, "--json")
    assert rc == 3
    report = json.loads(out)
    assert (report["moved"], report["held"], report["dry_run"]) == (5, 5, False)
    assert "FOREIGN KEY" in report["errors"]["s2"]
    assert contents(state_db, "s1") == [f"s1 #{i}" for i in range(5)]
    assert "5 rows held in 1 session; --create-missing" in one_error_line(err)
    backlog = json.loads(run(capsys, "ls", path, "--json")[1])
    assert {(b["session_id"], b["rows"], b["max_attempts"]) for b in backlog} == {
        ("s1", 1, 0), ("s2", 5, 1),
    }  # fmt: skip

    # --create-missing creates s2 and moves its rows, in order.
    rc, out, err = run(capsys, "replay", path, "--into", state_db, "--create-missing")
    assert (rc, err) == (0, "")
    assert out == f"moved 5 rows from {path} into {state_db}\n"
    assert contents(state_db, "s2") == [f"s2 #{i}" for i in range(5)]
    assert json.loads(run(capsys, "stats", path, "--json")[1])["by_reason"] == {AGENT_HISTORY: 1}


def test_replay_one_session_and_reason(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, state_db: Path
) -> None:
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append("s1", {"role": "user", "content": "cap"})
        spool.append("s1", {"role": "user", "content": "down"}, reason=SHUTDOWN)
        spool.append("s2", {"role": "user", "content": "other"})
    argv = ("replay", path, "--into", state_db, "--session", "s1", "--reason", SHUTDOWN)
    rc, out, _ = run(capsys, *argv)
    assert (rc, out) == (0, f"moved 1 row from {path} into {state_db}\n")
    assert contents(state_db, "s1") == ["down"]
    assert json.loads(run(capsys, "stats", path, "--json")[1])["rows"] == 2


def test_replay_errors(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, spool_file: Path, state_db: Path
) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    before = digest(spool_file)
    cases = {
        tmp_path / "nope.db": "no state.db at",
        text: "is not a SQLite database, so not a hermes state.db",
        spool_file: "is a SQLite database but not a hermes state.db",
        tmp_path: "is not a file",
    }
    for into, message in cases.items():
        for dry in ([], ["--dry-run"]):
            rc, out, err = run(capsys, "replay", spool_file, "--into", into, *dry)
            assert (rc, out) == (1, ""), into
            assert message in one_error_line(err)
    assert not (tmp_path / "nope.db").exists()
    assert digest(spool_file) == before

    missing = tmp_path / "missing-spool.db"
    rc, _, err = run(capsys, "replay", missing, "--into", state_db)
    assert rc == 1 and "no spool at" in one_error_line(err)
    assert not missing.exists()


def test_replay_reports_a_locked_state_db(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    spool_file: Path,
    state_db: Path,
) -> None:
    monkeypatch.setattr(_statedb, "STATE_DB_WAIT_SECONDS", 0.2)
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(state_db)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        with child_deadline(holder, what="the state.db lock holder"):
            assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        before = digest(spool_file)
        rc, out, err = run(capsys, "replay", spool_file, "--into", state_db)
        assert (rc, out) == (1, "")
        assert f"state.db at {state_db} is locked by another process" in one_error_line(err)
        assert digest(spool_file) == before
    finally:
        holder.communicate("", timeout=30)
    assert holder.returncode == 0


LOCK_HOLDER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.read()
conn.execute("ROLLBACK")
"""


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (sqlite3.OperationalError("database is locked"), "is locked by another process"),
        (sqlite3.OperationalError("unable to open database file"), "check the permissions"),
        (sqlite3.OperationalError("attempt to write a readonly database"), "check the perm"),
        (sqlite3.DatabaseError("file is not a database"), "is damaged"),
        (sqlite3.DatabaseError("database disk image is malformed"), "is damaged"),
        (sqlite3.OperationalError("disk I/O error"), "OperationalError: disk I/O error"),
    ],
)
def test_state_db_messages(error: sqlite3.Error, expected: str) -> None:
    message = _statedb.state_db_message(error, Path("/h/state.db"))
    assert expected in message and "/h/state.db" in message and "\n" not in message


def test_replay_maps_session_db_errors(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    spool_file: Path,
    state_db: Path,
) -> None:
    import hermes_state

    def locked(*args: Any, **kwargs: Any) -> None:
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(hermes_state, "SessionDB", locked)
    rc, out, err = run(capsys, "replay", spool_file, "--into", state_db)
    assert (rc, out) == (1, "")
    assert "is locked by another process" in one_error_line(err)


# -- import-json, demo -----------------------------------------------------------------


def pending_file(directory: Path, payload: Any) -> None:
    """One file of upstream's JSON spool; a str is written as it is."""
    text = payload if isinstance(payload, str) else json.dumps(payload, indent=2)
    (directory / f"pending-{uuid.uuid4().hex}.json").write_text(text)


def cap_drop_file(directory: Path, session_id: str, message: dict[str, Any], seq: int) -> None:
    """A transcript cap drop as upstream spools it."""
    data = {"session_id": session_id, "message": message}
    pending_file(
        directory,
        {"session_key": session_id, "reason": CAP_DROP, "ts": 1000 + seq, "seq": seq, "data": data},
    )


def test_import_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pending = tmp_path / "pending_messages"
    pending.mkdir()
    for i in range(3):
        cap_drop_file(pending, "s1", {"role": "user", "content": f"m{i}"}, i)
    path = tmp_path / "new" / "spool.db"
    rc, out, err = run(capsys, "import-json", path, pending)
    assert (rc, err) == (0, "")
    assert out.splitlines() == [
        f"imported 3 files from {pending} into {path}", f"  3 {CAP_DROP}",
    ]  # fmt: skip
    assert list(pending.iterdir()) == []
    exported = [json.loads(line) for line in run(capsys, "export", path)[1].splitlines()]
    assert [r["message"]["content"] for r in exported] == ["m0", "m1", "m2"]

    pending_file(pending, "{ not json")
    rc, out, err = run(capsys, "import-json", path, pending, "--json")
    assert rc == 3
    report = json.loads(out)
    assert set(report) == IMPORT_KEYS
    assert report["imported"] == 0 and len(report["skipped"]) == 1
    assert "1 file left in place" in one_error_line(err)

    rc, _, err = run(capsys, "import-json", path, tmp_path / "absent")
    assert rc == 1 and "absent" in one_error_line(err)
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    rc, _, err = run(capsys, "import-json", text, pending)
    assert rc == 1 and "not a SQLite database" in one_error_line(err)


@pytest.mark.parametrize("spool_before", ["missing", "an empty file"])
@pytest.mark.parametrize("directory", ["missing", "a file", "writable by others"])
def test_import_json_from_a_directory_it_cannot_use_leaves_the_spool_path_as_it_was(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, spool_before: str, directory: str
) -> None:
    """A missing or refused DIR exits 1 naming it, before the spool is opened: no spool
    is made, and an empty file at the spool's path stays an empty file."""
    path = tmp_path / "spool.db"
    if spool_before == "an empty file":
        path.write_bytes(b"")
    pending = tmp_path / "pending_messages"
    if directory == "a file":
        pending.write_text("not a directory\n")
    elif directory == "writable by others":
        pending.mkdir()
        pending.chmod(0o777)  # anyone could plant a file in it: refused by the checks
    rc, _, err = run(capsys, "import-json", path, pending)
    assert rc == 1 and "pending_messages" in one_error_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["pending_messages"] * (directory != "missing") + ["spool.db"] * (spool_before != "missing")
    )
    if spool_before == "an empty file":
        assert path.read_bytes() == b""


def test_demo_runs_run_demo(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    import walspool.demo

    def fake(out: Any) -> int:
        out.write("demo ran\n")
        return 0

    monkeypatch.setattr(walspool.demo, "run_demo", fake)
    assert run(capsys, "demo") == (0, "demo ran\n", "")


# -- progress --------------------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_only_on_a_terminal(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    spool_file: Path,
    state_db: Path,
    tmp_path: Path,
) -> None:
    # Not a terminal (captured): no progress at all.
    rc, out, err = run(capsys, "export", spool_file)
    assert rc == 0 and err == ""

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["export", str(spool_file)]) == 0
    assert re.search(r"\rexport: 7/7 \(100%\), [\d,]+ rows/s, took \d+s *\n\Z", terminal.getvalue())
    assert len(capsys.readouterr().out.splitlines()) == 7

    pending = tmp_path / "pending_messages"
    pending.mkdir()
    cap_drop_file(pending, "s1", {"role": "user", "content": "x"}, 0)
    terminal.truncate(0)
    assert main(["import-json", str(tmp_path / "imported.db"), str(pending)]) == 0
    assert re.search(
        r"\rimport: 1/1 \(100%\), [\d,]+ files/s, took \d+s *\n\Z", terminal.getvalue()
    )

    path = tmp_path / "replay.db"
    with walspool.Spool(path) as spool:
        spool.append_many([("s1", {"role": "user", "content": str(i)}) for i in range(3)])
    terminal.seek(0)
    terminal.truncate(0)
    assert main(["replay", str(path), "--into", str(state_db)]) == 0
    assert re.search(r"\rreplay: 3/3 \(100%\), [\d,]+ rows/s, took \d+s *\n\Z", terminal.getvalue())

    # --no-progress: nothing, even on a terminal.
    with walspool.Spool(path) as spool:
        spool.append("s1", {"role": "user", "content": "one more"})
    terminal.seek(0)
    terminal.truncate(0)
    assert main(["replay", str(path), "--into", str(state_db), "--no-progress"]) == 0
    assert terminal.getvalue() == ""


# -- a live writer -----------------------------------------------------------------------

APPENDER = """
import json, pathlib, sys, time
import walspool

path, stop = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
worst, n, last = 0.0, 0, {}
with walspool.Spool(path) as spool:
    while n < 300 or not stop.exists():
        session = f"live-{n % 4}"
        started = time.perf_counter()
        receipt = spool.append(session, {"role": "user", "content": f"m{n}"})
        worst = max(worst, time.perf_counter() - started)
        assert receipt.seq == last.get(session, 0) + 1, (session, receipt.seq)
        last[session] = receipt.seq
        n += 1
        if n == 50:
            print("ready", flush=True)
print(json.dumps({"appended": n, "worst": worst}), flush=True)
"""


def test_read_commands_while_another_process_appends(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "live" / "spool.db"
    stop = tmp_path / "stop"
    child = subprocess.Popen(
        [sys.executable, "-c", APPENDER, str(path), str(stop)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        with child_deadline(child, what="the appender"):
            assert child.stdout is not None and child.stdout.readline() == "ready\n"
        seen = 0
        for _ in range(12):
            rc, out, err = run(capsys, "stats", path, "--json")
            assert (rc, err) == (0, "")
            rows = json.loads(out)["rows"]
            assert rows >= seen
            seen = rows
            rc, out, err = run(capsys, "ls", path, "--json")
            assert (rc, err) == (0, "") and json.loads(out)
            rc, out, err = run(capsys, "export", path)
            assert (rc, err) == (0, "")
            for session in ("live-0", "live-3"):
                seqs = [
                    r["seq"]
                    for r in map(json.loads, out.splitlines())
                    if r["session_id"] == session
                ]
                assert seqs == list(range(1, len(seqs) + 1))
            rc, out, err = run(capsys, "show", path, "live-1", "--json")
            assert (rc, err) == (0, "")
        rc, out, err = run(capsys, "check", path)
        assert (rc, err) == (0, ""), out
    finally:
        stop.touch()
        out, err = child.communicate(timeout=60)
    assert (child.returncode, err) == (0, "")
    summary = json.loads(out.splitlines()[-1])
    assert summary["appended"] > seen  # it kept appending while the reads ran
    assert summary["worst"] < 5.0, summary  # a reader never made it wait out a lock
    assert json.loads(run(capsys, "stats", path, "--json")[1])["rows"] == summary["appended"]


# -- docs/forensics.md: forensics with the sqlite3 shell -----------------------------------


def readme_queries() -> list[str]:
    page = (ROOT / "docs" / "forensics.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```sh\n(.*?)```", page, re.S)
    return [
        line
        for block in blocks
        for line in block.splitlines()
        if line.startswith("sqlite3 -readonly ")
    ]


def test_readme_queries_run_in_the_sqlite3_shell(tmp_path: Path) -> None:
    shell = shutil.which("sqlite3")
    if shell is None:
        pytest.skip("the sqlite3 shell is not installed (scripts/test installs it)")
    queries = readme_queries()
    assert len(queries) >= 9
    assert all(" spool.db " in q for q in queries)
    build_spool(tmp_path / "spool.db")
    patch(tmp_path / "spool.db", "UPDATE records SET inflight = 3 WHERE id = 3")
    (tmp_path / "session.txt").write_text("session-1\n")  # as an editor saves it
    before = digest(tmp_path / "spool.db")
    outputs = {}
    for query in queries:
        done = subprocess.run(
            ["bash", "-c", query], cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        assert (done.returncode, done.stderr) == (0, ""), query
        outputs[query] = done.stdout
        assert done.stdout.strip() or ">" in query, query
    assert digest(tmp_path / "spool.db") == before
    text = "\n".join(outputs.values())
    assert "session-1" in text and "session-2" in text and KEY in text
    assert "RuntimeError: state.db is locked" in text  # the failures view
    assert "I want a refund" in text  # json_extract on payloads
    assert "1465077836\n5\n" in text  # application_id, user_version
    exported = (tmp_path / "session.jsonl").read_text().splitlines()
    assert [json.loads(line).get("content") for line in exported] == [
        "hello", "hi, how can I help?", "I want a refund\nplease", None,
    ]  # fmt: skip


def test_a_session_id_that_is_shell_and_sql_code_is_only_data_in_the_recipes(tmp_path: Path):
    """A chat platform's id holding a quote, ``$(...)`` and a backtick, put in
    session.txt as the page says (walspool ls --json, then the python3 line): the
    per-session recipes find its rows, and nothing in it runs."""
    shell = shutil.which("sqlite3")
    if shell is None:
        pytest.skip("the sqlite3 shell is not installed (scripts/test installs it)")
    hostile = 'it\'s $(touch pwned) `touch pwned2` "x"; DROP TABLE records; --'
    with walspool.Spool(tmp_path / "spool.db") as spool:
        spool.append(hostile, {"role": "user", "content": "from the hostile id"})
    page = (ROOT / "docs" / "forensics.md").read_text(encoding="utf-8")
    (to_file,) = [line for line in page.splitlines() if line.startswith("walspool ls ")]
    argv = to_file.replace("walspool ls ", f"{sys.executable} -m walspool ls ", 1)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["bash", "-c", argv], cwd=tmp_path, env=env, capture_output=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "session.txt").read_text() == hostile
    per_session = [q for q in readme_queries() if "session.txt" in q]
    assert len(per_session) == 2
    for query in per_session:
        done = subprocess.run(["bash", "-c", query], cwd=tmp_path, capture_output=True, text=True)
        assert (done.returncode, done.stderr) == (0, ""), query
    assert "from the hostile id" in (tmp_path / "session.jsonl").read_text()
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()
