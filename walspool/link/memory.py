"""The in-memory backlog in sight, for every gateway: a thread of its own looks at the
gateway's transcript queues once a second and publishes what they hold into the spool
(``walspool.store.memory``), so that ``stats``, ``ls``, ``watch`` and ``metrics`` show
what a SIGKILL would lose, and after one, what was lost.

It reads each store as ``Transcripts`` (``walspool.link.transcripts``: its queues and
their lock); the adapters say which stores and which spool (the 0.19.0 link: its own;
the plugin on 0.20 and 0.22: every store that wrote, each mapped by
``walspool.gateways.session_store``). A
gateway thread never waits for a publication: the look copies the queues' lists under
the store's lock (what a gateway thread may wait for, as long as that copy takes) and
does everything else outside it; the entry goes to the spool's writer without waiting
for its commit, and not at all while an earlier one is not committed yet (the spool's
write lock held elsewhere). A process that holds nothing writes nothing.

First, on that thread, the entries of this host's processes that ended without a clean
stop are taken in (``Spool.take_lost_memory``): what each lost is said in a WARNING,
counted in the spool's total ``memory_lost``, and its entry removed.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from ..errors import SpoolClosed
from ..store import memory
from ..store.spool import Spool
from .state import log
from .transcripts import Transcripts

#: Seconds between looks at the queues.
PUBLISH_SECONDS = 1.0
#: Seconds after which an unchanged backlog is published again (its ``at`` renewed).
HEARTBEAT_SECONDS = 60.0
#: Sessions a lost process's WARNING names, those that held the most first.
LOST_NAMED = 5
#: What was published last when its commit failed: like nothing any look gives.
_FAILED = ("not committed",)


class Gone(Exception):
    """The publisher's owner is gone (its link collected, its spool closed): the
    thread ends."""


class MemoryPublisher:
    """Publishes the queues of ``stores()`` into ``spool()`` (see the module docstring).

    Either returning None means their owner is gone (a link collected): the thread
    ends, as it does once the spool is closed. Neither may hold the owner strongly,
    or the owner is never collected while the thread runs.
    """

    def __init__(
        self,
        spool: Callable[[], Spool | None],
        stores: Callable[[], Iterable[Transcripts] | None],
        *,
        interval: float = PUBLISH_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._spool = spool
        self._stores = stores
        self.interval = interval
        self.clock = clock
        self.pid = os.getpid()
        self.host = memory.this_host()
        self._started = memory.started(self.pid)
        #: Each queued message seen (by id, the message kept so the id is not reused
        #: meanwhile), when it was first seen (its age) and its bytes as JSON.
        self._seen: dict[int, tuple[Any, float, int]] = {}
        #: What was published last (None: nothing), without its time, and when.
        self._published: tuple[Any, ...] | None = None
        self._published_at = 0.0
        self._pending: concurrent.futures.Future[Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def look(self) -> memory.Held | None:
        """What the stores' queues hold now; None when nothing."""
        now = self.clock()
        queues: list[tuple[str, list[Any]]] = []
        stores = self._stores()
        if stores is None:
            raise Gone
        for store in list(stores):
            with store.lock:
                queues += [(sid, list(q)) for sid, q in store.queues.items() if q]
        seen: dict[int, tuple[Any, float, int]] = {}
        known_before = self._seen.get
        sessions = []  # (-messages, oldest, session id, bytes): the largest first
        messages_total = bytes_total = 0
        oldest_total = now
        for session_id, messages in queues:
            oldest = now
            nbytes = 0
            for message in messages:
                known = known_before(id(message))
                if known is None or known[0] is not message:
                    known = (message, now, _size(message))  # each message encoded once
                seen[id(message)] = known
                if known[1] < oldest:
                    oldest = known[1]
                nbytes += known[2]
            sessions.append((-len(messages), oldest, str(session_id), nbytes))
            messages_total += len(messages)
            bytes_total += nbytes
            if oldest < oldest_total:
                oldest_total = oldest
        self._seen = seen
        if not sessions:
            return None
        top = heapq.nsmallest(memory.TOP_SESSIONS, sessions, key=lambda s: (s[0], s[1]))
        return memory.Held(
            pid=self.pid,
            host=self.host,
            started=self._started,
            at=now,
            sessions=len(sessions),
            messages=messages_total,
            bytes=bytes_total,
            oldest_at=oldest_total,
            top=[memory.HeldSession(sid, -count, nbytes, at) for count, at, sid, nbytes in top],
        )

    def publish(self) -> concurrent.futures.Future[Any] | None:
        """Look, and queue the entry if it changed (or is due again): its commit, or
        None when nothing was queued. Nothing is queued while the last one is not
        committed."""
        with self._lock:
            if self._pending is not None:
                if not self._pending.done():
                    return None
                if self._pending.exception() is not None:
                    self._published = _FAILED  # not in the spool: published again
            held = self.look()
            shape = None if held is None else (held.sessions, held.messages, held.bytes, held.top)
            due = held is not None and self.clock() - self._published_at >= HEARTBEAT_SECONDS
            if shape == self._published and not due:
                return None
            spool = self._spool()
            if spool is None:
                raise Gone
            try:
                self._pending = spool.publish_memory(self.pid, self.host, held)
            except SpoolClosed as exc:
                raise Gone from exc
            except queue.Full:
                return None  # the writer is behind: looked at again next time
            self._published, self._published_at = shape, self.clock()
            return self._pending

    def start(self) -> None:
        """Look every ``interval`` seconds on a thread of its own until ``stop``."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="walspool-memory", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop looking and publish once more (what the queues hold now: after a clean
        stop spooled them, nothing, so the entry goes). The spool's close commits it."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.interval + 1.0)
        try:
            with self._lock:
                self._pending = None  # queued behind the last one: the writer keeps order
            self.publish()
        except Gone:
            pass
        except Exception as exc:  # noqa: BLE001 - the gateway is stopping all the same
            log.debug("walspool could not publish the in-memory backlog at stop: %s", exc)

    def take_lost(self) -> list[memory.Held]:
        """Take in the entries of this host's processes that ended holding messages in
        memory (see the module docstring); what each held."""
        spool = self._spool()
        if spool is None:
            raise Gone
        try:
            lost = spool.take_lost_memory()
        except SpoolClosed as exc:
            raise Gone from exc
        for held in lost:
            log.warning(
                "A gateway process on this host (pid %d) ended without a clean stop while it "
                "held %d transcript message(s) of %d session(s) in memory (%d bytes, published "
                "%s); they were lost. Largest: %s",
                held.pid,
                held.messages,
                held.sessions,
                held.bytes,
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(held.at)),
                ", ".join(f"{s.session_id} ({s.messages})" for s in held.top[:LOST_NAMED]),
            )
        return lost

    def _run(self) -> None:
        try:
            self.take_lost()
        except Gone:
            return
        except Exception as exc:  # noqa: BLE001 - the publisher goes on all the same
            log.warning("walspool could not look for what stopped gateways lost: %s", exc)
        failed = False
        while not self._stop.wait(self.interval):
            try:
                self.publish()
                failed = False
            except Gone:
                return
            except Exception as exc:  # noqa: BLE001 - said once, tried again next second
                if not failed:
                    log.warning(
                        "walspool could not publish the gateway's in-memory backlog: %s", exc
                    )
                failed = True


def _size(message: Any) -> int:
    try:
        return len(msgspec.json.encode(message))
    except (TypeError, msgspec.EncodeError, OverflowError):
        return len(repr(message))
