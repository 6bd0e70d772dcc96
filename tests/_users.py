"""Running as another user, for the tests of who may own and read a spool.

Those tests need root (to hand files to other users and switch to them with
``setpriv``); ``as_root`` skips them elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from _helpers import ROOT

NOBODY = 65534
DAEMON = 1
SETPRIV = shutil.which("setpriv")

as_root = pytest.mark.skipif(
    os.geteuid() != 0 or SETPRIV is None, reason="needs root and setpriv to switch users"
)


@contextlib.contextmanager
def shared_directory(prefix: str, mode: int) -> Iterator[Path]:
    """A directory under /tmp that other users can reach (pytest's own tmp_path is
    root's, 0700), removed afterwards."""
    top = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(top, mode)
    try:
        yield top
    finally:
        shutil.rmtree(top, ignore_errors=True)


def run_as(uid: int, *argv: object) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as ``uid`` (and its group, no others), importing this checkout."""
    assert SETPRIV is not None
    return subprocess.run(
        [SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HOME": "/nonexistent"},
    )


def walspool_as(uid: int, *argv: object) -> subprocess.CompletedProcess[str]:
    """``python -m walspool ARGV`` as ``uid``."""
    return run_as(uid, sys.executable, "-m", "walspool", *argv)


def python_as(uid: int, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter as ``uid``."""
    return run_as(uid, sys.executable, "-c", code, *args)
