"""A gateway process for the kill tests: the fork's real store with walspool's module.

    python _worker.py HOME outage KIND SESSIONS N   # N messages per session, state.db broken
    python _worker.py HOME live SESSIONS N KILL_AT  # transient outage, heal, drain
    python _worker.py HOME start SESSIONS [KILL_AT] # heal, recover_gateway_pending, one more
                                                    # message per session; prints the rows

With KILL_AT, the process prints "LANDED <n>" after the n-th state.db commit of the
drain or the recovery and then blocks, so the test can SIGKILL it right after a
commit and before the spool forgets the row.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # _gateways_common
logging.disable(logging.CRITICAL)

HOME = Path(sys.argv[1])
os.environ["HERMES_HOME"] = str(HOME)

import walspool.shutdown_flush as wsf  # noqa: E402

sys.modules["gateway.shutdown_flush"] = wsf

from _fork import CORRUPT, TRANSIENT, break_db, heal_db, new_store  # noqa: E402


def sessions(count: int) -> list[str]:
    return [f"s{i}" for i in range(count)]


def kill_after(commits: int) -> None:
    """After the n-th ``append_message`` commit from now, say so and block."""
    import hermes_state

    original = hermes_state.SessionDB.append_message
    seen = [0]

    def append_message(self: Any, *args: Any, **kwargs: Any) -> int:
        row = original(self, *args, **kwargs)
        seen[0] += 1
        if seen[0] == commits:
            print(f"LANDED {commits}", flush=True)
            threading.Event().wait()
        return row

    hermes_state.SessionDB.append_message = append_message


def outage(store: Any, kind: str, ids: list[str], n: int) -> None:
    for sid in ids:
        store._db.create_session(sid, "telegram")
    break_db(store._db, CORRUPT if kind == "corrupt" else TRANSIENT)
    for i in range(n):
        for sid in ids:
            store.append_to_transcript(sid, {"role": "user", "content": f"{sid}-{i}"})


def main() -> None:
    command, args = sys.argv[2], [int(a) if a.isdigit() else a for a in sys.argv[3:]]
    store = new_store(HOME)
    if command == "outage":
        kind, count, n = args
        outage(store, kind, sessions(count), n)
    elif command == "live":
        count, n, kill_at = args
        outage(store, "transient", sessions(count), n)
        heal_db(store._db)
        kill_after(kill_at)
        for sid in sessions(count):
            store.append_to_transcript(sid, {"role": "user", "content": f"{sid}-trigger"})
    elif command == "start":
        count, *kill_at = args
        heal_db(store._db)
        if kill_at:
            kill_after(kill_at[0])
        runner = types.SimpleNamespace(session_store=store, config=store.config)
        recovered = wsf.recover_gateway_pending(runner)
        rows: dict[str, list[Any]] = {}
        for sid in sessions(count):
            store.append_to_transcript(sid, {"role": "user", "content": f"{sid}-last"})
            rows[sid] = [m["content"] for m in store._db.get_messages(sid)]
        print("ROWS " + json.dumps({"recovered": recovered, "rows": rows}), flush=True)
    else:
        raise SystemExit(f"unknown command {command}")
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
