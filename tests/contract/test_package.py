"""The built wheel, installed alone, keeps the plugin's first promise on each released
gateway: the gateway loads walspool from the wheel's files, not from this clone."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _helpers import ROOT

import walspool
from walspool import plugin

from ._gateways import Gateway, configure, run_worker

#: Seconds for ``python -m build`` (an isolated environment for setuptools first).
BUILD_SECONDS = 600
#: Messages sent to each of three sessions during the outage: past the 200 cap.
BURST = 450


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """walspool's wheel, built by ``python -m build`` from its sdist."""
    dist = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=BUILD_SECONDS,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (built,) = dist.glob("walspool-*-py3-none-any.whl")
    yield built


def test_the_built_wheel_carries_an_outage_into_state_db(
    gateway: Gateway, home: Path, wheel: Path
) -> None:
    """The wheel installed with ``pip --no-deps`` into a directory first on the gateway's
    path, the plugin enabled as README's step 2 says: the gateway loads walspool from
    that directory, and an outage past the cap lands once, in drop order."""
    target = home.parent / "installed"
    pip = [str(gateway.python()), "-m", "pip", "install", "--no-deps", "--no-index"]
    done = subprocess.run([*pip, "--target", str(target), str(wheel)], capture_output=True)
    assert done.returncode == 0, done.stderr
    configure(gateway, home, gateway.enable)
    after = "quiet" if gateway.how == plugin.LINK else "message"
    result = run_worker(gateway, home, "outage", str(BURST), after, PYTHONPATH=str(target))

    assert result["before"]["walspool_file"] == str(target / "walspool" / "__init__.py")
    if gateway.how == plugin.LINK:
        assert result["before"]["store_linked"] is True
    else:
        assert result["before"]["shutdown_flush"] == "walspool.shutdown_flush"
    assert result["during"] == {"s1": 0, "s2": 0, "s3": 0}  # the outage was real
    for session, sent in result["sent"].items():
        assert result["landed"][session] == sent, session
    with walspool.Spool(home / "spool.db") as s:
        assert s.stats().rows == 0
