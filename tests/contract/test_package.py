"""README's install steps, run as printed in a new environment of each released gateway
(nothing but the gateway installed, as its user has it before walspool): step 1 from the
directory that holds a clone, then the wheel built in the clone; each time the gateway
loads walspool from that environment, and an outage carries through it."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _helpers import ROOT

import walspool
from walspool import plugin

from ._gateways import Gateway, configure, run_worker

#: Seconds for a ``pip`` install or a build (the index may be slow).
PIP_SECONDS = 600
#: Messages sent to each of three sessions during the outage: past the 200 cap.
BURST = 450


def readme_install() -> tuple[str, set[str], str, str]:
    """README's "Install into a gateway": step 1 (one for every gateway), the gateways'
    requirements, the wheel's build command and the wheel it makes."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Install into a gateway") : text.index("## Quick start")]
    rows = re.findall(r"^\| `([^`]+)` \| `([^`]+)` \| `(.+)` \|$", section, re.M)
    (step1,) = {step1 for _, step1, _ in rows}
    build = re.search(r"in the clone \(`([^`]+)`\)", " ".join(section.split()))
    wheel = re.search(r"install `(dist/[^`]+\.whl)`", section)
    assert build is not None and wheel is not None, "README's wheel lines moved"
    return step1, {requirement for requirement, _, _ in rows}, build[1], wheel[1]


STEP1, REQUIREMENTS, BUILD, WHEEL = readme_install()


def run(argv: list[str] | str, cwd: Path, path: Path, shell: bool = False) -> str:
    """A command as its user types it, with ``path`` (an environment's ``bin``) first on
    PATH, as in that environment activated; its output, after it succeeded."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{path}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(
        argv,
        cwd=cwd,
        env=env,
        shell=shell,
        capture_output=True,
        text=True,
        timeout=PIP_SECONDS,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, f"{argv}:\n{done.stdout}{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A clone of this repository, named ``walspool``, with its wheel built as README
    prints it (``python -m`` of this test's environment)."""
    place = tmp_path_factory.mktemp("clone") / "walspool"
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    for name in tracked.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (place / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, place / name)
    run(BUILD, place, Path(sys.executable).parent, shell=True)
    assert (place / WHEEL).is_file(), sorted(p.name for p in (place / "dist").iterdir())
    yield place


@pytest.fixture
def new_env(gateway: Gateway, tmp_path: Path) -> Gateway:
    """A new environment with the gateway alone, installed from the index as README's
    first column names it."""
    venv = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=PIP_SECONDS)
    requirement = gateway.name.replace(" ", "==")
    assert requirement in REQUIREMENTS
    run(["pip", "install", "--disable-pip-version-check", requirement], tmp_path, venv / "bin")
    return dataclasses.replace(gateway, venv=str(venv))


def where_walspool(gateway: Gateway, cwd: Path) -> str:
    """The file ``import walspool`` loads in the environment, and its plugin entry."""
    check = (
        "import importlib.metadata as m, walspool; "
        "print(walspool.__file__); "
        "print([e.value for e in m.entry_points(group='hermes_agent.plugins')])"
    )
    return run([str(gateway.python()), "-c", check], cwd, Path(gateway.venv) / "bin")


def test_readmes_install_steps_as_printed_carry_an_outage_into_state_db(
    new_env: Gateway, home: Path, clone: Path
) -> None:
    """Step 1 as printed, from the directory that holds the clone: walspool, its
    dependencies resolved from the index, lands in the environment's site-packages with
    its plugin entry point. Then, walspool uninstalled, the built wheel as printed, and
    step 2 as printed: the gateway loads walspool from the environment, and an outage
    past the cap lands once, in drop order."""
    bin_dir = Path(new_env.venv) / "bin"
    site = (
        Path(new_env.venv)
        / "lib"
        / f"python{sys.version_info[0]}.{sys.version_info[1]}"
        / "site-packages"
    )
    installed = str(site / "walspool" / "__init__.py")
    missing = subprocess.run(
        [str(new_env.python()), "-c", "import walspool"],
        capture_output=True,
        text=True,
        cwd=home.parent,
    )
    assert "No module named 'walspool'" in missing.stderr, missing.stderr

    run(shlex.split(STEP1), clone.parent, bin_dir)
    assert where_walspool(new_env, home.parent).splitlines() == [installed, "['walspool.plugin']"]

    run(["pip", "uninstall", "--yes", "walspool"], clone, bin_dir)
    run(["pip", "install", WHEEL], clone, bin_dir)
    configure(new_env, home, new_env.enable)
    after = "quiet" if new_env.how == plugin.LINK else "message"
    result = run_worker(new_env, home, "outage", str(BURST), after)

    assert result["before"]["walspool_file"] == installed
    if new_env.how == plugin.LINK:
        assert result["before"]["store_linked"] is True
    else:
        assert result["before"]["shutdown_flush"] == "walspool.shutdown_flush"
    assert result["during"] == {"s1": 0, "s2": 0, "s3": 0}  # the outage was real
    for session, sent in result["sent"].items():
        assert result["landed"][session] == sent, session
    with walspool.Spool(home / "spool.db") as s:
        assert s.stats().rows == 0
