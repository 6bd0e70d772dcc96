"""The operators' commands on a million-row spool, each a real ``walspool`` process.

One spool of ``CLI_ROWS`` ~500-byte messages over ``SESSIONS`` sessions (some rows
with an error, a few quarantined), built once per run; each command runs once, its
output to /dev/null, timed whole (interpreter start included):

- ``--version``: starting the interpreter and importing walspool, in every figure;
- ``stats``, ``ls``, ``show SESSION`` (one session's rows), ``export`` (every row as
  JSON lines), ``check`` (the full integrity check), ``replay --dry-run`` (into a
  state.db holding every session).

Targets (issue 13): ``stats`` under 1 s, ``ls`` well under a second; the others are
recorded. ``WALSPOOL_BENCH_CLI_ROWS`` changes the row count.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from report import record

import walspool

CLI_ROWS = int(os.environ.get("WALSPOOL_BENCH_CLI_ROWS", "1000000"))
SESSIONS = 500
GROUP = "cli, 1M rows" if CLI_ROWS == 1_000_000 else f"cli, {CLI_ROWS:,} rows"
CONTENT = "x" * 440
WALSPOOL = str(Path(sys.executable).parent / "walspool")


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """The spool and a state.db with its sessions (made once for the module)."""
    top = tmp_path_factory.mktemp("cli")
    path = top / "spool.db"
    with walspool.Spool(path, durability="normal") as spool:
        for lo in range(0, CLI_ROWS, 10_000):
            spool.append_many(
                [
                    (f"session-{i % SESSIONS:04d}", {"role": "user", "content": CONTENT, "n": i})
                    for i in range(lo, min(lo + 10_000, CLI_ROWS))
                ]
            )

        def mark(conn: Any) -> None:
            conn.execute(
                "UPDATE records SET attempts = 1, last_error = 'database is locked' "
                "WHERE id % 1000 = 0"
            )
            conn.execute("UPDATE records SET status = 'quarantined' WHERE id % 100000 = 1")

        spool.transact(mark)
    state = top / "state.db"
    hermes_state = pytest.importorskip("hermes_state")
    db = hermes_state.SessionDB(db_path=state)
    for s in range(SESSIONS):
        db.create_session(f"session-{s:04d}", "telegram")
    db.close()
    yield path, state


COMMANDS = {
    "version": ["--version", "{none}"],  # the interpreter's start and imports alone
    "stats": ["stats"],
    "ls": ["ls"],
    "show": ["show", "{spool}", "session-0007"],
    "export": ["export"],
    "check": ["check"],
    "replay_dry_run": ["replay", "{spool}", "--into", "{state}", "--dry-run"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_cli_command(benchmark: Any, big: tuple[Path, Path], command: str) -> None:
    spool, state = big
    argv = COMMANDS[command]
    if "{none}" in argv:
        args = argv[:-1]
    elif "{spool}" in argv:
        args = [a.format(spool=spool, state=state) for a in argv]
    else:
        args = [*argv, str(spool)]
    codes = []

    def run() -> None:
        done = subprocess.run(
            [WALSPOOL, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=1800
        )
        codes.append((done.returncode, done.stderr))

    started = time.perf_counter()
    benchmark.pedantic(run, rounds=1, iterations=1)
    rc, err = codes[0]
    # check finds the quarantined rows no problem; a dry run holds nothing
    assert rc in ((0, 3) if command == "replay_dry_run" else (0,)), err
    name = f"test_cli_{command}"
    record(name, GROUP, CLI_ROWS, benchmark.stats.stats.median)
    benchmark.extra_info["seconds"] = time.perf_counter() - started
    benchmark.extra_info["msgs_per_round"] = CLI_ROWS
