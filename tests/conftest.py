"""Shared fixtures: a real spool in a temporary directory."""

from __future__ import annotations

from pathlib import Path

import pytest

import walspool


@pytest.fixture
def spool_path(tmp_path: Path) -> Path:
    return tmp_path / "spool" / "spool.db"


@pytest.fixture
def spool(spool_path: Path):
    with walspool.Spool(spool_path) as s:
        yield s
