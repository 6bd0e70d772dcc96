"""The docs: the README's incident runbook run as written on a real outage, each
command line example of docs/cli.md run on its small spool, the python snippets of
docs/gateway.md and docs/replay.md run as printed on the real 0.19.0 gateway, every link
resolving, and each page within its budget. (docs/gateway.md's drop-in snippet for the
newer gateways runs in their environments: tests/upstream, tests/axisrow.)"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _gateway import BREAK, HEAL, contents, msg, sql, state_db
from _helpers import ROOT, STEP, doc_section, run_runbook, runbook_commands

import walspool
from walspool import AGENT_HISTORY, CAP_DROP
from walspool.cli import COMMANDS, build_parser, main
from walspool.demo import run_demo
from walspool.hermes import Link, install

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_relative_link_names_a_file_that_exists(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert (page.parent / target).exists(), f"{page.name}: {target}"


@pytest.mark.parametrize(
    "page",
    [*DOCS, ROOT / "benchmarks" / "README.md", ROOT / "tests" / "README.md"],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_every_page_has_one_title(page: Path) -> None:
    """One ``# `` heading a page, its first line (a ``#`` inside a code block, such as a
    shell comment or an OpenMetrics line, is no heading)."""
    text = page.read_text(encoding="utf-8")
    titles, in_code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("# "):
            titles.append(line)
    assert titles == [text.splitlines()[0]], titles


def test_the_incident_runbook_runs_as_written_on_a_real_outage(
    store, hermes_home: Path, tmp_path: Path
) -> None:
    """Each command of the runbook, run by a shell in HERMES_HOME after an outage of
    the real 0.19.0 gateway, with SESSION the session that waits: none is a usage error,
    and the replay moves everything (the gateway is stopped)."""
    store._db.create_session("s1", "telegram")
    sql(store, BREAK)
    with walspool.Spool(hermes_home / "spool.db") as spool:
        link = install(store, spool, retry_interval=0)
        for i in range(260):
            store.append_to_transcript("s1", msg(f"m{i}"))
        link.close()
    sql(store, HEAL)
    store._db.close()

    assert any(c.startswith("walspool replay") for c in runbook_commands())
    env = {
        **os.environ,
        "HOME": str(tmp_path),
        "HERMES_HOME": str(hermes_home),
        "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}",
    }
    (tmp_path / ".hermes").symlink_to(hermes_home)  # the runbook's ~/.hermes
    said = run_runbook(env, tmp_path, "s1", 120)
    codes = {line: done.returncode for line, done in said.items()}
    replay = next(c for c in codes if c.startswith("walspool replay") and "--dry" not in c)
    assert codes[replay] == 0
    assert codes["walspool check"] == 0
    with walspool.Spool(hermes_home / "spool.db") as spool:
        assert spool.stats().rows == 0
    from hermes_state import SessionDB

    db = SessionDB(db_path=hermes_home / "state.db")
    try:
        rows = [m["content"] for m in db.get_messages("s1")]
    finally:
        db.close()
    # The evicted ones, spooled; the 200 in memory went with the process, as released.
    assert rows == [f"m{i}" for i in range(260 - 200)]


# -- docs/cli.md's examples ----------------------------------------------------------------


def build_example_home(home: Path) -> None:
    """The HERMES_HOME of docs/cli.md's examples: a spool with sessions s1 (three
    messages) and s2 (a message, and an agent history a replay quarantined), and the
    free pages of 300 rows of s0 replayed; a state.db with the three sessions; and one
    upstream file in pending_messages."""
    home.mkdir()
    state_db(home / "state.db", "s0", "s1", "s2")
    with walspool.Spool(home / "spool.db") as spool:
        spool.append_many([("s0", msg("x" * 200))] * 300)
        spool.append("s1", {"role": "user", "content": "hello"})
        spool.append("s1", {"role": "assistant", "content": "hi, how can I help?"})
        spool.append("s2", {"role": "user", "content": "my order is late"})
        spool.append("s1", {"role": "user", "content": "I want a refund"})
        history = {"session_id": "s2", "messages": [{"role": "user", "content": "where is it?"}]}
        spool.append("s2", history, reason=AGENT_HISTORY)
    argv = ["replay", str(home / "spool.db"), "--into", str(home / "state.db"), "--no-progress"]
    assert main([*argv, "--session", "s0"]) == 0
    assert main([*argv, "--reason", AGENT_HISTORY]) == 5  # quarantined
    message = {"role": "user", "content": "from upstream"}
    upstream = {"session_key": "s3", "reason": CAP_DROP, "ts": 1.0, "seq": 0}
    (home / "pending_messages").mkdir()
    (home / "pending_messages" / "pending-1.json").write_text(
        json.dumps({**upstream, "data": {"session_id": "s3", "message": message}}, indent=2)
    )


def cli_examples() -> list[tuple[str, list[str]]]:
    """docs/cli.md's examples: each ``console`` block's command line (after ``$ ``)
    and the lines it prints."""
    blocks = re.findall(r"```console\n(.*?)```", doc_section("Examples"), re.S)
    examples = []
    for block in blocks:
        first, *printed = block.rstrip("\n").split("\n")
        assert first.startswith("$ walspool "), first
        examples.append((first[2:], printed))
    return examples


def shape(lines: list[str]) -> list[str]:
    """What an example's output must keep from one run to the next: its lines and
    words, each word holding a digit (a count, a time, an age, a size, a pid) as ``#``,
    and who made a change (user and host) as ``WHO``."""
    shaped = []
    for line in lines:
        line = re.sub(r"(done by ).*", r"\1WHO", line)
        shaped.append(" ".join("#" if re.search(r"\d", w) else w for w in line.split()))
    return shaped


def test_each_command_line_example_runs_and_prints_what_it_shows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every command has an example; each runs (a fresh copy of the example home its
    working directory) with exit status 0, nothing on stderr, and prints what the docs
    show, numbers, times and who aside. The demo runs as test_demo runs it, smaller."""
    pytest.importorskip("hermes_state")
    built = tmp_path / "built"
    build_example_home(built)
    capsys.readouterr()
    examples = cli_examples()
    commands = [shlex.split(line)[1] for line, _ in examples]
    assert commands == [name for name, *_ in COMMANDS]  # one each, in --help's order
    for n, (line, printed) in enumerate(examples):
        argv = shlex.split(line)[1:]
        if argv == ["demo"]:
            assert build_parser().parse_args(argv).command == "demo"
            out = io.StringIO()
            assert run_demo(out, sessions=2, messages=201, threads=1) == 0
            assert shape(out.getvalue().splitlines()) == shape(printed), line
            continue
        home = shutil.copytree(built, tmp_path / f"example-{n}")
        done = subprocess.run(
            [sys.executable, "-m", "walspool", *argv],
            cwd=home,
            env={**os.environ, "PYTHONPATH": str(ROOT), "HERMES_HOME": str(home)},
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        assert (done.returncode, done.stderr) == (0, ""), line
        assert shape(done.stdout.splitlines()) == shape(printed), line


# -- the python snippets of docs/gateway.md and docs/replay.md --------------------------


def run_snippet(section: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """Run the one ``python`` block of the docs' ``## section`` as printed, in
    ``namespace`` (what the text around it says the reader has); the names it left."""
    (snippet,) = re.findall(r"```python\n(.*?)```", doc_section(section), re.S)
    exec(compile(snippet, f"<the snippet of {section!r}>", "exec"), namespace)
    return namespace


def test_the_gateway_link_snippet_links_a_real_runner_as_printed(
    hermes_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/gateway.md's snippet, run as printed with only HERMES_HOME set: its runner a
    real 0.19.0 GatewayRunner of the home, its spool <HERMES_HOME>/spool.db and its link
    a ``Link`` installed on the runner's store, which replays what an earlier run
    spooled; during an outage the evicted messages land in the spool, and the runner's
    own ``stop()`` spools the store's in-memory queue and its pending slot behind them,
    in that order."""
    from gateway.config import Platform
    from gateway.session import SessionSource
    from hermes_state import SessionDB

    # stop() marks a clean shutdown in the home gateway.run read at its import.
    monkeypatch.setattr("gateway.run._hermes_home", hermes_home)
    with walspool.Spool(hermes_home / "spool.db") as earlier:
        earlier.append("s1", msg("spooled by an earlier run"))
    earlier_db = SessionDB()  # what an earlier run left in the home's state.db
    earlier_db.create_session("s1", "telegram")
    earlier_db.close()
    found = run_snippet("Linking it into the gateway", {})
    runner, spool, link = found["runner"], found["spool"], found["link"]
    store = runner.session_store
    chat = store.get_or_create_session(SessionSource(platform=Platform.TELEGRAM, chat_id="42"))
    try:
        assert store.sessions_dir == hermes_home / "sessions"
        assert spool.path == hermes_home / "spool.db"
        assert isinstance(link, Link) and store.append_to_transcript.__self__ is link
        assert link.wait_idle(STEP)  # the recovery, in the background
        assert contents(store, "s1") == ["spooled by an earlier run"]
        sql(store, BREAK)
        for i in range(250):
            store.append_to_transcript("s1", msg(f"m{i}"))
        runner._pending_messages[chat.session_key] = "pending at shutdown"
        asyncio.run(runner.stop())
        rows = [(r.reason, r.session_key, r.message) for r in spool.records()]
    finally:
        link.close()
        spool.close()
        store._db.close()
    assert rows == [
        *((walspool.CAP_DROP, None, msg(f"m{i}")) for i in range(50)),  # evicted at the cap
        *((walspool.SHUTDOWN, None, msg(f"m{i}")) for i in range(50, 250)),  # the queue in memory
        (walspool.SHUTDOWN, chat.session_key, {"text": "pending at shutdown"}),
    ]


def test_the_replay_snippet_moves_rows_into_a_real_session_db_as_printed(
    hermes_home: Path,
) -> None:
    """docs/replay.md's snippet, run as printed with only HERMES_HOME set, on the home's
    spool and state.db (a real 0.19.0 SessionDB): s1's rows move in order; s2, missing
    from state.db, stays with its error (its second row held behind the first); s3's
    row without a role is quarantined and the row after it moves."""
    from hermes_state import SessionDB

    session_db = SessionDB(db_path=hermes_home / "state.db")
    spool = walspool.Spool(hermes_home / "spool.db")
    ran: dict[str, Any] = {}
    try:
        session_db.create_session("s1", "telegram")
        session_db.create_session("s3", "telegram")
        spool.append_many([
            ("s1", msg("hello")),
            ("s2", msg("my order is late")),
            ("s3", {"role": None, "content": "no role"}),
            ("s1", {"role": "assistant", "content": "hi"}),
            ("s2", msg("where is it?")),
            ("s3", msg("after")),
        ])  # fmt: skip
        session_db.close()  # the snippet opens the home's own
        ran = run_snippet("How a replay moves rows", {})
        assert ran["spool"].path == spool.path
        assert ran["session_db"].db_path == hermes_home / "state.db"
        report = ran["report"]
        session_db = ran["session_db"]
        missing = (
            "session s2 does not exist in state.db (FOREIGN KEY constraint failed); "
            "replay with create_missing=True to create it"
        )
        assert (report.moved, report.held, report.errors) == (3, 2, {"s2": missing})
        assert report.quarantined == 1
        assert [m["content"] for m in session_db.get_messages("s1")] == ["hello", "hi"]
        assert [m["content"] for m in session_db.get_messages("s3")] == ["after"]
        left = [(r.session_id, r.status, r.last_error) for r in spool.records()]
        assert left == [
            ("s2", None, missing),
            (
                "s3",
                walspool.QUARANTINED,
                "IntegrityError: NOT NULL constraint failed: messages.role",
            ),
            ("s2", None, None),
        ]
    finally:
        if "spool" in ran:
            ran["spool"].close()
        spool.close()
        session_db.close()
