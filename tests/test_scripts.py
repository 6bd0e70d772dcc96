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
