"""SIGINT and SIGTERM as an exception a command can report from. Not public API.

A replay stopped by a signal should say what it wrote and what it left in flight,
and exit as the shell expects (130 for SIGINT, 143 for SIGTERM), instead of dying
silently (SIGTERM's default) or with a traceback.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

from ..replay.sinks import SQL_FUNCTIONS

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """A signal asked the command to stop. A ``BaseException``, as ``KeyboardInterrupt``
    is, so no ``except Exception`` on the way mistakes it for a failed write."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        #: The exit status a shell gives a process the signal killed.
        self.status = 128 + signum
        super().__init__(self.name)


#: A signal that came while SQLite ran one of walspool's SQL functions, kept for
#: ``raise_kept``: an exception raised there is swallowed by ``sqlite3``, which fails
#: the statement with "user-defined function raised exception" instead.
_kept: list[int] = []


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Within the block, the first SIGINT or SIGTERM raises ``Interrupted``.

    Later ones are ignored until the block ends, so the cleanup the first one starts
    (settling what the replay knows, closing the spool and state.db) runs to its end.
    One that comes while SQLite runs a function of walspool's (the ticket of the row
    being written, inside its INSERT) is kept until ``raise_kept``, called once that
    write is done. Outside the main thread (where Python cannot set handlers) signals
    keep their handlers.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal raised
        if raised:
            return
        raised = True
        if frame is not None and frame.f_code in SQL_FUNCTIONS:
            _kept.append(signum)
            return
        raise Interrupted(signum)

    previous = {s: signal.signal(s, stop) for s in SIGNALS}
    try:
        yield
    finally:
        _kept.clear()
        for s, handler in previous.items():
            signal.signal(s, handler)


def raise_kept() -> None:
    """Raise ``Interrupted`` for a signal kept while SQLite ran a function of ours."""
    if _kept:
        raise Interrupted(_kept.pop())
