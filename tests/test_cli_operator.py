"""The command line as an on-call operator meets it (issue 30): options anywhere, errors
as JSON, ids that paste back, a drop that shows what it would do, exit codes a shell
can trust, ages, a damaged spool refused alike by every command."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import apsw
import pytest
from _gateway import state_db
from _helpers import ROOT
from _old_schemas import make_v3_spool
from test_cli import DROP_LISTING_KEYS, DROP_ROW_KEYS

import walspool
from walspool.cli import main
from walspool.cli._filters import MAX_RANGE
from walspool.store.schema import SCHEMA_VERSION

MSG = {"role": "user", "content": "hello"}


def run(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    """``main(argv)``; its exit status, stdout and stderr."""
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def usage(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    """``main(argv)`` that argparse refuses: its exit status, stdout and stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return int(exit_.value.code or 0), out, err


def patch(path: Path, *sql: str) -> None:
    """Edit a closed spool with apsw (never the stdlib sqlite3 in this process)."""
    conn = apsw.Connection(str(path))
    try:
        for statement in sql:
            conn.execute(statement)
    finally:
        conn.close()


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def spool_file(tmp_path: Path) -> Path:
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append_many([("sess-z", {"role": "user", "content": f"m{i}"}) for i in range(5)])
        spool.append("sess-y", MSG)
    return path


# -- parsing and errors ----------------------------------------------------------------


def test_an_option_between_the_positional_arguments_parses(capsys, spool_file):
    rc, out, err = run(capsys, "show", spool_file, "--limit", "2", "sess-z")
    assert (rc, err) == (0, "")
    assert out.splitlines()[0] == f"session sess-z: 2 of 5 rows in {spool_file}"
    rc, out, _ = run(capsys, "show", "--json", spool_file, "--tail", "1", "sess-z")
    assert rc == 0 and [r["seq"] for r in json.loads(out)] == [5]


def test_every_json_error_is_an_object_on_stdout(capsys, tmp_path, spool_file):
    missing = tmp_path / "missing.db"
    for command in ("stats", "ls", "check"):
        rc, out, err = run(capsys, command, missing, "--json")
        assert rc == 1 and err.startswith(f"walspool {command}: ")
        got = json.loads(out)
        if command != "check":  # check's own object says what is wrong with the file
            assert got == {"command": command, "error": err[len(command) + 11 : -1], "exit": 1}
    rc, out, err = run(capsys, "show", spool_file, "nobody", "--json")
    assert rc == 1 and json.loads(out)["error"] == f"no rows for session 'nobody' in {spool_file}"
    rc, out, err = usage(capsys, "show", spool_file, "sess-z", "--nope", "--json")
    assert rc == 2 and "usage:" in err
    assert json.loads(out) == {
        "command": "show",
        "error": "unrecognized arguments: --nope",
        "exit": 2,
    }
    # Without --json, stdout stays empty.
    rc, out, _ = run(capsys, "stats", missing)
    assert (rc, out) == (1, "")


def test_a_json_usage_error_names_the_command_as_given(capsys, spool_file):
    """`command` is a string, as documented: an unknown command as typed (not a known
    name found later on the line), "" when the line names none."""
    rc, out, err = usage(capsys, "shwo", spool_file, "ls", "--json")
    assert rc == 2 and "invalid choice: 'shwo'" in err
    got = json.loads(out)
    assert (got["command"], got["exit"]) == ("shwo", 2) and "invalid choice" in got["error"]
    rc, out, _ = usage(capsys, "--json", "stats", spool_file, "--nope")
    assert rc == 2 and json.loads(out)["command"] == "stats"
    rc, out, _ = usage(capsys, "--json")
    assert rc == 2 and json.loads(out)["command"] == ""


# -- ids that paste back, drop that shows what it would do -------------------------------


@pytest.fixture
def set_aside(tmp_path: Path) -> Path:
    """A spool of 1,200 rows in session s (ids and seqs past a thousand), the last
    three quarantined, one superseded, one in flight; and a row in session t."""
    path = tmp_path / "spool.db"
    with walspool.Spool(path, durability="normal") as spool:
        spool.append_many([("s", {"role": "user", "content": f"m{i}"}) for i in range(1200)])
        spool.append("t", MSG)
    patch(
        path,
        "UPDATE records SET status = 'quarantined', attempts = 1, last_error = 'RowRejected: "
        "bad' WHERE session_id = 's' AND seq > 1197",
        "UPDATE records SET status = 'superseded' WHERE session_id = 's' AND seq = 1000",
        "UPDATE records SET status = 'quarantined', inflight = 5 WHERE session_id = 't'",
    )
    return path


def test_show_prints_ids_and_seqs_as_drop_takes_them(capsys, set_aside):
    rc, out, _ = run(capsys, "show", set_aside, "s", "--tail", "3")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0] == f"session s: 3 of 1,200 rows in {set_aside}"
    seq, row_id = lines[2].split()[:2]
    assert (seq, row_id) == ("1198", "1198") and "," not in lines[2].split("RowRejected")[0]
    rc, out, err = run(capsys, "drop", set_aside, "--id", row_id, "--yes")
    assert (rc, err) == (0, "") and out.startswith(f"dropped 1 row of {set_aside}: 1198\n")


def test_drop_takes_comma_separated_ids_and_a_selector(capsys, set_aside):
    """Ids go in as drop prints them: comma-separated, runs of three or more as ranges."""
    rc, out, err = run(capsys, "drop", set_aside, "--id", "1198,1199", "--id", "1200", "--yes")
    assert (rc, err) == (0, "") and "dropped 3 rows" in out and ": 1198-1200\n" in out
    rc, out, err = run(capsys, "requeue", set_aside, "--session", "s", "--superseded", "--json")
    assert (rc, err) == (0, "") and json.loads(out)["requeued"] == [1000]
    # No set-aside row left in s: an error, not "0 rows dropped".
    rc, out, err = run(capsys, "drop", set_aside, "--session", "s", "--quarantined", "--yes")
    assert (rc, out) == (1, "") and "no quarantined rows of session 's'" in err
    rc, _, err = run(capsys, "drop", set_aside, "--id", "7", "--quarantined", "--yes")
    assert rc == 2 and "not both" in err
    for bad in ("1,04x", "0", ",", "5-3", "0-2", "1-", "-4", f"1-{MAX_RANGE + 1}"):
        assert usage(capsys, "drop", set_aside, "--id", bad)[0] == 2, bad


def test_ids_print_as_ranges_and_ranges_name_the_same_rows(capsys, tmp_path):
    """requeue prints the ids it changed with runs as ranges; pasted back into --id,
    the ranges name those rows again (drop takes the same)."""
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append_many([("s", MSG)] * 9)
    patch(path, "UPDATE records SET status = 'quarantined' WHERE id NOT IN (4, 8)")
    rc, out, err = run(capsys, "requeue", path, "--quarantined")
    assert (rc, err) == (0, "")
    listed = out.splitlines()[0].split(": ", 1)[1]
    assert listed == "1-3, 5-7, 9"
    patch(path, "UPDATE records SET status = 'quarantined'")
    rc, out, err = run(capsys, "drop", path, "--id", listed.replace(" ", ""), "--yes", "--json")
    assert (rc, err) == (0, "") and json.loads(out)["dropped"] == [1, 2, 3, 5, 6, 7, 9]


@pytest.mark.parametrize("command", ["drop", "requeue"])
def test_a_session_with_no_rows_is_named_as_such_not_as_having_none_set_aside(
    capsys, set_aside, command
):
    """A mistyped session is "no rows for session", as show, export and replay say; a
    session that has rows but none set aside is told apart, and nothing changes."""
    sure = ["--yes"] if command == "drop" else []
    before = snapshot(set_aside)
    rc, out, err = run(capsys, command, set_aside, "--session", "TYPO", *sure)
    assert (rc, out) == (1, "") and f"no rows for session 'TYPO' in {set_aside}" in err
    rc, out, err = run(capsys, command, set_aside, "--session", "TYPO", *sure, "--json")
    assert rc == 1 and json.loads(out)["error"] == f"no rows for session 'TYPO' in {set_aside}"
    rc, out, err = run(capsys, "export", set_aside, "--session", "TYPO")
    assert rc == 1 and f"no rows for session 'TYPO' in {set_aside}" in err
    assert snapshot(set_aside) == before


def test_a_mistyped_session_or_spool_gets_the_names_near_it(capsys, tmp_path):
    """Every command that names a session says which of the spool's sessions (ids, and
    keys as ls prints them) are close to a typo; every command given a missing spool
    says which files beside it are close to its name."""
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append("telegram:12345", MSG)
        spool.append(None, MSG, session_key="agent:main:telegram:dm:1")
        spool.append("other", MSG)
    for command, *rest in (
        ["show", "telegram:12354"],
        ["export", "--session", "telegram:12354"],
        ["requeue", "--session", "telegram:12354"],
        ["drop", "--session", "telegram:12354", "--yes"],
    ):
        rc, out, err = run(capsys, command, path, *rest)
        assert (rc, out) == (1, "")
        assert err == (
            f"walspool {command}: no rows for session 'telegram:12354' in {path}; "
            "did you mean: telegram:12345?\n"
        )
    rc, _, err = run(capsys, "show", path, "key:agent:main:telegram:dm:2")
    assert rc == 1 and err.endswith("; did you mean: key:agent:main:telegram:dm:1?\n")
    rc, _, err = run(capsys, "show", path, "zzzzzz")  # nothing near: no hint
    assert rc == 1 and err == f"walspool show: no rows for session 'zzzzzz' in {path}\n"
    for command in ("ls", "stats", "check"):
        rc, _, err = run(capsys, command, tmp_path / "spool.bd")
        assert rc == 1 and "(no such file; near that name: spool.db)" in err, command


#: ``sh -c SCRIPT sh DIR COMMAND...``: COMMAND run with DIR mounted read-only over itself,
#: in a private mount namespace (``unshare -m``, as root).
READ_ONLY = """
set -e
mount --bind "$1" "$1"; mount -o remount,bind,ro "$1"
shift
exec "$@"
"""


def test_a_spool_on_a_read_only_file_system_is_said_to_be_so(tmp_path):
    """Every command that writes the spool (replay's dry run too: a replay would fail)
    says the spool's file system is read-only, exit 1, rather than naming a lock file it
    must be or a /proc path; the read commands read it."""
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here: {probe.stderr.strip()}")
    spool_dir = tmp_path / "ro"
    spool_dir.mkdir()
    path = spool_dir / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append("s", MSG)
        spool.append("s", MSG)
    patch(path, "UPDATE records SET status = 'quarantined' WHERE seq = 1")
    state = state_db(tmp_path / "state.db", "s")
    before = snapshot(path)
    said = "is on a read-only file system: walspool cannot write to it"
    for command in (
        ["replay", "--into", state, "--dry-run"],
        ["replay", "--into", state],
        ["requeue", "--id", "1"],
        ["drop", "--id", "1", "--yes"],
        ["vacuum"],
        ["import-json", str(tmp_path)],
        ["ls"],
    ):
        done = subprocess.run(
            ["unshare", "-m", "sh", "-c", READ_ONLY, "sh", str(spool_dir),
             sys.executable, "-m", "walspool", command[0], str(path), *command[1:]],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if command == ["ls"]:
            assert (done.returncode, done.stderr) == (0, ""), done.stderr
            assert done.stdout.splitlines()[1].split()[:4] == ["s", "2", "0", "1"]
        else:
            assert done.returncode == 1, (command, done.stdout, done.stderr)
            assert (
                done.stderr == f"walspool {command[0]}: {path} {said} (stats, ls, show, "
                "export and check read it; to replay or change it, copy it with its -wal "
                "to a writable place)\n"
            ), command
    assert snapshot(path) == before


def test_a_spool_of_an_older_schema_is_upgraded_by_the_commands_that_write_it(capsys, tmp_path):
    """With the gateway stopped, an operator can still replay (or change) a schema 3
    spool: each command that writes upgrades it first, as the gateway's start would,
    and says so; the read commands and a dry run (which write nothing) refuse it and
    say which commands upgrade it."""
    rows = [("s", i + 1, f'{{"role":"user","content":"m{i}"}}', None) for i in range(3)]
    state = state_db(tmp_path / "state.db", "s")
    (tmp_path / "pending").mkdir()  # an empty JSON spool to import
    for n, (command, *rest) in enumerate(
        (["ls"], ["replay", "--into", state, "--dry-run"], ["vacuum"],
         ["requeue", "--id", "1"], ["drop", "--id", "1", "--yes"],
         ["import-json", str(tmp_path / "pending")], ["replay", "--into", state])
    ):  # fmt: skip
        path = tmp_path / f"v3-{n}.db"
        make_v3_spool(path, rows)
        rc, out, err = run(capsys, command, path, *rest)
        if command == "ls" or "--dry-run" in rest:
            assert (rc, out) == (1, "")
            assert err == (
                f"walspool {command}: {path} has spool schema 3; a read-only open cannot "
                f"upgrade it to {SCHEMA_VERSION}: a command that writes it (walspool replay, "
                "requeue, drop, vacuum, import-json), the gateway's next start or "
                "walspool.Spool(path) does\n"
            )
            continue
        assert err.splitlines()[0] == (
            f"walspool {command}: {path} has spool schema 3: upgraded to schema {SCHEMA_VERSION}"
        )
        # Row 1 was not set aside: requeue and drop find nothing they may change.
        assert rc == (1 if command in ("requeue", "drop") else 0), err
        if command in ("requeue", "drop", "import-json"):
            assert rows_of(path) == [1, 2, 3], command  # the upgrade kept every row
        assert run(capsys, "ls", path)[0] == 0
    conn = sqlite3.connect(f"file:{state}?mode=ro", uri=True)
    try:
        moved = [c for (c,) in conn.execute("SELECT content FROM messages ORDER BY id")]
    finally:
        conn.close()
    assert moved == ["m0", "m1", "m2"]


def rows_of(path: Path) -> list[int]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return [i for (i,) in conn.execute("SELECT id FROM records ORDER BY id")]
    finally:
        conn.close()


def snapshot(path: Path) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT id, status, inflight, attempts FROM records").fetchall()
    finally:
        conn.close()


@pytest.mark.parametrize("command", ["drop", "requeue"])
def test_ids_that_read_as_one_number_with_thousands_separators_are_refused(
    capsys, set_aside, command
):
    """`--id 1,041` could be row 1041 (counts print as 1,200) or rows 1 and 41: drop
    and requeue refuse it with both readings and the unambiguous forms; lists that are
    not such a number still take several ids."""
    before = digest(set_aside)
    for ids, rows, each in (
        ("1,041", "rows 1 and 41", "--id 1 --id 41"),
        ("1,198,199", "rows 1, 198 and 199", "--id 1 --id 198 --id 199"),
    ):
        yes = ["--yes"] if command == "drop" else []
        rc, out, err = usage(capsys, command, set_aside, "--id", ids, *yes)
        whole = ids.replace(",", "")
        assert (rc, out) == (2, "")
        assert err.splitlines()[-1] == (
            f"walspool {command}: error: argument --id: '{ids}' is ambiguous: row {whole} written "
            f"with a thousands separator, or {rows}? ids print without separators: give "
            f"--id {whole}, or {each}"
        )
    assert digest(set_aside) == before
    if command == "drop":
        rc, out, err = run(capsys, "drop", set_aside, "--id", "1198,1199,12", "--json")
        got = json.loads(out)
        assert got["missing"] == [] and sorted(r["id"] for r in got["rows"]) == [12, 1198, 1199]
        assert got["would_drop"] == []  # all or none: 12 is refused
        assert rc == 1 and "12 (replayable, not set aside)" in err


def test_drop_without_yes_shows_what_it_would_drop_and_says_what_yes_would_refuse(
    capsys, set_aside
):
    """Without --yes: the rows it would drop, and exit 3 ("pass --yes") when --yes would
    drop them all; when it would refuse (a row missing, replayable or in flight: all or
    none), it would drop none (each row still listed with its state), and exits 1 with
    the error --yes would give, never "pass --yes"."""
    before = digest(set_aside)
    rc, out, err = run(capsys, "drop", set_aside, "--id", "1198,1199")
    assert rc == 3 and "pass --yes" in err
    rc, out, err = run(capsys, "drop", set_aside, "--id", "1198,1199", "--json")
    got = json.loads(out)
    assert rc == 3 and set(got) == DROP_LISTING_KEYS
    assert (got["exit"], got["would_drop"], got["missing"]) == (3, [1198, 1199], [])
    rc, out, err = run(capsys, "drop", set_aside, "--quarantined")
    assert rc == 1 and "pass --yes" not in err
    assert err.count("\n") == 1 and err.endswith(
        "nothing was changed; drop takes only rows set aside (quarantined or superseded): "
        "1201 (a replay has it out)\n"
    )
    lines = out.splitlines()
    assert lines[0] == f"drop would take no rows of {set_aside} (all or none, and 1 row refused):"
    assert lines[1].split() == ["ID", "SESSION", "SEQ", "STATUS", "REASON", "LAST", "ERROR"]
    assert [line.split()[:4] for line in lines[2:]] == [
        ["1198", "s", "1198", "quarantined"],
        ["1199", "s", "1199", "quarantined"],
        ["1200", "s", "1200", "quarantined"],
        ["1201", "t", "1", "in"],  # in flight: refused
    ]
    assert "in flight: refused" in lines[-1]
    rc, out, err = run(capsys, "drop", set_aside, "--id", "5,1000,9999", "--json")
    got = json.loads(out)
    assert set(got) == DROP_LISTING_KEYS  # as docs/cli.md states it
    assert all(set(row) == DROP_ROW_KEYS for row in got["rows"])
    assert rc == 1 and (got["command"], got["exit"]) == ("drop", 1)
    assert got["error"].endswith("9999 (no such row), 5 (replayable, not set aside)")
    assert (got["would_drop"], got["missing"]) == ([], [9999])  # all or none: none
    rc, _, err = run(capsys, "drop", set_aside, "--id", "5,1000,9999", "--yes")
    assert rc == 1 and "9999 (no such row)" in err and "5 (replayable, not set aside)" in err
    assert [(r["id"], r["status"]) for r in got["rows"]] == [(5, None), (1000, "superseded")]
    assert digest(set_aside) == before


# -- replay: exit codes a shell can trust, texts that say what is so ---------------------


def test_replay_names_the_flag_that_creates_missing_sessions(capsys, tmp_path):
    pytest.importorskip("hermes_state")
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append("s2", MSG)
    state = state_db(tmp_path / "state.db", "s1")
    rc, out, err = run(capsys, "replay", path, "--into", state)
    assert rc == 3 and "--create-missing creates missing sessions" in err
    assert "replay with --create-missing to create it" in out
    assert "create_missing=True" not in out
    rc, out, _ = run(capsys, "ls", path)
    assert "FOREIGN KEY" in out and "create_missing=True" not in out
    rc, out, _ = run(capsys, "show", path, "s2", "--full")
    assert "replay with --create-missing to create it" in out
    assert "create_missing=True" not in out
    # --json stays as stored: lossless.
    rc, out, _ = run(capsys, "show", path, "s2", "--json")
    assert "create_missing=True" in json.loads(out)[0]["last_error"]


def test_replay_that_quarantined_rows_exits_5(capsys, tmp_path):
    """Nothing held, but a row state.db refused for its content: `replay && ...` must
    not go on as if all moved."""
    pytest.importorskip("hermes_state")
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append_many([("s1", {"role": "user", "content": f"m{i}"}) for i in range(3)])
    patch(path, "UPDATE records SET payload = 'not json {', size = 10 WHERE seq = 2")
    state = state_db(tmp_path / "state.db", "s1")
    rc, out, err = run(capsys, "replay", path, "--into", state)
    assert rc == 5
    assert "moved 2 rows" in out and "quarantined 1 row" in out
    assert err == (
        "walspool replay: 1 row quarantined: kept, not replayed; `walspool ls` counts "
        "them, `walspool show` names them\n"
    )
    rc, out, err = run(capsys, "replay", path, "--into", state)  # nothing left to move
    assert (rc, err) == (0, "")


# -- ls and stats: what is stuck, and for how long ---------------------------------------


def test_ls_tells_quarantined_rows_from_rows_waiting_to_retry(capsys, set_aside):
    """RETRYING counts every row a failed write holds: the failed rows and each
    replayable row behind them (a session moves in order), not only the rows that
    carry an error; rows set aside or in flight are not retrying."""
    patch(
        set_aside,
        "UPDATE records SET attempts = 2, last_error = 'database is locked' "
        "WHERE session_id = 's' AND seq IN (1, 2)",
        "UPDATE records SET created_at = created_at - 7200",  # two hours old
    )
    rc, out, err = run(capsys, "ls", set_aside)
    assert (rc, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].split()[:7] == [
        "SESSION", "ROWS", "RETRYING", "QUARANTINED", "SUPERSEDED", "IN", "FLIGHT",
    ]  # fmt: skip
    s, t = (line.split() for line in lines[1:])
    # s: seq 1 and 2 failed, 1,196 retrying (all but 3 quarantined and 1 superseded);
    # t: its one row quarantined, in flight.
    assert s[:6] == ["s", "1,200", "1,196", "3", "1", "0"]
    assert t[:6] == ["t", "1", "0", "1", "0", "1"]
    assert s[6:10] == ["37.6", "KiB", "2h00m", "2h00m"]  # bytes as stats prints them; ages
    rc, out, _ = run(capsys, "ls", set_aside, "--json")
    by = {b["session_id"]: b for b in json.loads(out)}
    assert (by["s"]["retrying"], by["s"]["quarantined"], by["s"]["inflight"]) == (1196, 3, 0)
    assert (by["t"]["retrying"], by["t"]["quarantined"], by["t"]["inflight"]) == (0, 1, 1)
    assert 7200 <= by["s"]["oldest_age"] < 7200 + 3600  # a bound, not a timing


def test_stats_shows_ages_and_its_json_has_the_oldest_age(capsys, spool_file):
    patch(spool_file, "UPDATE records SET created_at = created_at - 90000")  # 25 hours
    rc, out, _ = run(capsys, "stats", spool_file)
    assert rc == 0
    oldest = next(line for line in out.splitlines() if line.startswith("oldest"))
    assert oldest.endswith(" (1d01h ago)")
    rc, out, _ = run(capsys, "stats", spool_file, "--json")
    stats = json.loads(out)
    assert 90000 <= stats["oldest_age"] < 90000 + 3600
    assert stats["oldest_age"] >= stats["newest_age"] >= 90000


def failing_spool(path: Path, names: list[str]) -> Path:
    """A spool with one row per name, each failed at a time of its own: the later in
    ``names``, the more recent (an hour ago, then a second later each)."""
    with walspool.Spool(path) as spool:
        for name in names:
            spool.append(name, {"role": "user", "content": "x"})
    patch(
        path,
        "UPDATE records SET attempts = 1, last_attempt_at = unixepoch() - 3600 + id, "
        "last_error = 'FOREIGN KEY constraint failed in ' || id || char(10) || 'forged'",
    )
    return path


def test_stats_shows_the_latest_error_of_the_sessions_that_failed_last(capsys, tmp_path):
    """Five sessions, latest failure first, each with its own latest error (the older
    one of a session that failed twice is not shown), escaped; a session named by 2 MiB
    is read clipped and says so."""
    huge = "h" * (2 * 1024 * 1024)
    names = ["a", "b", "c", "b", "d", "e", "f", huge]
    path = failing_spool(tmp_path / "spool.db", names)
    rc, out, _ = run(capsys, "stats", path, "--json")
    errors = json.loads(out)["last_errors"]
    assert rc == 0
    assert [(e["session_id"][:8], e["clipped"]) for e in errors] == [
        ("h" * 8, True), ("f", False), ("e", False), ("d", False), ("b", False)
    ]  # fmt: skip
    assert len(errors[0]["session_id"]) == 1024
    assert errors[4]["error"] == "FOREIGN KEY constraint failed in 4\nforged"  # b's latest
    assert all(3590 <= e["age"] < 3600 + 600 for e in errors)  # a bound, not a timing
    rc, out, _ = run(capsys, "stats", path)
    lines = out.splitlines()
    at = lines.index("last errors latest first")
    shown = [line.split() for line in lines[at + 1 : at + 6]]
    assert [words[0] for words in shown[1:]] == ["f", "e", "d", "b"]
    assert shown[0][0].endswith("…") and shown[0][1] == "(clipped)"
    assert shown[4][1].startswith("59m")  # an hour ago, less b's row id (4) in seconds
    # one line: clip folds whitespace, a newline included, into single spaces
    assert shown[4][2:] == "ago: FOREIGN KEY constraint failed in 4 forged".split()
    assert lines[at + 6].startswith("files")


def test_stats_with_a_sample_gives_the_rates_and_the_drain_eta(capsys, tmp_path, monkeypatch):
    """--sample reads twice: rows that left in between give the replay rate and the
    ETA of the rest; a spool nothing leaves is "not draining"."""
    import walspool.cli.stats as stats_command

    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        for i in range(40):
            spool.append("s", {"role": "user", "content": f"m{i}"})
    clock = {"now": 1000.0}

    def replay_ten(seconds: float) -> None:  # the sample's wait: ten rows leave meanwhile
        assert seconds == 5
        patch(path, "DELETE FROM records WHERE id <= 10")
        clock["now"] += seconds

    class Time:  # the clocks the two readings see, and the wait between them
        time = staticmethod(time_now)
        monotonic = staticmethod(lambda: clock["now"])
        sleep = staticmethod(replay_ten)

    monkeypatch.setattr(stats_command, "time", Time)
    monkeypatch.setattr("walspool.cli._watching.time", Time)
    rc, out, _ = run(capsys, "stats", path, "--sample", "5", "--json")
    stats = json.loads(out)
    assert rc == 0 and stats["rows"] == 30
    assert (stats["rates"]["appended"], stats["rates"]["replayed"]) == (0.0, 2.0)
    assert stats["drain_eta"] == 15.0  # 30 rows at 2 a second
    rc, out, _ = run(capsys, "stats", path, "--sample", "5")
    eta = next(line for line in out.splitlines() if line.startswith("drain ETA"))
    assert eta == "drain ETA   not draining (no more rows leave than arrive)"  # nothing left


def time_now() -> float:
    import time

    return time.time()


def test_stats_paints_what_needs_a_look_on_a_terminal_only(tmp_path):
    """On a terminal (a pty) the rows with errors are yellow and a spool no process has
    open is red; NO_COLOR, or a pipe, prints no escape at all."""
    import pty

    path = failing_spool(tmp_path / "spool.db", ["a"])

    def stats_on(terminal: bool, **env: str) -> str:
        argv = [sys.executable, "-m", "walspool", "stats", str(path)]
        environ = {**os.environ, "PYTHONPATH": str(ROOT), **env}
        environ.pop("NO_COLOR", None) if not env else None
        if not terminal:
            return subprocess.run(argv, capture_output=True, text=True, env=environ).stdout
        main_fd, child_fd = pty.openpty()
        proc = subprocess.Popen(argv, stdout=child_fd, env=environ)
        os.close(child_fd)
        chunks = []
        while True:
            try:
                chunk = os.read(main_fd, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        os.close(main_fd)
        assert proc.wait(60) == 0
        return b"".join(chunks).decode()

    painted = stats_on(True)
    assert "\x1b[33mwith errors 1 row\x1b[0m" in painted
    assert "\x1b[31mopen by     no process" in painted
    assert "\x1b[33mrows" not in painted and "\x1b[33min flight" not in painted
    for plain in (stats_on(True, NO_COLOR="1"), stats_on(False)):
        assert "\x1b" not in plain and "with errors 1 row" in plain


def test_since_takes_an_age(capsys, spool_file):
    patch(spool_file, "UPDATE records SET created_at = created_at - 3600 WHERE seq <= 3")
    rc, out, _ = run(capsys, "export", spool_file, "--since", "10m", "--session", "sess-z")
    assert rc == 0 and [json.loads(line)["seq"] for line in out.splitlines()] == [4, 5]
    rc, out, _ = run(capsys, "show", spool_file, "sess-z", "--since", "2h")
    assert rc == 0 and out.splitlines()[0].startswith("session sess-z: 5 rows")
    rc, out, _ = run(capsys, "show", spool_file, "sess-z", "--since", "1d", "--limit", "1")
    assert out.splitlines()[0].startswith("session sess-z: 1 of 5 rows")
    rc, _, err = usage(capsys, "export", spool_file, "--since", "10 minutes")
    assert rc == 2 and "an age (30s, 10m, 2h, 1d)" in err


# -- a damaged spool: every command alike ------------------------------------------------


def damage_index(path: Path, index: str) -> None:
    """Garbage over the leaf pages of one index of a closed spool: the rows themselves
    stay readable, so only a command that reads that index would meet the damage."""
    conn = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        size = conn.execute("PRAGMA page_size").get
        pages = [p for (p,) in conn.execute(
            "SELECT pageno FROM dbstat WHERE name = ? AND pagetype = 'leaf'", (index,)
        )]  # fmt: skip
    finally:
        conn.close()
    assert pages
    with open(path, "r+b") as f:
        for page in pages:
            f.seek((page - 1) * size + 100)
            f.write(bytes(range(256)) * 4)


def test_a_damaged_spool_is_refused_alike_by_every_command(capsys, tmp_path):
    """Damage in the statistics index, which show and export never read: each command
    still says the spool is damaged, exit 1, nothing on stdout (with --json the error
    object only), where show and export used to print and exit 0."""
    path = tmp_path / "spool.db"
    with walspool.Spool(path, durability="normal") as spool:
        spool.append_many([(f"s{i % 5}", {"content": "m" * 300}) for i in range(2000)])
    damage_index(path, "records_reason_created_at_size_session_id_session_key_idx")
    commands = [
        ["stats"], ["ls"], ["show", "s1"], ["export"], ["watch", "--interval", "0.1"],
        ["requeue", "--quarantined"], ["drop", "--id", "1"],
    ]  # fmt: skip
    try:
        pytest.importorskip("hermes_state")
        state = state_db(tmp_path / "state.db", "s1")
        commands += [["replay", "--into", state, "--dry-run"], ["replay", "--into", state]]
    except pytest.skip.Exception:
        pass
    for command, *rest in commands:
        rc, out, err = run(capsys, command, path, *rest)
        assert (rc, out) == (1, ""), (command, out, err)
        assert err.startswith(f"walspool {command}: spool {path} is damaged (quick_check: ")
        assert err.count("\n") == 1
        rc, out, err = run(capsys, command, path, *rest, "--json")
        assert rc == 1 and json.loads(out)["error"].startswith(f"spool {path} is damaged")
    rc, out, _ = run(capsys, "check", path)
    assert rc == 1 and "problem: integrity_check" in out


def statements_of(capsys, *argv: Any) -> tuple[int, list[str]]:
    """``main(argv)``'s exit status and every statement SQLite ran for it, on any
    connection it opened (``apsw.connection_hooks``)."""
    ran: list[str] = []

    def trace(conn: apsw.Connection) -> None:
        conn.exec_trace = lambda cursor, sql, bindings: ran.append(sql) or True

    apsw.connection_hooks.append(trace)
    try:
        rc, _, _ = run(capsys, *argv)
    finally:
        apsw.connection_hooks.remove(trace)
    return rc, ran


def test_stats_and_ls_walk_the_pages_instead_of_decoding_every_record(capsys, tmp_path):
    """On a healthy spool stats and ls load every page of every b-tree (cell_size_check)
    instead of PRAGMA quick_check, which decodes every record (before: 1.1 s of stats' 1.1 s
    on a million rows, past its 1 s target); show and export still run quick_check. Damage
    found (the table's pages, which neither reads) is named by quick_check as by every
    command."""
    path = tmp_path / "spool.db"
    with walspool.Spool(path, durability="normal") as spool:
        spool.append_many([(f"s{i % 5}", {"content": "m" * 300}) for i in range(2000)])
    for command in (["stats"], ["ls"]):
        rc, ran = statements_of(capsys, command[0], path)
        assert rc == 0 and "PRAGMA quick_check(1)" not in ran, command
        assert "SELECT count(*) FROM records NOT INDEXED" in ran, command
    for command in (["show", path, "s1"], ["export", path]):
        rc, ran = statements_of(capsys, *command)
        assert rc == 0 and "PRAGMA quick_check(1)" in ran, command
    conn = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        size = conn.execute("PRAGMA page_size").get
        (page,) = conn.execute(
            "SELECT pageno FROM dbstat WHERE name = 'records' AND pagetype = 'leaf' LIMIT 1"
        ).fetchone()
    finally:
        conn.close()
    with open(path, "r+b") as f:
        f.seek((page - 1) * size + 8)
        f.write(b"\xff" * 64)  # the cell pointers: cells outside the page
    for command in ("stats", "ls"):
        rc, out, err = run(capsys, command, path)
        assert (rc, out) == (1, ""), command
        assert err.startswith(f"walspool {command}: spool {path} is damaged (quick_check: ")


def test_export_json_puts_its_error_on_stdout_after_the_records(capsys, spool_file):
    """export's lines are JSON whatever; --json adds the error as a last line."""
    patch(spool_file, "UPDATE records SET payload = 'not json {' WHERE session_id = 'sess-y'")
    rc, plain, err = run(capsys, "export", spool_file)
    assert rc == 1 and "not valid JSON" in err
    rc, out, err = run(capsys, "export", spool_file, "--json")
    *records, last = [json.loads(line) for line in out.splitlines()]
    assert rc == 1 and out.startswith(plain) and len(records) == 6
    assert last == {"command": "export", "error": err[len("walspool export: ") : -1], "exit": 1}
    rc, out, err = run(capsys, "show", spool_file, "sess-y", "--json")
    assert rc == 1 and json.loads(out.splitlines()[-1])["exit"] == 1


# -- every id ls prints pastes back -------------------------------------------------------

EVIL = "evil\x1b[2J\nline\u202e 'quoted'"


def test_a_session_ls_prints_pastes_back_into_show_through_a_shell(capsys, tmp_path):
    """ls escapes what a terminal would obey, as a shell word that gives the id back:
    pasted into `walspool show` (through a real shell) it names the same rows; so does
    the key:<KEY> of a stream spooled by key only."""
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append(EVIL, {"role": "user", "content": "from evil"})
        spool.append(None, {"role": "user", "content": "from a key"}, session_key="agent main:k")
        spool.append("plain-1", {"role": "user", "content": "plain"})
    rc, out, _ = run(capsys, "ls", path)
    assert rc == 0 and "\x1b" not in out
    words = [line.split("  ")[0] for line in out.splitlines()[1:]]
    assert words == [r"$'evil\x1b[2J\nline\u202e \'quoted\''", "'key:agent main:k'", "plain-1"]
    for word, content in zip(words, ("from evil", "from a key", "plain"), strict=True):
        command = f"{shlex.quote(sys.executable)} -m walspool show {shlex.quote(str(path))} "
        done = subprocess.run(
            ["bash", "-c", command + word + " --json --full"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert done.returncode == 0, done.stderr
        assert [r["message"]["content"] for r in json.loads(done.stdout)] == [content]


def test_show_names_its_session_as_the_shell_word_ls_prints(capsys, tmp_path):
    """show's header (table and --full) names the stream with the word ls prints for it,
    so the id in the header pastes back as ls's does; a key stream as `key:<KEY>`,
    however it was asked for."""
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append(EVIL, {"role": "user", "content": "from evil"})
        spool.append(None, {"role": "user", "content": "from a key"}, session_key="agent main:k")
        spool.append("plain-1", {"role": "user", "content": "plain"})
    words = [r"$'evil\x1b[2J\nline\u202e \'quoted\''", "'key:agent main:k'", "plain-1"]
    asked = ([EVIL], ["key:agent main:k"], ["plain-1"])
    for word, argv in zip(words, asked, strict=True):
        rc, out, _ = run(capsys, "show", path, *argv)
        assert rc == 0 and out.splitlines()[0] == f"session {word}: 1 row in {path}"
        rc, out, _ = run(capsys, "show", path, *argv, "--full")
        assert rc == 0 and out.splitlines()[0] == f"session {word} in {path}"
    rc, out, _ = run(capsys, "show", path, "--key", "agent main:k")
    assert rc == 0 and out.splitlines()[0] == f"session 'key:agent main:k': 1 row in {path}"
