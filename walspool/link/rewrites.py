"""Supersede on rewrite, for every gateway: once a session's transcript is rewritten
(/retry, /undo, /compress), its spooled rows are marked superseded: kept in the spool
for operators, never replayed unless asked for, as they would land after the rewrite.
The 0.19.0 link calls it from its own rewrite hook, the 0.20 and 0.22 plugin from the
store's ``_clear_dirty_transcript``; the caller has emptied the session's queue first.
"""

from __future__ import annotations

import logging
import threading

from ..errors import ReplayBusy
from ..store.replay_lock import replay_lock
from ..store.spool import Spool
from . import bounds


def supersede_rewritten(
    spool: Spool,
    session_id: str,
    log: logging.Logger,
    own_drains: threading.Lock | None = None,
) -> int:
    """Supersede ``session_id``'s spooled rows after a rewrite and say so on ``log``
    (WARNING: how many; ERROR: it failed, the rewrite goes on). How many.

    Rows in flight are left to the replay that has them out. A row a failed drain left
    in flight has no replay: with the replay lock taken without waiting (and the
    caller's ``own_drains`` held, waited for at most ``bounds.HANDOFF_WAIT``), every
    in-flight row of the session is such a leftover, and it is superseded with the rest.
    Waits at most for one spool transaction (``walspool.store.writer.BUSY_RETRY_SECONDS``
    while another process holds the write lock).
    """
    try:
        superseded = _supersede(spool, session_id, own_drains)
    except Exception:  # noqa: BLE001 - the rewrite goes on; the rows stay, reported
        log.exception(
            "walspool could not supersede the spooled rows of session %s in %s after "
            "its transcript was rewritten; a replay would put them after it",
            session_id,
            spool.path,
        )
        return 0
    if superseded:
        log.warning(
            "Transcript of %s rewritten: %d spooled message(s) in %s superseded (kept for "
            "operators, not replayed)",
            session_id,
            superseded,
            spool.path,
        )
    return superseded


def _supersede(spool: Spool, session_id: str, own_drains: threading.Lock | None) -> int:
    if own_drains is None or own_drains.acquire(timeout=bounds.HANDOFF_WAIT):
        try:
            with replay_lock(spool, wait=False):
                return int(spool.supersede(session_id, inflight=True))
        except ReplayBusy:
            pass  # another replay has rows out: leave those to it
        finally:
            if own_drains is not None:
                own_drains.release()
    return int(spool.supersede(session_id))
