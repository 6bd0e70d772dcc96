"""Child process for the replay crash tests: replay into state.db, SIGKILL itself on cue.

    python tests/_replay_child.py SPOOL STATE_DB BATCH_ROWS

``WALSPOOL_CRASH=<point>:<n>`` names where to die (unset: replay to the end and print
the report as JSON):

* ``before_write``  just before the n-th sink write (its batch is in flight);
* ``after_commit``  just after the n-th sink write committed, before the spool delete;
* ``after_mark``    just after the n-th batch was marked in flight and committed;
* ``during_settle`` inside the n-th settling transaction (deletes done, not committed).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import msgspec
from hermes_state import SessionDB

import walspool
from walspool.replay.replayer import Replayer
from walspool.replay.sinks import SessionDBSink
from walspool.store.records import Record

POINT, _, COUNT = os.environ.get("WALSPOOL_CRASH", "none:0").partition(":")
N = int(COUNT)


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class CrashingSink(SessionDBSink):
    writes = 0

    def write(self, session_id: str, record: Record, ticket: tuple[str, int, int]) -> None:
        self.writes += 1
        if POINT == "before_write" and self.writes == N:
            die()
        super().write(session_id, record, ticket)
        if POINT == "after_commit" and self.writes == N:
            die()


def crashing(execute: Any) -> Any:
    calls = {"_take": 0, "_settle": 0}

    def run(fn: Any) -> Any:
        name = getattr(getattr(fn, "func", fn), "__name__", "")
        calls[name] = calls.get(name, 0) + 1
        if POINT == "during_settle" and name == "_settle" and calls[name] == N:

            def settle_then_die(conn: Any) -> None:
                fn(conn)
                die()

            return execute(settle_then_die)
        result = execute(fn)
        if POINT == "after_mark" and name == "_take" and calls[name] == N:
            die()
        return result

    return run


def main(spool_path: str, state_db: str, batch_rows: str) -> None:
    db = SessionDB(db_path=Path(state_db))
    with walspool.Spool(spool_path) as spool:
        spool.transact = crashing(spool.transact)  # type: ignore[method-assign]
        report = Replayer(spool, CrashingSink(db), batch_rows=int(batch_rows)).replay()
    db.close()
    sys.stdout.write(msgspec.json.encode(report).decode())


if __name__ == "__main__":
    main(*sys.argv[1:])
