"""Sessions whose write walspool put off, tried again with no new message.

On 0.20 and 0.22 the gateway owns its write loop and tries a session's queue again
only when that session's next message arrives. A drain of the session's spooled rows
that walspool skips for the spool's sake (its write lock held by another process, its
writer behind, another replay running), or holds where one of its statements met
state.db's lock held by another process, leaves the session's queue waiting: without a
retry, a heal with nobody writing would leave it in memory until the next message or
the stop. ``Deferred`` collects such sessions and, on a thread of its own, once per
``interval`` and only while the spool would let a drain run (``ready``), gives each to
``retry`` (the adapter's: the store's own drain and writes, under its lock; see
``walspool.gateways.session_store.retry_session``). A retry skipped again defers its
session again. Sessions whose writes failed for state.db's own sake (an outage, not
its lock held by another process) are not collected: those wait for the gateway's
own next try, as released.

Not guaranteed: a retry within ``interval`` of the reason clearing (it runs at the
next round after it); anything once ``close`` ran.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from . import bounds
from .state import log

#: What names a deferred session (the plugin's: the spool's path and the session id).
Key = TypeVar("Key")


class Deferred(Generic[Key]):
    """Keys of sessions to try again, and the thread that does (see the module)."""

    def __init__(
        self,
        retry: Callable[[Key], object],
        ready: Callable[[], bool],
        *,
        interval: float = bounds.RETRY_INTERVAL,
        name: str = "walspool-retry",
    ) -> None:
        self.retry = retry
        self.ready = ready
        self.interval = interval
        self.name = name
        self.closed = False
        self.thread: threading.Thread | None = None
        self._changed = threading.Condition()
        #: Deferred keys, first deferred first (a dict keeps the order, once each).
        self._keys: dict[Key, None] = {}

    def defer(self, key: Key) -> None:
        """Try ``key``'s session again at the next round (starts the thread once)."""
        with self._changed:
            if self.closed:
                return
            self._keys[key] = None
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self.thread.start()
            self._changed.notify_all()

    def waiting(self) -> list[Key]:
        """The keys deferred now, first deferred first."""
        with self._changed:
            return list(self._keys)

    def retry_round(self) -> int:
        """One round: if the spool would let a drain run, take every deferred key and
        give each to ``retry``, first deferred first; how many were given. A retry
        that raises is logged and the round goes on."""
        with self._changed:
            if not self._keys or self.closed:
                return 0
        if not self.ready():
            return 0
        with self._changed:
            keys, self._keys = list(self._keys), {}
        for key in keys:
            try:
                self.retry(key)
            except Exception:  # noqa: BLE001 - the others go on; the next write tries it
                log.exception("walspool could not try %s again; its next write will", key)
        return len(keys)

    def close(self) -> None:
        """Stop trying (at once; a retry under way ends first, waited for at most
        ``bounds.HANDOFF_WAIT``). Deferred keys are forgotten: they wait for their
        sessions' next write, or the stop. Idempotent."""
        with self._changed:
            self.closed = True
            self._keys.clear()
            self._changed.notify_all()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(bounds.HANDOFF_WAIT)

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self.closed and not self._keys:
                    self._changed.wait()
                if self.closed:
                    return
                # The reason the drain was skipped takes a moment to clear: look again
                # after the interval, whatever is deferred meanwhile (a close ends it).
                if self._changed.wait_for(lambda: self.closed, self.interval):
                    return
            self.retry_round()
