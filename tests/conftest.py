"""Shared fixtures: a real spool in a temporary directory; each released gateway in
its own environment, and an empty ``HERMES_HOME`` for its processes."""

from __future__ import annotations

import os
from pathlib import Path

# Every look of a link's background thread, here and in the gateways the tests start,
# is checked against the whole table of sessions (``walspool.link.retry.CHECK_DUE``).
os.environ["WALSPOOL_CHECK_DUE"] = "1"

import pytest
from contract._gateways import GATEWAYS, IDS, Gateway, present

import walspool


@pytest.fixture(params=GATEWAYS, ids=IDS)
def gateway(request: pytest.FixtureRequest) -> Gateway:
    """Each released gateway in turn (``tests/contract/_gateways.py``)."""
    return present(request.param)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """An empty ``HERMES_HOME`` for a gateway's processes."""
    home = tmp_path / "hermes"
    home.mkdir()
    return home


@pytest.fixture
def spool_path(tmp_path: Path) -> Path:
    return tmp_path / "spool" / "spool.db"


@pytest.fixture
def spool(spool_path: Path):
    with walspool.Spool(spool_path) as s:
        yield s


@pytest.fixture
def hermes_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh HERMES_HOME; hermes_state's import-time default path points into it."""
    hermes_state = pytest.importorskip("hermes_state")
    home = tmp_path / "hermes"
    home.mkdir()
    monkeypatch.setenv("HERMES_HOME", str(home))
    monkeypatch.setattr(hermes_state, "DEFAULT_DB_PATH", home / "state.db")
    return home


@pytest.fixture
def store(hermes_home: Path):
    """A real hermes-agent 0.19.0 ``SessionStore`` (and its state.db) in ``hermes_home``."""
    from gateway.config import GatewayConfig
    from gateway.session import SessionStore

    s = SessionStore(hermes_home / "sessions", GatewayConfig(sessions_dir=hermes_home / "sessions"))
    yield s
    s._db.close()


@pytest.fixture
def session_db(tmp_path: Path):
    """A real hermes-agent 0.19.0 ``SessionDB`` on ``tmp_path / "state.db"``."""
    hermes_state = pytest.importorskip("hermes_state")
    db = hermes_state.SessionDB(db_path=tmp_path / "state.db")
    yield db
    db.close()
