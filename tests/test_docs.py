"""The docs: the README's incident runbook run as written on a real outage, every link
resolving, and each page within its budget."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from _gateway import BREAK, HEAL, msg, sql
from _helpers import ROOT, doc_section

import walspool
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
