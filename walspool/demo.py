"""``walspool demo``: messages spooled during an outage come back in order."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import TextIO

from .records import CAP_DROP
from .spool import Spool


def run_demo(out: TextIO, sessions: int = 16, per_session: int = 250) -> int:
    """Spool a burst from many threads, read it back, and report what was kept."""
    with tempfile.TemporaryDirectory(prefix="walspool-demo-") as home:
        path = Path(home) / "spool.db"
        sent: dict[str, list[int]] = {}
        started = time.perf_counter()
        with Spool(path) as spool:

            def feed(session: str) -> None:
                for i in range(per_session):
                    spool.append(
                        session,
                        {"role": "user", "content": f"{session} #{i}", "i": i},
                        reason=CAP_DROP,
                    )
                sent[session] = list(range(per_session))

            threads = [threading.Thread(target=feed, args=(f"s{n:02d}",)) for n in range(sessions)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.perf_counter() - started
            got: dict[str, list[int]] = {}
            for rec in spool.records():
                got.setdefault(rec.session_id or "", []).append(rec.message["i"])
            stats = spool.stats()
        total = sessions * per_session
        kept = sum(len(v) for v in got.values())
        in_order = all(got.get(s) == v for s, v in sent.items())
        out.write(
            f"spooled {total} messages from {sessions} threads in {elapsed:.2f}s "
            f"({total / elapsed:,.0f}/s, durability=full)\n"
            f"kept {kept} of {total}; per-session order kept: {in_order}; "
            f"{stats.bytes:,} payload bytes\n"
        )
        return 0 if kept == total and in_order else 1
