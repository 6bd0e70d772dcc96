"""Shared fixtures: a real spool in a temporary directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import walspool

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def spool_path(tmp_path: Path) -> Path:
    return tmp_path / "spool" / "spool.db"


@pytest.fixture
def spool(spool_path: Path):
    with walspool.Spool(spool_path) as s:
        yield s


def run_python(code: str, *args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with walspool importable."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **kw.pop("env", {})}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        **kw,
    )
