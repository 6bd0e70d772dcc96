"""A gateway process for the kill tests on axisrow 0.20: its real store, walspool's module.

    python _worker.py HOME outage SESSIONS N          # N messages per session, state.db broken
    python _worker.py HOME live SESSIONS N KILL_AT    # outage, heal, one message: live drain
    python _worker.py HOME live-foreign ...           # the same through a callback of its own
    python _worker.py HOME start SESSIONS [KILL_AT]   # heal, recover_pending_to_db() as the
                                                      # gateway calls it, one more message per
                                                      # session; prints the rows
    python _worker.py HOME slots CHATS                # route CHATS chats, spool their slots
                                                      # (and one of an unknown key) at shutdown

With KILL_AT, the process prints "LANDED <n>" after the n-th state.db commit of the
live drain (``live``) or of the recovery (``start``) and then blocks, so the test can
SIGKILL it right after a commit and before the spool forgets the row.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # _gateways_common
logging.disable(logging.CRITICAL)

HOME = Path(sys.argv[1])
os.environ["HERMES_HOME"] = str(HOME)

import walspool.shutdown_flush as wsf  # noqa: E402

sys.modules["gateway.shutdown_flush"] = wsf

from _axisrow import break_db, contents, heal_db, keyed_session, new_store  # noqa: E402

#: ``live-foreign``: the drain's callback is wrapped in one defined here (not the gateway's).
FOREIGN = sys.argv[2] == "live-foreign"


def sessions(count: int) -> list[str]:
    return [f"s{i}" for i in range(count)]


def kill_after(commits: int, *, in_drain: bool) -> None:
    """After the n-th ``append_message`` commit from now (of the live drain only, with
    ``in_drain``), say so and block."""
    import hermes_state

    original = hermes_state.SessionDB.append_message
    seen = [0]
    draining = [not in_drain]

    def append_message(self: Any, *args: Any, **kwargs: Any) -> int:
        row = original(self, *args, **kwargs)
        if draining[0]:
            seen[0] += 1
            if seen[0] == commits:
                print(f"LANDED {commits}", flush=True)
                threading.Event().wait()
        return row

    hermes_state.SessionDB.append_message = append_message
    drain = wsf.drain_transcript_spool

    def drain_transcript_spool(session_id: str, replay: Any, **kwargs: Any) -> Any:
        draining[0] = True
        if FOREIGN:  # a callback walspool cannot track: defined outside the gateway

            def foreign(message: Any, replay: Any = replay) -> None:
                replay(message)

            replay = foreign
        try:
            return drain(session_id, replay, **kwargs)
        finally:
            draining[0] = not in_drain

    wsf.drain_transcript_spool = drain_transcript_spool


def outage(store: Any, ids: list[str], n: int) -> None:
    for sid in ids:
        store._db.create_session(sid, "telegram")
    break_db(store._db)
    for i in range(n):
        for sid in ids:
            store.append_to_transcript(sid, {"role": "user", "content": f"{sid}-{i}"})


def main() -> None:
    command, args = sys.argv[2], [int(a) for a in sys.argv[3:]]
    store = new_store(HOME)
    if command == "outage":
        count, n = args
        outage(store, sessions(count), n)
    elif command in ("live", "live-foreign"):
        count, n, kill_at = args
        outage(store, sessions(count), n)
        heal_db(store._db)
        kill_after(kill_at, in_drain=True)
        for sid in sessions(count):
            store.append_to_transcript(sid, {"role": "user", "content": f"{sid}-trigger"})
    elif command == "start":
        count, *kill_at = args
        heal_db(store._db)
        if kill_at:
            kill_after(kill_at[0], in_drain=False)
        recovered = wsf.recover_pending_to_db()  # as gateway/run.py calls it
        rows: dict[str, list[Any]] = {}
        for sid in sessions(count):
            store.append_to_transcript(sid, {"role": "user", "content": f"{sid}-last"})
            rows[sid] = contents(store._db, sid)
        print("ROWS " + json.dumps({"recovered": recovered, "rows": rows}), flush=True)
    elif command == "slots":
        (chats,) = args
        pending = {keyed_session(store, str(c)).session_key: f"slot {c}" for c in range(chats)}
        pending["agent:main:telegram:dm:nobody\x1b[2J"] = "slot of an unknown key"
        print("KEYS " + json.dumps(sorted(pending)), flush=True)
        wsf.flush_pending_to_file(pending)  # as gateway/run.py does at shutdown
    else:
        raise SystemExit(f"unknown command {command}")
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
