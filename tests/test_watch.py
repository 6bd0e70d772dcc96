"""``walspool watch``: the frame as a pure function of a reading, the readings of a real
spool, and the live view in a real terminal (a detached tmux session on a private
socket), driven by keys and waited on by polling the pane with a bound.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import apsw
import msgspec
import pytest
from _helpers import ROOT, MemorySink

import walspool
from walspool.cli import main
from walspool.cli._frame import drain_eta, fit, render
from walspool.cli._holders import Holder
from walspool.cli._output import CELL_WIDTH
from walspool.cli._watching import (
    MAX_STREAMS,
    Rates,
    Snapshot,
    Stream,
    rates,
    read_snapshot,
    try_snapshot,
)
from walspool.replay.replayer import Replayer
from walspool.store import memory
from walspool.store.backlog import CHARS

MSG = {"role": "user", "content": "hello"}
TMUX = shutil.which("tmux")
#: The longest any one wait on the pane may take before the test fails (a bound, not
#: an expectation: each wait ends as soon as the pane shows what it waits for).
WAIT = 20.0
#: Pause between two looks at the pane.
POLL = 0.05
#: Without the runner's TMUX, COLUMNS and LINES (pytest-xdist's workers have the last
#: two): they describe the runner's terminal, not the pane's.
ENV = {k: v for k, v in os.environ.items() if k not in ("TMUX", "COLUMNS", "LINES")} | {
    "PYTHONPATH": str(ROOT)
}
TOTALS = re.compile(r"^rows +([\d,]+) in ([\d,]+) sessions?,", re.M)
EVIL = "evil\x1b[2J\x1b[31mred\nline\u202e"
#: As ls, show and watch print it: a shell word that gives the id back when pasted.
EVIL_SHOWN = r"$'evil\x1b[2J\x1b[31mred\nline\u202e'"

needs_tmux = pytest.mark.skipif(
    TMUX is None, reason="tmux is not installed (scripts/test installs it)"
)


# -- the frame, from a reading ---------------------------------------------------------


def snap(**fields) -> Snapshot:
    return Snapshot(**{"spool": "/s/spool.db", "taken": 100.0, "at": 1_700_000_100.0} | fields)


def streams(n: int, name: str = "session-{}") -> tuple[Stream, ...]:
    return tuple(
        Stream(
            name.replace("{}", str(i)),
            None,
            i + 1,
            100 * (i + 1),
            1_700_000_000.0 + i,
            i % 2,
            i % 3,
        )
        for i in range(n)
    )


def test_rates_are_appends_and_rows_that_left_per_second_between_two_readings():
    before = snap(uid="u", rows=10, appended=10)
    after = snap(uid="u", rows=25, appended=30, taken=102.0)
    assert rates(before, after) == Rates(seconds=2.0, appended=10.0, replayed=2.5)
    # Nothing to compare with, a failed reading, another file, a count gone back: unknown.
    assert rates(None, after) is None
    assert rates(snap(error="no spool"), after) is None
    assert rates(before, snap(error="no spool", taken=102.0)) is None
    assert rates(snap(uid="other", rows=10, appended=10), after) is None
    assert rates(snap(uid="u", rows=10, appended=40), after) is None
    assert rates(snap(uid="u", rows=30, appended=10), snap(uid="u", rows=40, appended=12)) is None


def test_the_frame_shows_totals_rates_and_streams_oldest_first():
    reading = snap(
        uid="u", rows=6, sessions=3, bytes=600, oldest=1_700_000_000.0, inflight=1, failing=2,
        quarantined=3, superseded=4, appended=9, db_bytes=4096, wal_bytes=0,
        streams=(*streams(2), Stream(None, "agent:main:x", 3, 300, 1_700_000_050.0, 0, 0)),
    )  # fmt: skip
    lines = render(reading, Rates(2.0, 10.0, 2.5), "walspool watch")
    assert lines[:5] == [
        "walspool watch  2023-11-14T22:15:00.000Z",
        "spool        /s/spool.db",
        "open by      no process (no gateway or replay has the spool open; nothing drains "
        "its rows until one opens it)",
        "rows         6 in 3 sessions, 600 B; oldest row 1m40s old",
        "in flight    1; failing 2 (with a last error); quarantined 3; superseded 4",
    ]
    assert lines[5] == (
        "rates        appended 10.0 rows/s, replayed or dropped 2.5 rows/s (over the last 2.0s)"
    )
    assert lines[6] == "drain ETA    not draining (no more rows leave than arrive)"
    assert lines[7].startswith("files        db 4.0 KiB, WAL 0 B; read in ")
    assert lines[9:] == [
        "ROWS  BYTES  OLDEST  IN FLIGHT  FAILING  LAST ERROR  SESSION",
        "1     100 B  1m40s   0          0        -           session-0",
        "2     200 B  1m39s   1          1        -           session-1",
        "3     300 B  50s     0          0        -           key:agent:main:x",
    ]
    first = render(reading, None, "t")
    assert first[5] == "rates        appended -, replayed or dropped - (from the next reading)"
    assert first[6] == "drain ETA    -"
    assert render(snap(uid="u"), None, "t")[-1] == "no rows in the spool"


def test_the_frame_fits_the_terminal_and_counts_the_streams_left_out():
    reading = snap(uid="u", rows=40, sessions=40, streams=streams(40, "a-long-session-id-{}" * 3))
    lines = render(reading, None, "walspool watch  every 1s  q or Ctrl-C quits", 40, 15)
    assert len(lines) == 15
    assert all(len(line) <= 40 for line in lines)
    assert lines[0] == "walspool watch  every 1s  q or Ctrl-C q…"
    assert lines[9].startswith("ROWS  BYTES")
    assert len(lines[10:14]) == 4 and lines[13].endswith("…")
    assert lines[14] == "+36 more sessions"
    # Exactly as many as fit: no "+N more" line; one more, and two make way for it.
    assert render(snap(uid="u", sessions=5, streams=streams(5)), None, "t", 80, 15)[-1].endswith(
        "  session-4"
    )
    one_more = render(snap(uid="u", sessions=6, streams=streams(6)), None, "t", 80, 15)
    assert one_more[-2].endswith("  session-3") and one_more[-1] == "+2 more sessions"
    # More streams than a reading holds: counted even without a height.
    many = snap(uid="u", sessions=MAX_STREAMS + 7, streams=streams(MAX_STREAMS))
    assert render(many, None, "t")[-1] == "+7 more sessions"
    # A terminal smaller than the totals.
    assert len(render(reading, None, "t", 10, 3)) == 3


def test_fit_counts_terminal_columns():
    assert fit("abc", 3) == "abc"
    assert fit("abcd", 3) == "ab…"
    assert fit("会話会話", 5) == "会話…"  # wide characters take two columns
    assert fit("e\u0301e\u0301", 2) == "e\u0301e\u0301"  # combining ones none
    assert fit("abc", 0) == ""


def test_session_ids_are_escaped_in_the_frame():
    reading = snap(uid="u", rows=1, sessions=1, streams=(Stream(EVIL, None, 1, 5, 0.0, 0, 0),))
    lines = render(reading, None, "t")
    assert lines[-1].endswith(EVIL_SHOWN)
    assert not any("\x1b" in line or "\n" in line for line in lines)


# -- readings of a real spool --------------------------------------------------------


def test_a_reading_counts_rows_ever_appended_and_rows_that_left(tmp_path):
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        for sid in ("s1", "s1", "s1", "s2", "s2"):
            spool.append(sid, MSG)
        spool.append(None, MSG, session_key="agent:main:k")
        before = read_snapshot(path)
        Replayer(spool, MemorySink()).replay(session_id="s1")
        spool.append("s2", MSG)
    after = read_snapshot(path)
    assert (before.rows, before.appended, before.sessions) == (6, 6, 3)
    assert (after.rows, after.appended, after.sessions) == (4, 7, 2)
    assert [s.session_id or s.session_key for s in after.streams] == ["s2", "agent:main:k"]
    rate = rates(before, after)
    assert rate is not None
    assert round(rate.appended * rate.seconds) == 1
    assert round(rate.replayed * rate.seconds) == 3


def test_a_missing_spool_is_a_frame_that_says_so(tmp_path, capsys):
    path = tmp_path / "nowhere" / "spool.db"
    reading = try_snapshot(path)
    assert reading.error == "no spool there: not created yet, or moved aside"
    width = max(100, len(f"spool        {path}"))  # a deep tmp_path is not clipped
    assert render(reading, None, "t", width, 30)[1:] == [
        f"spool        {path}",
        "no spool there: not created yet, or moved aside",
        "(read again at each refresh)",
    ]
    # Not a terminal: one reading, so a missing spool is an error, as in stats.
    path = tmp_path / "spool.db"
    assert main(["watch", str(path), "--interval", "0.1", "--wait-for-spool"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"walspool watch: no spool at {path} (no such file)")


def test_a_spool_missing_at_the_start_is_an_error_unless_waited_for(tmp_path, capsys):
    """A mistyped file name in a directory that exists is not watched forever as "not
    created yet": an error at once, naming the files of a close name beside it."""
    with walspool.Spool(tmp_path / "spool.db") as spool:
        spool.append("s1", MSG)
    path = tmp_path / "spol.db"
    for json_ in ([], ["--json"]):
        assert main(["watch", str(path), "--interval", "0.1", *json_]) == 1
        out, err = capsys.readouterr()
        error = (
            f"no spool at {path} (no such file; near that name: spool.db): mistyped? "
            "--wait-for-spool watches for it to be created"
        )
        assert err == f"walspool watch: {error}\n"
        assert json.loads(out or "{}") == (
            {"command": "watch", "error": error, "exit": 1} if json_ else {}
        )
    assert main(["watch", str(tmp_path / "other.db"), "--interval", "0.1"]) == 1
    assert capsys.readouterr().err == (
        f"walspool watch: no spool at {tmp_path / 'other.db'} (no such file): mistyped? "
        "--wait-for-spool watches for it to be created\n"
    )


def test_a_spool_in_a_directory_that_does_not_exist_is_an_error(tmp_path, capsys):
    """A mistyped path is not watched forever as "not created yet", on a terminal or not."""
    path = tmp_path / "hermse" / "spool.db"
    for json_ in ([], ["--json"]):
        assert main(["watch", str(path), "--interval", "0.1", *json_]) == 1
        out, err = capsys.readouterr()
        assert err == (
            f"walspool watch: no directory {path.parent} for the spool spool.db (mistyped?): "
            "watch waits for a spool to appear only in a directory that exists\n"
        )
        assert out == ("" if not json_ else out) and (not json_ or json.loads(out)["exit"] == 1)


def test_a_damaged_file_is_a_frame_that_says_so(tmp_path):
    path = tmp_path / "spool.db"
    path.write_text("not a database")
    assert "not a SQLite database" in (try_snapshot(path).error or "")


def test_json_is_one_reading_with_rates(tmp_path, capsys):
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append("s1", MSG)
    assert main(["watch", str(path), "--interval", "0.1", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert set(got) == {
        "spool", "at", "rows", "sessions", "bytes", "oldest", "oldest_age", "inflight",
        "failing", "quarantined", "superseded", "db_bytes", "wal_bytes", "appended", "seconds",
        "append_rate", "replay_rate", "drain_eta", "open_by", "memory", "streams",
    }  # fmt: skip
    assert (got["spool"], got["rows"], got["sessions"], got["appended"]) == (str(path), 1, 1, 1)
    assert (got["append_rate"], got["replay_rate"]) == (0.0, 0.0)
    assert got["seconds"] > 0
    assert (got["drain_eta"], got["open_by"]) == (None, [])
    (stream,) = got["streams"]
    assert (stream["session_id"], stream["rows"], stream["last_error"]) == ("s1", 1, None)


def test_json_streams_are_what_ls_gives_with_failing_and_the_latest_error(tmp_path, capsys):
    """Each of --json's streams is ls --json's object for it (every key, the same values
    but for ages, read later), plus watch's failing and latest_error."""
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append_many([("s1", MSG)] * 3 + [("s2", MSG)])
        spool.append(None, MSG, session_key="agent:main:k")
    conn = apsw.Connection(str(path))
    conn.execute(
        "UPDATE records SET last_error = 'old: locked', last_attempt_at = 10, attempts = 1 "
        "WHERE session_id = 's1' AND seq = 1;"
        "UPDATE records SET last_error = 'new: refused', last_attempt_at = 20, attempts = 2, "
        "status = 'quarantined' WHERE session_id = 's1' AND seq = 2"
    )
    conn.close()
    assert main(["ls", str(path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert main(["watch", str(path), "--interval", "0.1", "--json"]) == 0
    watched = json.loads(capsys.readouterr().out)["streams"]
    ages = ("oldest_age", "newest_age")
    assert len(watched) == len(listed) == 3
    for w, ls in zip(watched, listed, strict=True):
        assert set(w) == set(ls) | {"failing", "latest_error"}
        assert {k: w[k] for k in ls if k not in ages} == {
            k: v for k, v in ls.items() if k not in ages
        }
        assert all(w[k] >= ls[k] for k in ages)
    s1 = next(w for w in watched if w["session_id"] == "s1")
    # Retrying: seq 1 failed, so it and seq 3 behind it wait; seq 2 is set aside.
    assert (s1["failing"], s1["quarantined"], s1["retrying"]) == (2, 1, 2)
    # ls's last_error is the first failing row's; latest_error the most recent attempt's.
    assert (s1["last_error"], s1["latest_error"]) == ("old: locked", "new: refused")
    assert [(w["session_key"], w["failing"], w["latest_error"]) for w in watched[1:]] == [
        (None, 0, None),
        ("agent:main:k", 0, None),
    ]


def test_interval_must_be_a_number_of_seconds(capsys):
    for bad in ("0", "0.01", "-1", "nan", "soon"):
        with pytest.raises(SystemExit) as exit_:
            main(["watch", "spool.db", "--interval", bad])
        assert exit_.value.code == 2
        assert "--interval" in capsys.readouterr().err


def test_one_frame_when_stdout_is_not_a_terminal(tmp_path):
    home = tmp_path / "hermes"
    with walspool.Spool(home / "spool.db") as spool:
        spool.append_many([(f"session-{i:02d}", MSG) for i in range(40)])
    done = subprocess.run(
        [sys.executable, "-m", "walspool", "watch", "--interval", "0.1"],  # SPOOL: the default
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV | {"HERMES_HOME": str(home)},
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert "\x1b" not in done.stdout
    assert done.stdout.count("walspool watch") == 1
    assert done.stdout.startswith("walspool watch  ")
    assert done.stdout.splitlines()[1] == f"spool        {home / 'spool.db'}"
    assert TOTALS.findall(done.stdout) == [("40", "40")]
    assert "appended 0.0 rows/s, replayed or dropped 0.0 rows/s" in done.stdout
    assert all(f" session-{i:02d}\n" in done.stdout for i in range(40))
    assert "more sessions" not in done.stdout


# -- the live view in a real terminal --------------------------------------------------


class Pane:
    """``walspool watch`` in a detached tmux session of a fixed size, on a private
    socket. A bash wrapper records the exit status and ``stty -a`` before and after,
    then keeps the pane open (``cat``) so the restored terminal can be looked at;
    ``trap : INT`` lets the wrapper outlive the Ctrl-C meant for watch."""

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path
        socket = tmp_path / "tmux.sock"
        # A Unix socket's path has a length limit; -L names one in tmux's private directory.
        self.where = ["-S", str(socket)]
        if len(str(socket)) > 100:
            self.where = ["-L", f"walspool-test-{uuid.uuid4().hex}"]

    def tmux(self, *args: str) -> str:
        done = subprocess.run(
            [TMUX or "tmux", "-u", "-f", "/dev/null", *self.where, *args],
            capture_output=True,
            text=True,
            timeout=30,
            env=ENV,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def start(
        self, *argv: object, width: int = 100, height: int = 30, command: str = "watch"
    ) -> None:
        before, after, rc = (shlex.quote(str(self.dir / n)) for n in ("before", "after", "rc"))
        script = (
            f'trap : INT; stty -a > {before}; "$@"; s=$?; stty -a > {after}; '
            f"echo $s > {rc}.tmp; mv {rc}.tmp {rc}; exec cat"
        )
        watch = [sys.executable, "-m", "walspool", command, *map(str, argv)]
        command = shlex.join(["bash", "-c", script, "wrapper", *watch])
        self.tmux("new-session", "-d", "-x", str(width), "-y", str(height), "-s", "w", command)

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "w")

    def show(self, fmt: str) -> str:
        return self.tmux("display-message", "-p", "-t", "w", fmt).strip()

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "w", *keys)

    def wait_for(self, what: str, check: Callable[[str], bool]) -> str:
        """The screen once ``check`` holds for it."""
        deadline = time.monotonic() + WAIT
        while True:
            screen = self.screen()
            if check(screen):
                return screen
            if time.monotonic() > deadline:
                pytest.fail(f"the pane never showed {what}; it shows:\n{screen}")
            time.sleep(POLL)

    def exit_status(self) -> int:
        rc = self.dir / "rc"
        deadline = time.monotonic() + WAIT
        while not rc.exists():
            if time.monotonic() > deadline:
                pytest.fail(f"watch did not exit; the pane shows:\n{self.screen()}")
            time.sleep(POLL)
        return int(rc.read_text())

    def watch_pid(self) -> int:
        """The watch process: the one child of the wrapper (the pane's process)."""
        wrapper = int(self.show("#{pane_pid}"))
        (child,) = Path(f"/proc/{wrapper}/task/{wrapper}/children").read_text().split()
        return int(child)

    def assert_terminal_restored(self, printed: str = "") -> None:
        """Modes as before (``stty``), the main screen back with the cursor shown, and
        nothing on it but ``printed``."""
        assert (self.dir / "after").read_text() == (self.dir / "before").read_text()
        assert self.show("#{alternate_on} #{cursor_flag}") == "0 1"
        assert self.screen().strip() == printed

    def kill(self) -> None:
        subprocess.run(
            [TMUX or "tmux", *self.where, "kill-server"], capture_output=True, timeout=30, env=ENV
        )


@pytest.fixture
def pane(tmp_path: Path) -> Iterator[Pane]:
    p = Pane(tmp_path)
    try:
        yield p
    finally:
        p.kill()


def no_spool(screen: str) -> bool:
    return "no spool there: not created yet, or moved aside" in screen


def totals(rows: int, sessions: int) -> Callable[[str], bool]:
    return lambda screen: TOTALS.findall(screen) == [(f"{rows:,}", f"{sessions:,}")]


def stream_rows(screen: str, name: str) -> int:
    (line,) = [line for line in screen.splitlines() if line.endswith(f"  {name}")]
    return int(line.split()[0].replace(",", ""))


def one_frame(screen: str, spool: Path) -> None:
    """The pane holds one frame at its top: no copy scrolled up, no second title."""
    lines = screen.splitlines()
    assert lines[0].startswith("walspool watch  every 0.2s  q or Ctrl-C quits  ")
    assert lines[1] == fit(f"spool        {spool}", 100)
    assert screen.count("walspool watch") == 1
    assert len(TOTALS.findall(screen)) == 1


@needs_tmux
def test_the_frame_is_redrawn_in_place_as_rows_arrive_and_q_quits(tmp_path, pane):
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append("session-1", MSG)
    pane.start(path, "--interval", "0.2")
    one_frame(pane.wait_for("the first frame", totals(1, 1)), path)
    assert pane.show("#{alternate_on} #{cursor_flag}") == "1 0"
    with walspool.Spool(path) as spool:  # a writer meanwhile: watch never blocks it
        spool.append_many([("session-2", MSG)] * 3)
    screen = pane.wait_for("the new backlog", totals(4, 2))
    one_frame(screen, path)
    assert (stream_rows(screen, "session-1"), stream_rows(screen, "session-2")) == (1, 3)
    assert re.search(
        r"^rates +appended [\d,.]+ rows/s, replayed or dropped [\d,.]+ rows/s", screen, re.M
    )
    pane.keys("q")
    assert pane.exit_status() == 0
    pane.assert_terminal_restored()


@needs_tmux
def test_ctrl_c_quits_with_status_0_and_restores_the_terminal(tmp_path, pane):
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append("session-1", MSG)
    pane.start(path, "--interval", "0.2")
    pane.wait_for("the first frame", totals(1, 1))
    pane.keys("C-c")
    assert pane.exit_status() == 0
    pane.assert_terminal_restored()


@needs_tmux
def test_sigterm_restores_the_terminal_and_exits_143(tmp_path, pane):
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append("session-1", MSG)
    pane.start(path, "--interval", "0.2")
    pane.wait_for("the first frame", totals(1, 1))
    os.kill(pane.watch_pid(), signal.SIGTERM)
    assert pane.exit_status() == 143
    pane.assert_terminal_restored("walspool watch: interrupted by SIGTERM")


@needs_tmux
def test_a_session_id_with_control_characters_shows_escaped(tmp_path, pane):
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append(EVIL, MSG)
        spool.append("session-1", MSG)
    pane.start(path, "--interval", "0.2")
    screen = pane.wait_for("the first frame", totals(2, 2))
    one_frame(screen, path)  # ESC[2J did not clear it, the newline did not split a line
    assert stream_rows(screen, EVIL_SHOWN) == 1
    assert not any(line.startswith("line") for line in screen.splitlines())
    pane.keys("q")
    assert pane.exit_status() == 0


@needs_tmux
def test_no_file_is_created_beside_a_closed_spool_moved_aside_and_back(tmp_path, pane):
    home = tmp_path / "home"
    path = home / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append_many([("session-1", MSG)] * 2)
    before = sorted(os.listdir(home)), path.read_bytes()
    assert not any(name.endswith(("-wal", "-shm")) for name in before[0])
    pane.start(path, "--interval", "0.2")
    pane.wait_for("the first frame", totals(2, 1))
    path.rename(home / "spool.db.aside")
    pane.wait_for("the spool gone", no_spool)
    (home / "spool.db.aside").rename(path)
    one_frame(pane.wait_for("the spool back", totals(2, 1)), path)
    pane.keys("q")
    assert pane.exit_status() == 0
    assert (sorted(os.listdir(home)), path.read_bytes()) == before


@needs_tmux
def test_a_spool_created_while_watching_is_shown(tmp_path, pane):
    path = tmp_path / "home" / "spool.db"
    path.parent.mkdir()  # the gateway's home: a directory that exists
    pane.start(path, "--interval", "0.2", "--wait-for-spool")
    pane.wait_for("no spool yet", no_spool)
    with walspool.Spool(path) as spool:
        spool.append("session-1", MSG)
    one_frame(pane.wait_for("the new spool", totals(1, 1)), path)
    pane.keys("q")
    assert pane.exit_status() == 0


@needs_tmux
def test_a_missing_spool_on_a_terminal_is_an_error_at_once(tmp_path, pane):
    """Not watched forever: on a terminal too, without --wait-for-spool, a spool that
    does not exist ends watch at once (exit 1), the terminal untouched."""
    path = tmp_path / "home" / "spol.db"
    path.parent.mkdir()
    pane.start(path, "--interval", "0.2", width=250)
    assert pane.exit_status() == 1
    screen = " ".join(pane.screen().split())
    assert f"walspool watch: no spool at {path} (no such file): mistyped?" in screen
    assert (pane.dir / "after").read_text() == (pane.dir / "before").read_text()


@needs_tmux
def test_the_frame_fits_the_terminal_and_follows_a_resize(tmp_path, pane):
    path = tmp_path / "spool.db"
    names = [f"session-{i:02d}-" + "x" * 60 for i in range(30)]
    with walspool.Spool(path) as spool:
        spool.append_many([(name, MSG) for name in names])
    pane.start(path, "--interval", "0.2", width=60, height=12)
    screen = pane.wait_for("the first frame", totals(30, 30))
    lines = screen.splitlines()
    assert len(lines) <= 12 and all(len(line) <= 60 for line in lines)
    assert lines[0].startswith("walspool watch") and screen.count("walspool watch") == 1
    assert "+29 more sessions" in screen
    pane.tmux("resize-window", "-t", "w", "-x", "160", "-y", "45")
    screen = pane.wait_for("every session", lambda s: s.count(" session-") == 30)
    assert "more sessions" not in screen and screen.count("walspool watch") == 1
    table = [line for line in screen.splitlines()[10:] if line]
    assert all(line.endswith(f"  {name}") for line, name in zip(table, names, strict=True))
    pane.keys("q")
    assert pane.exit_status() == 0


@needs_tmux
def test_a_replays_progress_is_redrawn_in_place_in_a_real_terminal(pane, tmp_path):
    """Not watch, but the same terminal: a replay's progress line (on by default when
    stderr is a terminal) is redrawn on one line and ends as its summary, with the
    report below it; the terminal is left as it was."""
    hermes_state = pytest.importorskip("hermes_state")
    state = tmp_path / "state.db"
    db = hermes_state.SessionDB(db_path=state)
    db.create_session("s1", "telegram")
    db.close()
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append_many([("s1", {"role": "user", "content": f"m{i}"}) for i in range(3000)])
    pane.start(path, "--into", state, command="replay", width=250, height=12)
    assert pane.exit_status() == 0
    screen = pane.screen()
    lines = [line for line in screen.splitlines() if line.strip()]
    progress = [line for line in lines if line.startswith("replay: ")]
    assert len(progress) == 1, screen
    assert re.fullmatch(r"replay: 3,000/3,000 \(100%\), [\d,]+ rows/s, took \d+s *", progress[0])
    assert f"moved 3,000 rows from {path} into {state}" in screen
    assert (tmp_path / "after").read_text() == (tmp_path / "before").read_text()


# -- who has the spool open, errors, the drain's ETA, colour (issue 30) ------------------

#: A gateway stand-in: opens the spool, says so, and keeps it open until stdin closes.
HOLDER = """
import sys, walspool
spool = walspool.Spool(sys.argv[1])
spool.append("s1", {"role": "user", "content": "held"})
print("open", flush=True)
sys.stdin.read()
spool.close()
"""


def test_watch_says_which_process_has_the_spool_open(tmp_path, capsys):
    path = tmp_path / "spool.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path), "gateway-stand-in"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "open\n"
        assert main(["watch", str(path), "--interval", "0.1", "--json"]) == 0
        (holder,) = json.loads(capsys.readouterr().out)["open_by"]
        assert holder["pid"] == proc.pid and holder["command"].startswith(f"{sys.executable} -c ")
        assert main(["watch", str(path), "--interval", "0.1"]) == 0
        assert f"\nopen by      pid {proc.pid} (" in capsys.readouterr().out
        assert main(["stats", str(path)]) == 0  # stats says it too
        assert f"\nopen by     pid {proc.pid} (" in capsys.readouterr().out
        assert main(["stats", str(path), "--json"]) == 0
        assert [h["pid"] for h in json.loads(capsys.readouterr().out)["open_by"]] == [proc.pid]
    finally:
        proc.communicate(input="", timeout=60)
    # Closed (or killed): no process, and the frame says what that means.
    assert main(["watch", str(path), "--interval", "0.1"]) == 0
    out = capsys.readouterr().out
    assert (
        "\nopen by      no process (no gateway or replay has the spool open; nothing drains" in out
    )


def test_rows_set_aside_alone_are_not_said_to_wait_for_a_drain(tmp_path, capsys):
    """Only superseded and quarantined rows left, no process: nothing would drain them
    anyway (they move only when asked for), so neither watch nor stats says "nothing
    drains" (nor paints it red); one replayable row more, and both say it."""
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append_many([("s1", MSG)] * 2)
    conn = apsw.Connection(str(path))
    conn.execute("UPDATE records SET status = 'superseded' WHERE seq = 1")
    conn.execute("UPDATE records SET status = 'quarantined', attempts = 1 WHERE seq = 2")
    conn.close()
    said = "nothing drains its rows until one opens it"
    for command in (["watch", str(path), "--interval", "0.1"], ["stats", str(path)]):
        assert main(command) == 0
        out = capsys.readouterr().out
        assert "no process (no gateway or replay has the spool open)" in out, command
        assert said not in out
    with walspool.Spool(path) as spool:
        spool.append("s1", MSG)
    for command in (["watch", str(path), "--interval", "0.1"], ["stats", str(path)]):
        assert main(command) == 0
        assert said in capsys.readouterr().out, command


def test_each_session_shows_its_latest_error(tmp_path, capsys):
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append_many([("s1", MSG)] * 3 + [("s2", MSG)])
    conn = apsw.Connection(str(path))
    conn.execute(
        "UPDATE records SET last_error = 'old: locked', last_attempt_at = 10 WHERE seq = 1;"
        "UPDATE records SET last_error = 'session s1 does not exist in state.db (FOREIGN KEY "
        "constraint failed); replay with create_missing=True to create it', "
        "last_attempt_at = 20 WHERE session_id = 's1' AND seq = 2"
    )
    conn.close()
    reading = read_snapshot(path)
    assert [(s.session_id, s.last_error) for s in reading.streams] == [
        ("s1", reading.streams[0].last_error),
        ("s2", "old: locked"),
    ]
    assert reading.streams[0].last_error.startswith("session s1 does not exist")
    line = next(x for x in render(reading, None, "t") if x.endswith("  s1"))
    assert "  session s1 does not exist in state.db (…  s1" in line  # cut to 40 columns
    assert main(["watch", str(path), "--interval", "0.1", "--json"]) == 0
    by = {s["session_id"]: s for s in json.loads(capsys.readouterr().out)["streams"]}
    assert by["s2"]["last_error"] == "old: locked" and by["s1"]["failing"] == 2


def test_streams_named_past_what_watch_holds_show_as_any_other(tmp_path, capsys):
    """A session id and a key longer than CHARS (read by their unique index, as ls
    reads them): the frame clips them and shows each one's latest error; --json has
    the name, first and latest error whole, and the counts an ordinary name gets. The
    latest error is the most recent attempt's; one never attempted is dated by its
    row's arrival."""
    long_id, long_key = "L" * (CHARS + 10) + "end", "K" * (CHARS + 5) + "end"
    late = "late " + "e" * CHARS
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        for _ in range(4):
            for name in (long_id, "short"):
                spool.append(name, MSG)
            spool.append(None, MSG, session_key=long_key)
        spool.append_many([("never", MSG)] * 2)
    conn = apsw.Connection(str(path))
    conn.execute(
        "UPDATE records SET last_error = 'first', last_attempt_at = 10, attempts = 1 "
        "WHERE seq = 1;"
        "UPDATE records SET last_error = ?, last_attempt_at = 30, attempts = 3 WHERE seq = 2 "
        "AND session_id IS NOT 'never';"
        "UPDATE records SET last_error = 'middle', last_attempt_at = 20, attempts = 2, "
        "status = 'quarantined' WHERE seq = 3;"
        "UPDATE records SET last_error = 'never attempted', attempts = 0 WHERE seq = 2 "
        "AND session_id = 'never'",
        (late,),
    )
    conn.close()
    reading = read_snapshot(path)
    assert reading.sessions == 4 and reading.failing == 11
    held = {s.session_id or s.session_key: s for s in reading.streams}
    assert {len(name) for name in held} == {5, CHARS}  # what a frame needs, at most
    lines = render(reading, None, "t")
    cells = {c[-1][:4]: c for c in (re.split(r" {2,}", line) for line in lines[-4:])}
    assert cells["LLLL"][-1] == "L" * (CELL_WIDTH - 1) + "…"
    assert cells["key:"][-1] == "key:" + "K" * (CELL_WIDTH - 5) + "…"
    clipped = "late " + "e" * 34 + "…"  # cut to 40 columns
    assert [cells[n][4:6] for n in ("LLLL", "key:", "shor")] == [["3", clipped]] * 3
    assert cells["neve"][4:6] == ["2", "never attempted"]

    assert main(["watch", str(path), "--interval", "0.1", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["streams"]
    streams = {s["session_id"] or s["session_key"]: s for s in listed}
    assert set(streams) == {long_id, long_key, "short", "never"}
    assert streams[long_key]["session_id"] is None
    times = {"oldest", "newest", "oldest_age", "newest_age", "session_id", "session_key"}
    short = {k: v for k, v in streams["short"].items() if k not in times}
    # Retrying: every row but the quarantined one, seq 4 (never attempted) too.
    assert short["failing"] == 3 and short["max_attempts"] == 3 and short["retrying"] == 3
    assert (short["last_error"], short["latest_error"]) == ("first", late)
    for name in (long_id, long_key):
        assert {k: v for k, v in streams[name].items() if k not in times} == short
    assert streams["never"]["latest_error"] == "never attempted"


def test_the_drain_eta_is_rows_over_the_rate_they_shrink_by():
    reading = snap(uid="u", rows=600, sessions=1)
    assert drain_eta(reading, Rates(2.0, 10.0, 30.0)) == 30.0  # 600 rows at 20/s net
    assert drain_eta(reading, Rates(2.0, 30.0, 30.0)) is None  # not shrinking
    assert drain_eta(reading, None) is None  # no rates yet
    assert drain_eta(snap(uid="u"), Rates(2.0, 0.0, 0.0)) == 0.0  # nothing to drain
    lines = render(reading, Rates(2.0, 10.0, 30.0), "t")
    assert "drain ETA    30s at the current rates" in lines
    assert "drain ETA    drained" in render(snap(uid="u"), Rates(2.0, 0.0, 0.0), "t")


def test_an_empty_spool_is_not_called_drained_while_a_gateway_holds_messages_in_memory():
    """950 messages in a live gateway's queues, none spooled yet: the spool is drained,
    but they are not, and a kill would lose them; what a gone process lost is not
    counted as held."""

    def entry(pid: int, messages: int, alive: bool | None) -> memory.Published:
        top = [memory.HeldSession("s1", messages, 10 * messages, 1_700_000_000.0)]
        held = memory.Held(pid, "h", None, 1_700_000_090.0, 1, messages, 10 * messages,
                           1_700_000_000.0, top)  # fmt: skip
        return memory.Published(held, alive)

    reading = snap(uid="u", memory=(entry(7, 950, True), entry(8, 5, False)))
    lines = render(reading, Rates(2.0, 0.0, 0.0), "t")
    assert "drain ETA    drained; 950 messages still in a gateway's memory, not spooled" in lines
    assert "in memory    950 messages in 1 session, oldest 1m40s, in the memory of pid 7 " \
        "(lost if the process is killed)" in lines  # fmt: skip
    gone = render(snap(uid="u", memory=(entry(8, 5, False),)), Rates(2.0, 0.0, 0.0), "t")
    assert "drain ETA    drained" in gone


def test_colour_marks_what_needs_a_look_only_when_asked_for():
    reading = snap(
        uid="u", rows=2, sessions=2, failing=1, open_by=(),
        streams=(Stream("s1", None, 1, 5, 1.0, 0, 1, "locked"),
                 Stream("s2", None, 1, 5, 2.0, 0, 0)),
    )  # fmt: skip
    plain = render(reading, None, "t", 200, 40)
    assert not any("\x1b" in line for line in plain)
    painted = render(reading, None, "t", 200, 40, colour=True)
    red, yellow, reset = "\x1b[31m", "\x1b[33m", "\x1b[0m"
    assert painted[2] == red + plain[2] + reset  # rows, and no process to drain them
    assert painted[4] == yellow + plain[4] + reset  # failing rows
    s1 = next(i for i, line in enumerate(plain) if line.endswith("  s1"))
    assert painted[s1] == yellow + plain[s1] + reset and painted[s1 + 1] == plain[s1 + 1]
    held = msgspec.structs.replace(reading, open_by=(Holder(7, "hermes gateway"),))
    assert render(held, None, "t", 200, 40, colour=True)[2] == "open by      pid 7 (hermes gateway)"
    failed = snap(error="no spool there: not created yet, or moved aside")
    assert render(failed, None, "t", colour=True)[2] == red + failed.error + reset


def test_who_has_the_spool_open_is_read_from_the_lock_table_a_line_at_a_time(tmp_path):
    """``holders`` finds the processes holding the spool's open lock among every lock
    of every user (here 200,000 others, a waiter and a garbled line), holding a line
    of the table at a time: its peak allocation stays far below the table's size."""
    import tracemalloc

    from walspool.cli._holders import holders

    path = tmp_path / "spool.db"
    walspool.Spool(path).close()
    st = os.stat(f"{path}.open-lock")
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    other = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino + 1}"
    table = tmp_path / "locks"
    with table.open("w") as f:
        for i in range(200_000):
            f.write(f"{i}: FLOCK  ADVISORY  WRITE {1000 + i} {other} 0 EOF\n")
        f.write(f"7: FLOCK  ADVISORY  READ  4242 {device} 0 EOF\n")
        f.write(f"7: -> FLOCK  ADVISORY  WRITE 4343 {device} 0 EOF\n")  # waits: not a holder
        f.write("8: \xff garbled\n")
        f.write(f"9: FLOCK  ADVISORY  READ  4141 {device} 0 EOF\n")
        f.write(f"10: POSIX  ADVISORY  READ  4040 {device} 0 EOF\n")  # not walspool's lock
    tracemalloc.start()
    try:
        found = holders(path, table)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [h.pid for h in found or ()] == [4141, 4242]
    assert peak < table.stat().st_size // 20, peak
