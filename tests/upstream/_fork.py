"""Helpers for the tests on the newer gateway (import as ``from _fork import ...``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _gateways_common import (  # noqa: F401 - shared
    TRANSIENT,
    break_db,
    heal_db,
    own_module,
)

#: One it treats as corruption (handle quarantined, every message diverted).
CORRUPT = "database disk image is malformed"


#: The fork's own ``gateway/shutdown_flush.py``, loaded under another name.
upstream_module = own_module


def new_store(home: Path) -> Any:
    from gateway.config import GatewayConfig
    from gateway.session import SessionStore

    return SessionStore(home / "sessions", GatewayConfig())


def close_store(store: Any) -> None:
    store.close_all_db_handles()
    from hermes_state_registry import release_or_close

    release_or_close(store._db)
