"""The built wheel, installed by pip into each released gateway's environment without
walspool, keeps the plugin's first promise: the gateway loads walspool from the
installed wheel, not from this clone."""

from __future__ import annotations

import dataclasses
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
#: Seconds for a ``pip`` install or uninstall (the index may be slow).
PIP_SECONDS = 600
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


@pytest.fixture
def fresh(gateway: Gateway, tmp_path: Path) -> Gateway:
    """The gateway's environment as its user has it before walspool: a copy (hard links,
    so it costs no disk) of the test environment with walspool, apsw and msgspec
    uninstalled (the released gateways need neither)."""
    copy = tmp_path / "env"
    subprocess.run(["cp", "-al", str(ROOT / gateway.venv), str(copy)], check=True)
    fresh = dataclasses.replace(gateway, venv=str(copy))
    python = str(fresh.python())
    done = subprocess.run(
        [python, "-m", "pip", "uninstall", "--yes", "walspool", "apsw", "msgspec"],
        capture_output=True,
        text=True,
        timeout=PIP_SECONDS,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    gone = subprocess.run(
        [python, "-c", "import walspool"], capture_output=True, text=True, cwd=tmp_path
    )
    assert "No module named 'walspool'" in gone.stderr, gone.stderr
    return fresh


def test_the_built_wheel_installed_by_pip_carries_an_outage_into_state_db(
    fresh: Gateway, home: Path, wheel: Path
) -> None:
    """The wheel installed with ``pip install`` into the gateway's environment without
    walspool, its dependencies resolved from the package index by the wheel's own
    metadata, the plugin enabled as README's step 2 says: the gateway loads walspool
    from the environment, and an outage past the cap lands once, in drop order."""
    pip = [str(fresh.python()), "-m", "pip", "install", "--disable-pip-version-check"]
    done = subprocess.run([*pip, str(wheel)], capture_output=True, text=True, timeout=PIP_SECONDS)
    assert done.returncode == 0, done.stdout + done.stderr
    configure(fresh, home, fresh.enable)
    after = "quiet" if fresh.how == plugin.LINK else "message"
    result = run_worker(fresh, home, "outage", str(BURST), after)

    installed = Path(fresh.venv) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    assert result["before"]["walspool_file"] == str(
        installed / "site-packages" / "walspool" / "__init__.py"
    )
    if fresh.how == plugin.LINK:
        assert result["before"]["store_linked"] is True
    else:
        assert result["before"]["shutdown_flush"] == "walspool.shutdown_flush"
    assert result["during"] == {"s1": 0, "s2": 0, "s3": 0}  # the outage was real
    for session, sent in result["sent"].items():
        assert result["landed"][session] == sent, session
    with walspool.Spool(home / "spool.db") as s:
        assert s.stats().rows == 0
