"""Helpers for the tests on the newer gateway (import as ``from _fork import ...``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _gateways_common import own_module

#: A deterministic outage the fork treats as transient (retry, spool, drain).
TRANSIENT = "walspool test outage"
#: One it treats as corruption (handle quarantined, every message diverted).
CORRUPT = "database disk image is malformed"


#: The fork's own ``gateway/shutdown_flush.py``, loaded under another name.
upstream_module = own_module


def break_db(db: Any, message: str = TRANSIENT, session_id: str | None = None) -> None:
    """Make inserts into ``messages`` (of one session, or all) fail until ``heal_db``."""
    when = "" if session_id is None else f"WHEN new.session_id = '{session_id}' "
    with db._lock:
        db._conn.execute(
            f"CREATE TRIGGER walspool_test_broken BEFORE INSERT ON messages {when}"
            f"BEGIN SELECT RAISE(ABORT, '{message}'); END"
        )


def heal_db(db: Any) -> None:
    with db._lock:
        db._conn.execute("DROP TRIGGER IF EXISTS walspool_test_broken")


def new_store(home: Path) -> Any:
    from gateway.config import GatewayConfig
    from gateway.session import SessionStore

    return SessionStore(home / "sessions", GatewayConfig())


def close_store(store: Any) -> None:
    store.close_all_db_handles()
    from hermes_state_registry import release_or_close

    release_or_close(store._db)
