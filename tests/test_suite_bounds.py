"""The suite itself: a test that waits forever fails instead of hanging the run."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from _helpers import ROOT

HANGS = """
import subprocess, sys

def test_reads_a_child_that_never_writes():
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(3600)"], stdout=subprocess.PIPE
    )
    try:
        child.stdout.readline()  # blocks: the child never writes
    finally:
        child.kill()
"""


def test_a_test_blocked_on_a_child_fails_at_the_per_test_timeout(tmp_path: Path) -> None:
    test = tmp_path / "test_hangs.py"
    test.write_text(HANGS)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "-o", "timeout=2"]
        + ["-p", "no:cacheprovider", "-q", str(test)],
        capture_output=True,
        text=True,
        timeout=300,  # far above the 2 s: the run ended because of the timeout
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Timeout" in done.stdout
    assert "1 failed" in done.stdout


def test_the_suite_has_a_per_test_timeout() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["tool"]["pytest"]["ini_options"]["timeout"] > 0
    assert any(
        d.startswith("pytest-timeout") for d in config["project"]["optional-dependencies"]["test"]
    )
