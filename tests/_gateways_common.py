"""What the tests on the newer gateways (0.20 in tests/axisrow, 0.22 in tests/upstream)
share: running a gateway worker process, killing it right after a state.db commit,
and reading the spool it left."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _lock_holder import write_lock_held

from walspool.store.files import REPLAY_LOCK_SUFFIX


def installed(distribution: str) -> bool:
    """Whether this environment has the gateway ``distribution`` (else a conftest
    collects nothing)."""
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def mark_folder(items: list[pytest.Item], folder: Path, marker: pytest.MarkDecorator) -> None:
    """Mark every test collected from ``folder`` (a conftest's collection hook)."""
    for item in items:
        if folder in Path(str(item.path)).resolve().parents:
            item.add_marker(marker)


def drop_in_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh HERMES_HOME with walspool's module in place of the gateway's."""
    import walspool.shutdown_flush as wsf

    home = tmp_path / "hermes"
    home.mkdir()
    monkeypatch.setenv("HERMES_HOME", str(home))
    monkeypatch.setitem(sys.modules, "gateway.shutdown_flush", wsf)
    yield home
    wsf.close_shared_spools()


#: A deterministic outage both newer gateways treat as transient (retry, spool, drain).
TRANSIENT = "walspool test outage"


def break_db(db: Any, message: str = TRANSIENT, session_id: str | None = None) -> None:
    """Make inserts into ``messages`` (of one session, or all) fail until ``heal_db``."""
    when = "" if session_id is None else f"WHEN new.session_id = '{session_id}' "
    with db._lock:
        db._conn.execute(
            f"CREATE TRIGGER walspool_test_broken BEFORE INSERT ON messages {when}"
            f"BEGIN SELECT RAISE(ABORT, '{message}'); END"
        )


def heal_db(db: Any) -> None:
    with db._lock:
        db._conn.execute("DROP TRIGGER IF EXISTS walspool_test_broken")


def own_module() -> Any:
    """The gateway's own ``gateway/shutdown_flush.py``, loaded under another name."""
    import gateway

    path = Path(gateway.__file__).parent / "shutdown_flush.py"
    spec = importlib.util.spec_from_file_location("_gateways_own_shutdown_flush", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: Seconds any one worker step may take before the test fails (a bound, not a sleep).
STEP_TIMEOUT = 120.0


def run(worker: Path, home: Path, *args: object) -> str:
    """Run ``worker HOME ARGS...`` to its end; its stdout."""
    done = subprocess.run(
        [sys.executable, str(worker), str(home), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def run_and_kill(worker: Path, home: Path, *args: object) -> None:
    """Start the worker, wait for its LANDED line, SIGKILL it, reap it."""
    proc = subprocess.Popen(
        [sys.executable, str(worker), str(home), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + STEP_TIMEOUT
        assert proc.stdout is not None
        while True:
            left = deadline - time.monotonic()
            assert left > 0, "the worker never reached the kill point"
            ready, _, _ = select.select([proc.stdout], [], [], left)
            if not ready:
                continue
            line = proc.stdout.readline()
            assert line, f"the worker exited early: {proc.wait(5)} {proc.stderr.read()[-3000:]}"
            if line.startswith("LANDED"):
                break
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(STEP_TIMEOUT) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def line_of(out: str, prefix: str) -> str:
    """The rest of the one line of ``out`` that starts with ``prefix``."""
    (line,) = [ln for ln in out.splitlines() if ln.startswith(prefix)]
    return line[len(prefix) :]


def spool_rows(home: Path) -> int:
    import walspool

    with walspool.Spool(home / "spool.db") as spool:
        return spool.stats().rows


class DropInWaits:
    """The waits the drop-in can make a gateway thread (the thread that made this) start,
    as they start: which, its bound (None: unbounded but for the spool's busy bound),
    and whether the spool's writer had found its write lock held elsewhere by then.

    The places: a spool transaction on the caller's thread (``Writer.call``), a blocking
    put (``notify``, ``submit``), a wait for room, the drain's wait for earlier
    hand-offs (``shutdown_flush._probe``) and the replay lock (``replay_lock._exclusive``).
    """

    def __init__(self, spool: object, monkeypatch: object) -> None:
        import threading

        import walspool.shutdown_flush as wsf
        import walspool.store.replay_lock as replay_lock

        self.seen: list[tuple[str, float | None, bool]] = []
        self._thread = threading.current_thread()
        self._writer = spool._writer  # type: ignore[attr-defined]
        writer = self._writer
        # ``call`` within its ``within`` (0.22's hand-offs), else unbounded but for the
        # busy bound, as ``notify`` and ``submit``.
        self._wrap(monkeypatch, writer, "call", lambda request, within=None: within)
        for name in ("notify", "submit"):
            self._wrap(monkeypatch, writer, name, lambda *a, **k: None)
        self._wrap(monkeypatch, writer, "wait_for_room", lambda timeout, *a, **k: timeout)
        self._wrap(monkeypatch, wsf, "_probe", lambda spool, *, wait: wait)
        self._wrap(
            monkeypatch,
            replay_lock,
            "_exclusive",
            lambda path, wait=True, owner=None: 0.0 if wait is False else float(wait),
        )

    def _wrap(self, monkeypatch: object, owner: object, name: str, bound: object) -> None:
        original = getattr(owner, name)
        note = self._note

        def recorded(*args: object, **kw: object) -> object:
            note(name, bound(*args, **kw))  # type: ignore[operator]
            return original(*args, **kw)

        monkeypatch.setattr(owner, name, recorded)  # type: ignore[attr-defined]

    def _note(self, what: str, bound: float | None) -> None:
        import threading

        if threading.current_thread() is self._thread:
            self.seen.append((what, bound, self._writer.busy_since is not None))

    def once_found_locked(self) -> list[tuple[str, float | None]]:
        """The waits with a bound above zero started once the writer had found its write
        lock held elsewhere: none is allowed."""
        return [(w, b) for w, b, locked in self.seen if locked and (b is None or b > 0)]

    def before_found_locked(self) -> list[tuple[str, float | None]]:
        return [(w, b) for w, b, locked in self.seen if not locked]


#: A second process holding state.db's write lock from a line on stdin to the next (an
#: operator's ``sqlite3 state.db`` shell in a transaction, another process's VACUUM).
STATE_DB_HOLDER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], timeout=60, isolation_level=None)
sys.stdin.readline()
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.readline()
conn.execute("ROLLBACK")
"""
#: Bound on every wait for the replay or the holder (start, first row, lock, exit).
CHILD_TIMEOUT = 120.0


class RunningReplay:
    """A real ``walspool replay SPOOL --into STATE_DB`` process, held at its first write:
    it holds the spool's replay lock and another process holds state.db's write lock,
    so its write waits (hermes' own patience for a transcript write, 20 s or more)."""

    def __init__(self, replay: Any, holder: Any) -> None:
        self.replay = replay
        self.holder = holder

    def finish(self) -> tuple[int, dict[str, Any]]:
        """Let go of state.db; the replay's exit status and its ``--json`` report."""
        if self.holder.poll() is None:
            self.holder.stdin.write("go\n")
            self.holder.stdin.flush()
            self.holder.wait(CHILD_TIMEOUT)
        out, err = self.replay.communicate(timeout=CHILD_TIMEOUT)
        assert out, err[-3000:]
        return self.replay.returncode, json.loads(out)


@contextlib.contextmanager
def replay_running(home: Path) -> Iterator[RunningReplay]:
    """``walspool replay <home>/spool.db --into <home>/state.db`` running in another
    process, held at its first write by a state.db lock.

    No race decides where it stops: the spool's write lock is held (by another process)
    from before the replay starts, so the replay, once it holds its replay lock, waits
    at its first spool write (the stamp of its first batch, before any state.db write);
    state.db's write lock is taken only then, and the spool's let go."""
    spool_db, state_db = home / "spool.db", home / "state.db"
    holder = subprocess.Popen(
        [sys.executable, "-c", STATE_DB_HOLDER, str(state_db)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    replay = None
    try:
        with write_lock_held(spool_db) as spool_lock:
            replay = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "walspool",
                    "replay",
                    str(spool_db),
                    "--into",
                    str(state_db),
                    "--json",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "HERMES_HOME": str(home)},
            )
            _wait_for_replay_lock(replay, Path(f"{spool_db}{REPLAY_LOCK_SUFFIX}"))
            assert holder.stdin is not None and holder.stdout is not None
            holder.stdin.write("lock\n")
            holder.stdin.flush()
            assert holder.stdout.readline() == "locked\n"
            spool_lock.release()
        yield RunningReplay(replay, holder)
    finally:
        for proc in (holder, replay):
            if proc is not None:
                if proc.poll() is None:
                    proc.kill()
                proc.communicate(timeout=CHILD_TIMEOUT)


def _wait_for_replay_lock(replay: Any, lock: Path) -> None:
    """Wait until ``replay`` holds the spool's replay lock (walspool writes the holder's
    pid into the lock file once it holds it)."""
    deadline = time.monotonic() + CHILD_TIMEOUT
    while not (lock.exists() and lock.read_text().strip() == str(replay.pid)):
        if replay.poll() is not None:
            out, err = replay.communicate(timeout=CHILD_TIMEOUT)
            raise AssertionError(f"the replay exited early ({replay.returncode}): {err[-3000:]}")
        assert time.monotonic() < deadline, "the replay never took its replay lock"
        time.sleep(0.01)


def start_beside(
    replay: RunningReplay, start: Callable[[], Any], bound: float
) -> tuple[float, list[Any], int, dict[str, Any]]:
    """Run a gateway's ``start`` on a thread while ``replay`` is held in the middle of
    its rows: how long the start took (up to ``bound``, then it is left running), what
    it returned, then (the replay let go) the replay's exit status and report."""
    returned: list[Any] = []
    thread = threading.Thread(target=lambda: returned.append(start()))
    began = time.monotonic()
    thread.start()
    thread.join(bound)
    took = time.monotonic() - began
    status, report = replay.finish()  # let go of state.db in any case
    thread.join(CHILD_TIMEOUT)
    return took, returned, status, report


# -- docs/gateway.md's drop-in snippet, run as printed -----------------------------------

#: The process that runs the gateway: the snippet first, as printed, in a namespace of
#: its own; then the gateway as it starts (its run module), each import statement of
#: the module in the gateway's source, run as written, and an outage of its real store
#: (its cap evictions call the module). What it found goes to the file OUT.
GATEWAY = r"""
import json, logging, os, pathlib, re, sys
logging.disable(logging.WARNING)  # the outage's lines; a traceback still shows
snippet, out, folder = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3]
exec(compile(snippet, "docs/gateway.md", "exec"), {"__name__": "__main__"})

import gateway.run
import gateway.shutdown_flush as imported

root = pathlib.Path(gateway.__file__).parent
found = {}
for path in sorted(root.rglob("*.py")):
    if path.name == "shutdown_flush.py":
        continue
    text = path.read_text(encoding="utf-8")
    for statement in re.findall(r"from gateway\.shutdown_flush import (?:\([^)]*\)|[^\n]+)", text):
        names = {}
        exec(statement, names)
        for name, value in names.items():
            if name != "__builtins__" and callable(value):
                found[f"{path.relative_to(root)}: {name}"] = value.__module__

sys.path[:0] = [folder, str(pathlib.Path(folder).parent)]
fork = __import__(sys.argv[4])  # the fork's store module, in the test's folder
TRANSIENT, break_db, new_store = fork.TRANSIENT, fork.break_db, fork.new_store

store = new_store(pathlib.Path(os.environ["HERMES_HOME"]))
store._db.create_session("s1", "telegram")
break_db(store._db, TRANSIENT)
for i in range(230):
    store.append_to_transcript("s1", {"role": "user", "content": f"m{i}"})
import walspool.shutdown_flush
walspool.shutdown_flush.close_shared_spools()
out.write_text(json.dumps({"module": imported.__name__, "imports": found}))
"""


def run_drop_in_snippet(tmp_path: Path, folder: Path, store_module: str) -> tuple[dict, list, Path]:
    """Run docs/gateway.md's drop-in snippet as printed first in a fresh gateway process
    (``GATEWAY``; the fork's store from ``store_module`` in ``folder``), then an outage
    of 230 messages on that store: what ``gateway.shutdown_flush`` and the gateway's own
    imports of it gave (``{"module", "imports"}``), the contents spooled for the
    session, and the gateway's home."""
    import re

    from _helpers import ROOT, doc_section

    import walspool

    (snippet,) = re.findall(r"```python\n(.*?)```", doc_section("Newer gateways (0.20+)"), re.S)
    home = tmp_path / "hermes"
    home.mkdir()
    out = tmp_path / "found.json"
    done = subprocess.run(
        [sys.executable, "-c", GATEWAY, snippet, str(out), str(folder), store_module],
        env={**os.environ, "HOME": str(tmp_path), "HERMES_HOME": str(home)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with walspool.Spool(home / "spool.db") as spool:
        spooled = [r.message["content"] for r in spool.records(session_id="s1")]
    return json.loads(out.read_text()), spooled, home
