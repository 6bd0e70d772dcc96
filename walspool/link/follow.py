"""The gateway link when its spool's path names another file (deleted, moved while the
gateway runs): once no eviction of the link is left in the old spool's writer, a fresh
spool is opened at the path, as the next start would, and takes the evictions the old
one returned, in their order, before any later one.
"""

from __future__ import annotations

from ..errors import SpoolReplaced, WalspoolError
from ..store.spool import REOPENED
from . import bounds
from .core import Core, Note
from .evict import Evictions
from .lines import Lines
from .state import log


class Follow:
    """Opens a fresh spool at the path for the link (``Core.replaced``)."""

    def __init__(self, core: Core, evictions: Evictions, lines: Lines) -> None:
        self.core = core
        self.evictions = evictions
        self.lines = lines

    def follow_path(self) -> bool:
        """Open a fresh spool at the path of one that names another file now, once the
        old spool's writer holds no eviction of this link; hand it the evictions the old
        one returned, in their order, then close the old one (its rows stay in its file:
        a moved one can be replayed by hand). True if the link writes to a fresh spool
        now. Runs on the background thread, or at shutdown; never on a gateway thread
        (it opens files)."""
        core = self.core
        with core.draining:  # no drain has a chunk of the old spool out
            with core.lock:
                if not core.replaced or core.unconfirmed_bytes:
                    return False
                old = core.spool
            try:
                fresh = old.reopened()
            except Exception as exc:  # noqa: BLE001 - the evictions it returned drop
                self._not_followed(exc)
                return False
            if core.max_bytes is not None:
                fresh.track_footprint()
            with core.lock:
                core.use(fresh)  # the fresh file holds no session's rows
                core.replaced = False
                returned, core.returned = core.returned, []
                lost = self.evictions.hand_over(returned)
                core.settled.notify_all()
        log.warning(REOPENED, old.path)
        self.core.run(lost)
        old.close()
        return True

    def before_flush(self, deadline: float) -> None:
        """If the spool's path names another file now (deleted, moved): wait (until
        ``deadline``) for the evictions in the old spool's writer to come back, then open
        a fresh spool there (``follow_path``), so the queues follow them into it."""
        core = self.core
        try:
            core.spool.check_path()
        except SpoolReplaced:
            pass
        except WalspoolError:
            return  # closed: the flush says so
        else:
            if not core.replaced:
                return
        with core.lock:
            if core.clock() < core.reopen_after:
                return  # a fresh spool could not be opened a moment ago
            core.replaced = True
            while core.unconfirmed_bytes:
                left = deadline - core.timer()
                if left <= 0:
                    return
                core.settled.wait(min(left, bounds.BUSY_LOOK_SECONDS))
        self.follow_path()

    def _not_followed(self, exc: Exception) -> None:
        """No fresh spool could be opened at the path: the returned evictions are
        dropped, and later ones too until ``retry_interval`` has passed."""
        core = self.core
        wait = max(core.retry_interval, bounds.RETRY_INTERVAL)
        with core.lock:
            core.replaced = False
            core.reopen_after = core.clock() + wait
            returned, core.returned = core.returned, []
            lines: list[Note] = []
            for row in returned:
                lines += self.lines.dropped(
                    row.session_id, f"no fresh spool could be opened: {exc}"
                )
                self.evictions.settled(row.session_id, core.sessions.get(row.session_id))
            core.settled.notify_all()
        log.warning(
            "The transcript spool %s was moved or deleted while the gateway ran, and no "
            "fresh one can be opened at that path (tried again in %g s): %s",
            core.spool.path,
            wait,
            exc,
        )
        self.core.run(lines)
