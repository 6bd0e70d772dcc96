"""Helpers shared by the tests (import as ``from _helpers import ...``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
