"""hermes-agent 0.19.0's adapter: walspool as the overflow and shutdown sink of its
``SessionStore`` and ``GatewayRunner``, and the gateway link's public face.

In the released gateway, ``SessionStore.append_to_transcript`` queues each message per
session, drops the oldest past 200 while ``state.db`` refuses writes, and the runner and
adapters clear their pending slots at shutdown. ``install`` links one live store to a
spool; ``install_runner`` hooks one runner's stop. What changes is exactly that: an
eviction at the cap is spooled, not dropped; a session's spooled rows are written
before its in-memory ones; a live message ``state.db`` refuses for its content is set
aside, quarantined, and its session goes on; a rewrite supersedes the session's spooled
rows; a stop spools the in-memory queues and pending slots, which the next ``install``
replays in the background. docs/gateway.md states each promise, every wait a gateway
thread can meet because of walspool with its bound (the names below, from
``walspool.link.bounds``), the self-healing schedule, the logs, and what is not
guaranteed.

The behaviour itself is the gateway-neutral link (``walspool.link``: a pure
per-session machine in a thin shell that holds the store's lock, performs the
machine's steps and logs after unlocking). This module only checks that the store and
the runner have the 0.19.0 internals it relies on (``UnsupportedGateway`` otherwise),
maps the store onto the link's ``Transcripts`` (``walspool.gateways.session_store``),
replaces the store's ``append_to_transcript`` and ``_clear_dirty_transcript``, and
hooks the runner's ``stop``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from .errors import InvalidArgument, UnsupportedGateway
from .gateways.session_store import StoreTranscripts
from .link import budget, shares
from .link.bounds import (
    BUSY_LOOK_SECONDS,
    CONFIRM_WAIT,
    DRAIN_CHUNK_ROWS,
    FLUSH_TIMEOUT,
    GATEWAY_DRAIN_ROWS,
    HANDOFF_WAIT,
    IDLE_WAKE_SECONDS,
    MIN_RETRY_SECONDS,
    RETRY_STEPS,
)
from .link.evict import REJECTED
from .link.link import RETRY_INTERVAL, Link
from .link.shutdown import never_raise
from .store.records import SHUTDOWN, agent_history_message, slot_message
from .store.spool import Spool

__all__ = [
    "BUSY_LOOK_SECONDS",
    "CONFIRM_WAIT",
    "DRAIN_CHUNK_ROWS",
    "FLUSH_TIMEOUT",
    "GATEWAY_DRAIN_ROWS",
    "HANDOFF_WAIT",
    "IDLE_WAKE_SECONDS",
    "MIN_RETRY_SECONDS",
    "REJECTED",
    "RETRY_INTERVAL",
    "RETRY_STEPS",
    "RUNNER_ATTRIBUTES",
    "STORE_ATTRIBUTES",
    "Link",
    "SpoolOnClear",
    "agent_history_message",
    "install",
    "install_runner",
    "slot_message",
]

#: What 0.19.0's SessionStore must have for the link to be correct.
STORE_ATTRIBUTES = (
    "_db",
    "_transcript_retry_lock",
    "_dirty_transcripts",
    "_transcript_append_failures",
    "_append_transcript_message",
    "_clear_dirty_transcript",
    "_MAX_PENDING_PER_SESSION",
    "_is_fts_corruption_error",
    "_rebuild_fts_once",
    "peek_session_id",
    "append_to_transcript",
)


def install(
    store: Any,
    spool: Spool,
    *,
    recover: bool = True,
    retry_interval: float = RETRY_INTERVAL,
    max_bytes: int | None = budget.DEFAULT_MAX_BYTES,
) -> Link:
    """Link a live 0.19.0 ``SessionStore`` to ``spool``; replay what is spooled.

    Returns at once: the replay of what earlier runs spooled (``recover=True``) runs
    on the link's background thread, and each session writes its spooled rows before
    its live ones. ``retry_interval`` caps a failing session's retry delay (see the
    module docstring); 0 retries on every message and starts no background retries.
    ``max_bytes`` caps what evictions may fill, with room kept for quiet sessions
    (``walspool.link.budget``; default 4 GiB, None for no cap). ``link.wait_idle(timeout)``
    waits for the recovery and every session's work.

    Raises ``UnsupportedGateway`` at once if the store is not what the link was
    written for, rather than misbehaving later.
    """
    missing = [name for name in STORE_ATTRIBUTES if not hasattr(store, name)]
    if missing:
        raise UnsupportedGateway(
            f"{type(store).__name__} lacks {', '.join(missing)}; walspool.hermes supports "
            "hermes-agent 0.19.0's gateway.session.SessionStore",
            path=spool.path,
        )
    if not (
        isinstance(retry_interval, (int, float))
        and not isinstance(retry_interval, bool)
        and math.isfinite(retry_interval)
    ):
        raise InvalidArgument(
            f"retry_interval must be a finite number of seconds, not {retry_interval!r}",
            path=spool.path,
        )
    if isinstance(getattr(store.append_to_transcript, "__self__", None), Link):
        raise UnsupportedGateway("this SessionStore is linked to a spool already", path=spool.path)
    if store._db is None:
        raise UnsupportedGateway(
            "the SessionStore has no state.db (store._db is None)", path=spool.path
        )
    link = Link(StoreTranscripts(store), spool, retry_interval, max_bytes)
    if max_bytes is not None:
        spool.track_footprint()
    recovery = recover and not _nothing_to_replay(spool)
    # Each session's share of the cap counts its rows from earlier runs: the background
    # thread counts them (``Link.count_shares``), unless there are none.
    count = max_bytes is not None and not shares.empty(spool)
    store.append_to_transcript = link.append_to_transcript
    store._clear_dirty_transcript = link.clear_dirty_transcript
    link.start(recover=recover, recovery=recovery, count=count)
    return link


#: What 0.19.0's GatewayRunner must have for ``install_runner``.
RUNNER_ATTRIBUTES = (
    "session_store",
    "adapters",
    "_pending_messages",
    "_queued_events",
    "_bounded_adapter_teardown",
    "_finalize_shutdown_agents",
)


def install_runner(runner: Any, link: Any) -> None:
    """Spool a 0.19.0 ``GatewayRunner``'s pending slots and unflushed histories at shutdown."""
    missing = [name for name in RUNNER_ATTRIBUTES if not hasattr(runner, name)]
    if missing:
        raise UnsupportedGateway(
            f"{type(runner).__name__} lacks {', '.join(missing)}; walspool.hermes supports "
            "hermes-agent 0.19.0's gateway.run.GatewayRunner",
            path=link.spool.path,
        )

    def runner_cleared(slots: dict[str, Any]) -> None:
        # GatewayRunner.stop() clears its own slots after tearing the adapters down,
        # so the /queue overflow (each key's tail, after the adapter slot that holds
        # its head) is spooled here, after them, and what was queued since, last.
        never_raise(link.flush_pending, slots, reason=SHUTDOWN)
        queued = runner._queued_events or {}  # checked above: 0.19.0 has it
        overflow = [(key, event) for key, events in list(queued.items()) for event in events]
        never_raise(link.flush_slots, overflow, reason="overflow_shutdown")
        never_raise(link.flush_queues)
        # The runner closes SessionDB next: no background retry may write into it.
        never_raise(link.close)

    runner._pending_messages = SpoolOnClear(runner._pending_messages, runner_cleared)
    teardown = runner._bounded_adapter_teardown
    finalize = runner._finalize_shutdown_agents

    async def bounded_adapter_teardown(adapter: Any, platform: Any, **kw: Any) -> None:
        slots = getattr(adapter, "_pending_messages", None)
        if isinstance(slots, dict) and not isinstance(slots, SpoolOnClear):
            adapter._pending_messages = SpoolOnClear(
                slots, partial(link.flush_pending, reason="adapter_shutdown")
            )
        await teardown(adapter, platform, **kw)

    async def finalize_shutdown_agents(active_agents: dict[str, Any]) -> None:
        await finalize(active_agents)
        for agent in list(active_agents.values()):
            history = getattr(agent, "_session_messages", None)
            if isinstance(history, list):
                unsaved = [m for m in history if isinstance(m, dict) and not m.get("_db_persisted")]
                never_raise(link.flush_agent_history, getattr(agent, "session_id", None), unsaved)

    runner._bounded_adapter_teardown = bounded_adapter_teardown
    runner._finalize_shutdown_agents = finalize_shutdown_agents


class SpoolOnClear(dict):  # type: ignore[type-arg]
    """A pending-slot dict whose ``clear()`` hands its contents to ``on_clear`` first."""

    def __init__(self, items: Mapping[str, Any], on_clear: Callable[[dict[str, Any]], Any]) -> None:
        super().__init__(items)
        self._on_clear = on_clear

    def clear(self) -> None:
        never_raise(self._on_clear, dict(self))
        super().clear()


def _nothing_to_replay(spool: Spool) -> bool:
    """True when the spool surely holds no row a recovery would move (one index probe)."""
    try:
        return not spool.has_replayable()
    except Exception:  # noqa: BLE001 - then the background recovery finds out
        return False
