"""Drop-in replacements for upstream ``gateway/shutdown_flush.py``, backed by the spool.

Same names, signatures and return values as the newer upstream module, which keeps
one JSON file per message under ``<HERMES_HOME>/pending_messages``; these keep one
row per message in ``<HERMES_HOME>/spool.db``. ``HERMES_HOME`` is resolved at each
call through ``hermes_constants.get_hermes_home()`` when hermes-agent is installed
(so profile homes and per-task overrides apply), else from the environment.

Like upstream, none of these raise for a spool problem: they log it and report
failure through their return value.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .errors import InvalidArgument
from .hermes import agent_history_message, slot_message
from .records import AGENT_HISTORY, CAP_DROP, Record
from .replay import Replayer
from .sinks import SessionDBSink, Ticket
from .spool import Spool

log = logging.getLogger("walspool.shutdown_flush")

SPOOL_NAME = "spool.db"
_spools: dict[Path, Spool] = {}
_spools_lock = threading.Lock()


def spool_path() -> Path:
    """``<HERMES_HOME>/spool.db`` for the home in force now."""
    try:
        from hermes_constants import get_hermes_home
    except ImportError:
        home = Path(os.environ.get("HERMES_HOME") or Path.home() / ".hermes")
    else:
        home = Path(get_hermes_home())
    return home / SPOOL_NAME


def shared_spool() -> Spool:
    """The process's spool for the current home; opened once, kept open."""
    path = spool_path()
    with _spools_lock:
        spool = _spools.get(path)
        if spool is None:
            spool = _spools[path] = Spool(path)
        return spool


def close_shared_spools() -> None:
    """Close every spool opened by these functions (for tests and clean exits)."""
    with _spools_lock:
        for spool in _spools.values():
            spool.close()
        _spools.clear()


def spool_dropped_transcript_message(session_id: str, message: dict[str, Any]) -> Path | None:
    """Spool a message the transcript queue evicted at its cap.

    Returns the spool's path once the row is committed, or None when it could not
    be spooled (the caller then drops the message and warns, as before).
    """
    try:
        spool = shared_spool()
        spool.append(session_id, message, reason=CAP_DROP)
    except Exception as exc:  # noqa: BLE001 - the caller drops and warns, as upstream
        log.debug("Failed to spool cap-dropped transcript message for %s: %s", session_id, exc)
        return None
    return spool.path


def drain_transcript_spool(
    session_id: str,
    replay: Callable[[dict[str, Any]], Any],
    *,
    db_known_failing: bool = False,
) -> tuple[int, int]:
    """Replay one session's cap-dropped messages through ``replay``, in drop order.

    Each row is removed only after ``replay(message)`` returned; the first failure
    stops the drain and keeps that row and the later ones, but a message refused for
    its content is quarantined (kept, for an operator) and the drain goes on.
    Returns ``(replayed, remaining)``. ``replay`` cannot be asked what already
    landed, so a message whose process was killed between its ``replay`` call and
    its row's removal is quarantined at the next drain rather than written twice.
    """
    try:
        spool = shared_spool()
    except Exception as exc:  # noqa: BLE001 - no spool: nothing can be drained from it
        log.warning("Cannot open the transcript spool to drain %s: %s", session_id, exc)
        return 0, 0
    try:
        report = Replayer(spool, _CallbackSink(replay)).replay(
            session_id=session_id, reasons=[CAP_DROP]
        )
    except InvalidArgument:  # an id the spool cannot hold has no rows in it
        return 0, 0
    except Exception as exc:  # noqa: BLE001 - rows may remain: say so, never raise
        log.warning("Cannot drain the transcript spool for %s: %s", session_id, exc)
        return 0, 1
    if report.held:
        level = logging.DEBUG if db_known_failing else logging.WARNING
        log.log(
            level,
            "Replay of spooled transcript message for %s failed; keeping %d row(s) in %s for "
            "retry: %s",
            session_id,
            report.held,
            spool.path,
            report.errors.get(session_id),
        )
    elif report.moved:
        log.info(
            "Replayed %d spooled transcript message(s) for %s after DB recovery",
            report.moved,
            session_id,
        )
    return report.moved, report.held


def flush_pending_to_file(pending: Mapping[str, Any], *, reason: str = "shutdown") -> int:
    """Spool pending slots (session key -> text or event); return how many were spooled."""
    items = [
        (_attribute(value, "session_id"), slot_message(value), key)
        for key, value in list(pending.items())
        if value is not None
    ]
    if not items:
        return 0
    try:
        spool = shared_spool()
        spool.append_many(items, reason=reason)
        flushed = len(items)
    except Exception:  # noqa: BLE001 - one by one, so one bad slot loses only itself
        flushed = sum(_flush_one(item, reason) for item in items)
    if flushed:
        log.info("Flushed %d pending message(s) to %s (reason=%s)", flushed, spool_path(), reason)
    return flushed


def _flush_one(item: tuple[Any, Any, str], reason: str) -> bool:
    """Spool one slot on its own, so one bad slot cannot lose the others."""
    session_id, message, key = item
    try:
        shared_spool().append(
            session_id if isinstance(session_id, str) and session_id else None,
            message,
            reason=reason,
            session_key=key,
        )
    except Exception as exc:  # noqa: BLE001 - never raises, as upstream
        log.debug("Failed to flush pending message for %r: %s", key, exc)
        return False
    return True


def recover_pending_to_db(
    session_db: Any = None,
    *,
    session_resolver: Callable[..., Any] | None = None,
) -> int:
    """Replay every spooled message but agent histories into ``state.db``; return how many.

    ``session_db`` defaults to a ``hermes_state.SessionDB()`` opened here and closed
    before returning, also when an exception escapes. ``session_resolver(key)``
    maps a routing key to a session id (a ``(session_id, db)`` pair is accepted too;
    its first item is used). A failed session holds back its own later rows;
    other sessions go on.
    """
    owned = session_db is None
    if owned:
        from hermes_state import SessionDB

        session_db = SessionDB()
    try:
        spool = shared_spool()
        report = Replayer(
            spool,
            SessionDBSink(session_db),
            resolver=None if session_resolver is None else _session_id_of(session_resolver),
        ).replay()
    except Exception as exc:  # noqa: BLE001 - never raises, as upstream
        log.warning("Failed to recover pending messages: %s", exc)
        return 0
    finally:
        if owned:
            session_db.close()
    if report.held:
        log.info(
            "Held back %d spooled message(s) for the next start after a failed replay: %s",
            report.held,
            ", ".join(f"{k} ({v})" for k, v in report.errors.items()),
        )
    if report.moved:
        log.info("Recovered %d pending message(s) from %s", report.moved, spool.path)
    return report.moved


def flush_agent_history_to_file(session_id: str | None, history: list[Any]) -> None:
    """Spool an agent's in-memory history for operator recovery; never raises."""
    if not history:
        return
    try:
        shared_spool().append(
            session_id or "unknown",
            agent_history_message(session_id, history),
            reason=AGENT_HISTORY,
        )
    except Exception as exc:  # noqa: BLE001 - shutdown must go on
        log.warning(
            "Agent-history shutdown preservation failed for session %s: %s", session_id, exc
        )
        return
    log.warning(
        "Preserved %d in-memory message(s) for session %s (possible FTS corruption - recover "
        "after repairing state.db)",
        len(history),
        session_id,
    )


class _CallbackSink:
    """A sink that hands each message to a callable; it cannot look tickets up.

    So a raise of ``replay`` is trusted to mean nothing was written, and a row a
    killed process left in flight is quarantined rather than replayed twice.
    """

    def __init__(self, replay: Callable[[dict[str, Any]], Any]) -> None:
        self.replay = replay

    def write(self, session_id: str, record: Record, ticket: Ticket) -> None:
        self.replay(record.message)

    def landed(self, tickets: Sequence[Ticket]) -> None:
        return None


def _session_id_of(resolver: Callable[..., Any]) -> Callable[[str], str | None]:
    def resolve(session_key: str) -> str | None:
        found = resolver(session_key)
        return found[0] if isinstance(found, tuple) else found

    return resolve


def _attribute(value: Any, name: str) -> Any:
    if isinstance(value, Mapping):
        return value.get(name)
    return getattr(value, name, None)
