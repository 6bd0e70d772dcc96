"""The docs: the README's incident runbook run as written on a real outage, each
command line example of docs/cli.md run on its small spool, every link resolving, and
each page within its budget."""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _gateway import BREAK, HEAL, msg, sql, state_db
from _helpers import ROOT, doc_section

import walspool
from walspool import AGENT_HISTORY, CAP_DROP
from walspool.cli import COMMANDS, build_parser, main
from walspool.demo import run_demo
from walspool.hermes import install

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Lines per page (issue 30): the README, the test and benchmark READMEs.
BUDGETS = {"README.md": 300, "tests/README.md": 100, "benchmarks/README.md": 150}


@pytest.mark.parametrize("page", list(BUDGETS))
def test_each_readme_fits_its_budget(page: str) -> None:
    assert (ROOT / page).read_text(encoding="utf-8").count("\n") <= BUDGETS[page]


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_relative_link_names_a_file_that_exists(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert (page.parent / target).exists(), f"{page.name}: {target}"


def runbook_commands() -> list[str]:
    """The runbook's ``walspool`` command lines, comments cut, in order."""
    blocks = re.findall(r"```sh\n(.*?)```", doc_section("Incident runbook"), re.S)
    lines = [line.split("#", 1)[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith("walspool ")]


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

    commands = runbook_commands()
    assert any(c.startswith("walspool replay --into") for c in commands)
    env = {
        **os.environ,
        "HOME": str(tmp_path),
        "HERMES_HOME": str(hermes_home),
        "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}",
    }
    (tmp_path / ".hermes").symlink_to(hermes_home)  # the runbook's ~/.hermes
    codes = {}
    for command in commands:
        if command.startswith("walspool watch"):
            continue  # interactive; tests/test_watch.py runs it on a terminal
        line = command.replace("SESSION", "s1")
        done = subprocess.run(
            ["bash", "-c", line],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        assert "usage:" not in done.stderr, (line, done.stderr)
        codes[line] = done.returncode
    replay = next(c for c in codes if c.startswith("walspool replay --into") and "--dry" not in c)
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
