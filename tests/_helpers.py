"""Helpers shared by the tests (import as ``from _helpers import ...``)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from walspool.store.records import Record

ROOT = Path(__file__).resolve().parent.parent

#: Bound on a test's wait for what happens promptly when the code is right (a stepped
#: thread reaching its next point, a background thread going idle): a wait that runs out
#: is the failure. scripts/mutate lowers it (WALSPOOL_TEST_STEP) so that a mutant that
#: breaks a step fails in seconds instead of timing out minutes later.
STEP = float(os.environ.get("WALSPOOL_TEST_STEP", "30"))
#: Bound on a test's reads of a child process's output (``child_deadline``): generous,
#: since a child starts an interpreter and may append thousands of rows first.
CHILD_DEADLINE = 120.0


def doc_section(title: str) -> str:
    """The text of the ``## title`` section of README.md or of a page in docs/, up to
    the next ``## `` heading; or of the page titled ``# title``, up to its first."""
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        start = 0 if text.startswith(f"# {title}\n") else text.find(f"\n## {title}\n")
        if start != -1:
            end = text.find("\n## ", start + 1)
            return text[start : end if end != -1 else len(text)]
    raise AssertionError(f"no section {title!r} in README.md or docs/")


def runbook_commands() -> list[str]:
    """README's incident runbook: its ``walspool`` command lines, comments cut, in order."""
    blocks = re.findall(r"```sh\n(.*?)```", doc_section("Incident runbook"), re.S)
    lines = [line.split("#", 1)[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith("walspool ")]


def run_runbook(
    env: dict[str, str], cwd: Path, session: str, timeout: float
) -> dict[str, subprocess.CompletedProcess[str]]:
    """Each command of README's runbook as written (``SESSION`` as ``session``), run by
    a shell in ``cwd`` with ``env``; what each did, by its line. ``watch`` is left out:
    it is interactive (tests/test_watch.py runs it on a terminal). None may be a usage
    error."""
    said = {}
    for command in runbook_commands():
        if command.startswith("walspool watch"):
            continue
        line = command.replace("SESSION", session)
        said[line] = subprocess.run(
            ["bash", "-c", line],
            env=env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        assert "usage:" not in said[line].stderr, (line, said[line].stderr)
    return said


def terminal_line(config: Any, line: str) -> None:
    """Write ``line`` to the terminal whatever pytest's capture setting (a summary a
    slow matrix prints: its counts belong in every run's output)."""
    capture = config.pluginmanager.get_plugin("capturemanager")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if capture is not None and reporter is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line("\n" + line)
    else:
        print(line)


def naming_threads(fn: Callable[..., Any], names: list[str]) -> Callable[..., Any]:
    """``fn``, wrapped to append the calling thread's name to ``names`` first (who
    wrote, who replayed)."""

    def named(*args: Any, **kw: Any) -> Any:
        names.append(threading.current_thread().name)
        return fn(*args, **kw)

    return named


@contextlib.contextmanager
def child_deadline(
    proc: subprocess.Popen[Any], seconds: float = CHILD_DEADLINE, what: str = "the child"
) -> Iterator[None]:
    """Kill ``proc`` if the block still runs ``seconds`` from now, and then fail.

    For a block that reads ``proc``'s output (``readline``, ``for line in proc.stdout``):
    a child that hangs, or never prints what the test waits for, would block the read
    and the whole run; killed, its output ends, the read returns, and the test fails
    with this error (the block's own error, if any, chained to it).
    """
    expired = threading.Event()

    def kill() -> None:
        expired.set()
        proc.kill()

    timer = threading.Timer(seconds, kill)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if expired.is_set():
            raise AssertionError(
                f"{what} (pid {proc.pid}) was killed: still running after {seconds:g} s"
            )


def run_python(code: str, *args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with walspool importable."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **kw.pop("env", {})}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        **kw,
    )


class MemorySink:
    """The ``walspool.Sink`` protocol over a list, refusing writes on demand.

    Like ``SessionDBSink`` it records each write's ticket with the row, so
    ``landed`` is exact.
    """

    def __init__(self) -> None:
        self.rows: list[tuple[str, Any]] = []
        self.tickets: set[tuple[str, int, int]] = set()
        self.refuse: Callable[[str, Record], Exception | None] = lambda sid, rec: None

    def write(self, session_id: str, record: Record, ticket: tuple[str, int, int]) -> None:
        error = self.refuse(session_id, record)
        if error is not None:
            raise error
        self.rows.append((session_id, record.message))
        self.tickets.add(ticket)

    def landed(self, tickets: list[tuple[str, int, int]]) -> set[tuple[str, int, int]]:
        return {t for t in tickets if t in self.tickets}

    def messages(self, session_id: str) -> list[Any]:
        return [m for s, m in self.rows if s == session_id]

    def contents(self, session_id: str) -> list[str]:
        return [m["content"] for m in self.messages(session_id)]


def descriptors_on(path: Path) -> list[str]:
    """This process's open files at ``path`` or beside it (its -wal, -shm, locks)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the descriptor listdir itself used, closed meanwhile
        if target.startswith(str(path)):
            found.append(target)
    return found


def read_spool(spool: Any, sql: str) -> list[tuple[Any, ...]]:
    """Read the spool file as an operator would, on a read-only connection of its own."""
    import apsw

    conn = apsw.Connection(str(spool.path), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()
