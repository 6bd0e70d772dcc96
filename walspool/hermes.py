"""The gateway link: walspool as the overflow and shutdown sink of hermes-agent 0.19.0.

In the released gateway, ``SessionStore.append_to_transcript`` queues each message
per session, drops the oldest past 200 while ``state.db`` refuses writes, and the
runner and adapters clear their pending slots at shutdown. ``install`` changes
exactly that on one live store (and, with ``install_runner``, one runner):

* a message evicted at the cap is spooled (``CAP_DROP``), not dropped; if the spool
  cannot take it, the old drop-and-warn behaviour remains;
* a session's spooled rows (every reason but ``AGENT_HISTORY``, in seq order) are
  written before its in-memory rows, so ``state.db`` (``ORDER BY id``) holds the
  transcript in arrival order;
* pending slots and unflushed agent histories are spooled before they are cleared,
  and the next ``install`` replays them, in the background;
* a live message ``state.db`` refuses for its content (``sinks.rejects_live_row``: a
  value it cannot bind or serialise) never blocks its session: it is set aside in the
  spool as a quarantined row (reason ``REJECTED``; ``walspool ls`` shows it, replayed
  only when asked for) and the session's next message is written at once;
* a transcript rewrite (/retry, /undo, /compress: the store's ``_clear_dirty_transcript``)
  marks the session's spooled rows superseded: kept in the spool for operators, never
  replayed unless asked for, as the released store forgets its queue.

One writer per session. A session's writer is whoever claimed ``Session.writer``
under the store's ``_transcript_retry_lock``: the gateway thread whose message found
the session idle, or the link's one background thread. Only the holder of the claim
writes the session or gives the claim up, and it makes every decision on the state it
reads under the lock after each write or wait. By construction, only the holder changes
the session's decision state (its message in flight and its backoff); evictions,
commits, rewrites and recoveries are recorded as events it reads, which never write
what the holder set (``walspool.link.state.Session``). A session's state object is never
replaced, and is dropped only when nobody refers to it (no writer, no waiter, no
uncommitted eviction, no work); a thread that waited without a claim looks its
session up again, so every thread wakes to the current state.

Waits a gateway thread can meet because of walspool, with their bounds:

* the store's lock, held only for in-memory work: never a blocking put, never SQLite
  or file I/O (not even a ``stat``: one releases the GIL, and every other gateway
  thread would then wait on the lock for it). An eviction is handed to the spool's
  writer with ``Spool.put_nowait``; when its queue is full, or the oldest message is
  being written right now, the message stays in memory over the cap (WARNING when the
  spool is the reason). An eviction gets the checks ``Spool.append`` gets: a closed
  spool refuses it at once (the drop-and-warn path), and one whose path no longer names
  its file (deleted, moved) fails it when its group commits (the writer's check, once
  per group): the background thread then opens a fresh spool at the path and hands it
  those evictions first (``Link.follow_path``), later ones staying queued meanwhile;
* past twice the cap only (messages arriving faster than the spool or one state.db
  write takes them): at most ``HANDOFF_WAIT`` for room in the spool writer's queue or
  for that write to end, and no wait at all while another process holds the spool's
  write lock; then the oldest takes the old drop-and-warn path (WARNING);
* as the writer of a healthy session, its own ``state.db`` writes (as in the released
  store) and a drain of its spooled rows: at most ``GATEWAY_DRAIN_ROWS`` rows per call, then the
  background thread goes on. Before a drain it waits at most ``CONFIRM_WAIT`` for its
  own evictions to commit, and at most ``HANDOFF_WAIT`` for this link's drain of
  another session to finish its batch; a drain never waits for a replay lock held
  elsewhere (``ReplayBusy``: retried later) and is left to the background thread
  while another process holds the spool's write lock. A spool transaction of a
  drain waits at most ``walspool.store.writer.BUSY_RETRY_SECONDS`` for that lock;
* taking a session over from the background thread: at most ``HANDOFF_WAIT``, in
  practice the rest of one ``state.db`` write or one drain batch of
  ``DRAIN_CHUNK_ROWS`` rows; none while another process holds the spool's write lock;
* a transcript rewrite: at most ``HANDOFF_WAIT`` for a drain batch of this link,
  then its supersede transaction (at most ``BUSY_RETRY_SECONDS``); shutdown's
  ``flush_queues`` waits at most ``FLUSH_TIMEOUT`` (plus ``CONFIRM_WAIT``).

Self-healing: while a session has queued or spooled work, the background thread
retries it when its retry time passes, with no new message needed, a slice of at most
``GATEWAY_DRAIN_ROWS`` spooled rows at a time, the session longest due first. The delay after
the k-th failure in a row is ``retry_interval`` * 2 ** (k - 4), capped at
``retry_interval``: 1/8, 1/4, 1/2, then every ``retry_interval``. While ``state.db``
fails, failing sessions are tried one at a time (the probe, ``machine.pick_due``), so a
long outage with many sessions and no messages costs one failing write per interval;
the first success lets every due session go on at once, so a healed ``state.db``
receives everything within ``retry_interval`` plus the time the writes take.
Meanwhile, from its first failed write or drain until a retry succeeds, a
session's gateway threads only queue its new messages (and spool at the cap): an
outage costs no failing write, and no wait, per message. ``retry_interval=0`` turns
the background thread off (as does ``Link.close``): each message retries at once, as
in the released store.

The cap on the spool (``max_bytes``, ``walspool.link.budget``) keeps room for quiet sessions
by each session's share: the bytes its rows hold in the spool, superseded ones and those
of earlier runs included. When the spool holds rows at ``install``, the background thread
first counts them (one walk of an index, 0.6 to 0.8 s for a million rows);
``wait_idle`` waits for it, no gateway thread does.

Logs (``walspool.link.outage``): one WARNING when a session starts spooling (naming the
spool), one when its spooled rows are all written back and one when the outage is over,
with counts and durations; a progress line at most once a minute; the released store's
retry WARNING for the first ``outage.QUIET_AFTER`` failures in a row, then at most once a
minute. A session's repeated condition (its spool busy, so the oldest message stays in
memory; its oldest dropped or not spoolable; its spooled rows replayed, chunk by chunk)
is said in full at its first occurrence, then at most once per ``REPEAT_SECONDS`` (60 s)
with the count since its last line, and once when it ends; every occurrence is counted
in one line, and ``close`` says what is held back (``walspool.link.repeats``). A drop
for the message's own fault (a session id or a size the spool refuses) is said each
time, with its detail. The line per eviction is DEBUG.

Not guaranteed: messages still in memory when the process is killed are lost, as in
the released gateway (only spooled rows are durable). A message the store or a drain
is writing at the moment of a rewrite may land after the rewritten transcript, as in
the released store. An eviction or a quarantined message the spool accepted but then
failed to commit (disk full, its write lock held elsewhere past the bound, closed) is
dropped with a WARNING; so is a refused message the spool cannot take at all.

The link is built as a pure per-session state machine (``walspool.link.machine``)
inside a thin shell (``walspool.link.link.Link``) that holds the store's lock,
performs the machine's steps and logs after unlocking; evictions, the session writer,
the background thread and shutdown each have their module in ``walspool.link``, and
none names a gateway's attribute. This module is 0.19.0's adapter and the link's
public face: it checks the store and the runner, maps the store onto the link's
``Transcripts`` (``walspool.gateways.session_store``) and hooks the runner's stop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from .errors import UnsupportedGateway
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
