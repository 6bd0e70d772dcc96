"""Worker process for the crash matrix: append, replay, drain through the gateway link,
or import upstream's JSON spool, and SIGKILL itself on cue.

    python tests/_crash_worker.py append  SPOOL RUN THREADS PER_THREAD DURABILITY
    python tests/_crash_worker.py replay  SPOOL STATE_DB RUN BATCH_ROWS APPEND_THREADS PER_THREAD
    python tests/_crash_worker.py gateway HOME RUN THREADS PHASE START_STATE
    python tests/_crash_worker.py finish  HOME
    python tests/_crash_worker.py import  SPOOL DIRECTORY BATCH_FILES

``WALSPOOL_CRASH=<event>:<n>`` kills the process (SIGKILL, from whichever thread gets
there) at the n-th occurrence of the event; unset, the worker runs until the parent
kills it (``append``, ``gateway``) or to the end (``replay`` with no appenders,
``finish``, ``import``). Events:

* ``commit``      inside the n-th COMMIT of the spool's write connection (apsw commit
                  hook: the transaction is not durable yet);
* ``committed``   just after the n-th spool commit reached the WAL, before anyone is
                  told (apsw WAL hook);
* ``ack``         just after the n-th acknowledgement line was printed;
* ``before_write``/``after_write``  around the n-th sink write into state.db;
* ``after_mark``  just after the n-th replay batch was marked in flight and committed;
* ``during_settle`` inside the n-th settling transaction (deletes done, not committed);
* ``before_append``/``after_append``  around the n-th ``Spool.append_many`` (import);
* ``unlink``      just before the n-th file removal of the import.

Every line goes out with one ``os.write`` (atomic on a pipe), so lines from several
threads never interleave and a line printed before the kill is whole. Lines:

* ``A SESSION SEQ RUN T I``  an append returned (or its future resolved);
* ``W SESSION RUN I``        the sink committed a replayed message into state.db;
* ``L SESSION RUN I``        the gateway wrote a queued message into state.db itself;
* ``S SESSION RUN I``        the gateway link's eviction of a message was committed;
* ``P ...``                  progress of no consequence to the checks.

Message content is ``"RUN:T:I"``: run number, owning thread, index within the thread.
Each session belongs to one thread, so a session's append order is ``(RUN, I)`` order.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

EVENT, _, COUNT = os.environ.get("WALSPOOL_CRASH", "none:0").partition(":")
#: ``WALSPOOL_SAME_TS=1``: messages come as the gateway writes agent turns: every four
#: in a row share one role and one whole-second timestamp (only their content differs).
SAME_TS = os.environ.get("WALSPOOL_SAME_TS") == "1"
TARGET = int(COUNT or 0)
PAD = "x" * 400

BREAK = (
    "CREATE TRIGGER IF NOT EXISTS broken BEFORE INSERT ON messages BEGIN "
    "SELECT RAISE(ABORT, 'database disk image is malformed'); END"
)
HEAL = "DROP TRIGGER IF EXISTS broken"

_counts: dict[str, int] = {}
_counts_lock = threading.Lock()


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def hit(event: str) -> None:
    """Count an event; die if it is the one the parent chose."""
    if event != EVENT:
        return
    with _counts_lock:
        n = _counts[event] = _counts.get(event, 0) + 1
    if n == TARGET:
        os.kill(os.getpid(), signal.SIGKILL)


def message(run: int, t: int, i: int) -> dict[str, Any]:
    if SAME_TS:
        turn = float(1_700_000_000 + run * 10_000 + i // 4)
        return {"role": "tool", "content": f"{run}:{t}:{i}", "pad": PAD, "timestamp": turn}
    return {"role": "user", "content": f"{run}:{t}:{i}", "pad": PAD}


def parse(content: str) -> tuple[int, int]:
    run, _, i = content.split(":")
    return int(run), int(i)


def thread_sessions(prefix: str, t: int, per_thread: int) -> list[str]:
    return [f"{prefix}{t}-{k}" for k in range(per_thread)]


# -- hooks on walspool ----------------------------------------------------------------


def hook_spool(spool: Any) -> None:
    """Commit and WAL hooks on the spool's write connection; replay transaction points."""
    conn = spool._conn

    def on_commit() -> bool:
        hit("commit")
        return False  # go on committing

    def on_wal(c: Any, db: str, pages: int) -> int:
        hit("committed")
        if pages > 1000:  # a WAL hook replaces SQLite's autocheckpoint: do its job
            c.wal_checkpoint(db)
        return 0

    conn.set_commit_hook(on_commit)
    conn.set_wal_hook(on_wal)
    execute = spool.transact

    def run(fn: Any) -> Any:
        name = getattr(getattr(fn, "func", fn), "__name__", "")
        if name == "_settle" and EVENT == "during_settle":

            def settle_then_count(c: Any) -> Any:
                result = fn(c)
                hit("during_settle")
                return result

            return execute(settle_then_count)
        result = execute(fn)
        if name == "_take":
            hit("after_mark")
        return result

    spool.transact = run


def hook_sink(sink: Any) -> None:
    write = sink.write

    def crashing_write(session_id: str, record: Any, ticket: Any) -> None:
        hit("before_write")
        write(session_id, record, ticket)
        content = record.message.get("content", "") if isinstance(record.message, dict) else ""
        run, i = parse(content)
        say(f"W {session_id} {run} {i}")
        hit("after_write")

    sink.write = crashing_write


def open_state_db(path: Path) -> Any:
    from hermes_state import SessionDB

    db = SessionDB(db_path=path)
    # Survives SIGKILL (WAL, the OS keeps the pages); only a power cut could lose a
    # commit, which these tests do not make. Twice as fast as FULL.
    with db._lock:
        db._conn.execute("PRAGMA synchronous=NORMAL")
    return db


# -- appending ------------------------------------------------------------------------


def appender(spool: Any, run: int, t: int, sessions: list[str], count: int) -> None:
    """Append ``count`` messages round-robin over ``sessions``; odd threads use submit."""
    if t % 2 == 0:
        for i in range(count):
            s = sessions[i % len(sessions)]
            r = spool.append(s, message(run, t, i))
            say(f"A {s} {r.seq} {run} {t} {i}")
            hit("ack")
        return
    window = 16
    for lo in range(0, count, window):
        futures = []
        for i in range(lo, min(lo + window, count)):
            s = sessions[i % len(sessions)]
            futures.append((s, i, spool.submit(s, message(run, t, i))))
        for s, i, future in futures:
            r = future.result()
            say(f"A {s} {r.seq} {run} {t} {i}")
            hit("ack")


def start_appenders(
    spool: Any, run: int, threads: int, per_thread: int, count: int, prefix: str = "a"
) -> list[threading.Thread]:
    workers = [
        threading.Thread(
            target=appender,
            args=(spool, run, t, thread_sessions(prefix, t, per_thread), count),
            daemon=True,
        )
        for t in range(threads)
    ]
    for w in workers:
        w.start()
    return workers


def main_append(spool_path: str, run: str, threads: str, per_thread: str, durability: str) -> None:
    import walspool

    spool = walspool.Spool(spool_path, durability=durability)
    hook_spool(spool)
    say("P ready")
    for w in start_appenders(spool, int(run), int(threads), int(per_thread), count=400):
        w.join()
    say("P appended")
    threading.Event().wait()  # idle until killed


# -- replaying ------------------------------------------------------------------------


def main_replay(
    spool_path: str,
    state_db: str,
    run: str,
    batch_rows: str,
    append_threads: str,
    per_thread: str,
) -> None:
    import walspool
    from walspool.replay.replayer import Replayer
    from walspool.replay.sinks import SessionDBSink

    db = open_state_db(Path(state_db))
    spool = walspool.Spool(spool_path, durability="normal")
    hook_spool(spool)
    sink = SessionDBSink(db)
    hook_sink(sink)
    replayer = Replayer(spool, sink, batch_rows=int(batch_rows))
    say("P ready")
    workers = start_appenders(
        spool, int(run), int(append_threads), int(per_thread), count=300, prefix="r"
    )
    while True:
        report = replayer.replay()
        if report.held:
            raise AssertionError(f"replay held rows: {report.errors}")
        if report.moved or report.recovered:
            say(f"P moved {report.moved} recovered {report.recovered}")
        if not workers and not report.moved and spool.stats().rows == 0:
            break
        workers = [w for w in workers if w.is_alive()]
    spool.close()
    db.close()
    say("P done")


# -- the gateway link -----------------------------------------------------------------


def gateway_store(home: Path) -> Any:
    os.environ["HERMES_HOME"] = str(home)
    import hermes_state

    hermes_state.DEFAULT_DB_PATH = home / "state.db"
    from gateway.config import GatewayConfig
    from gateway.session import SessionStore

    store = SessionStore(home / "sessions", GatewayConfig(sessions_dir=home / "sessions"))
    with store._db._lock:
        store._db._conn.execute("PRAGMA synchronous=NORMAL")  # see open_state_db
    return store


def set_db_state(store: Any, broken: bool) -> None:
    with store._db._lock:
        store._db._conn.execute(BREAK if broken else HEAL)


def report_evictions(spool: Any) -> None:
    """Print ``S`` for each row the link hands to the spool's writer, once committed,
    with the id of its record.

    The link spools an eviction with ``Writer.notify_nowait`` (never a blocking call
    under the store's lock); the callback runs after the commit, or with ``error`` set.
    A ``Batched`` callback (the link's, once per group) is wrapped once, as a
    ``Batched`` that reports each request of the group.
    """
    import msgspec

    from walspool.store.writer import Batched

    writer = spool._writer
    wrapped: dict[Any, Batched] = {}

    def report(r: Any) -> None:
        if r.error is None and hasattr(r, "rows"):
            receipts = r.result if isinstance(r.result, list) else [r.result]
            for row, receipt in zip(r.rows, receipts, strict=True):
                session_id, payload = row.session_id, msgspec.json.decode(row.payload)
                run_, i = parse(payload["content"])
                # the record's id: commit order, which the order of these lines is not
                # (a group committed on a caller's thread reports after it lets go)
                say(f"S {session_id} {run_} {i} {receipt.id}")

    def batched(callback: Batched) -> Batched:
        if callback not in wrapped:

            def done_all(requests: list[Any]) -> None:
                for r in requests:
                    report(r)
                callback.fn(requests)

            wrapped[callback] = Batched(done_all)
        return wrapped[callback]

    def reporting(put: Any) -> Any:
        def put_reporting(request: Any, callback: Any, *args: Any, **kw: Any) -> Any:
            if isinstance(callback, Batched):
                return put(request, batched(callback), *args, **kw)

            def done(r: Any) -> None:
                report(r)
                callback(r)

            return put(request, done, *args, **kw)

        return put_reporting

    writer.notify_nowait = reporting(writer.notify_nowait)
    writer.notify = reporting(writer.notify)


def main_gateway(home: str, run: str, threads: str, phase: str, start: str) -> None:
    import walspool
    from walspool.hermes import install

    home_path = Path(home)
    store = gateway_store(home_path)
    spool = walspool.Spool(home_path / "spool.db")
    hook_spool(spool)
    report_evictions(spool)
    live_write = store._append_transcript_message

    def reporting_write(session_id: str, msg: dict[str, Any]) -> None:
        live_write(session_id, msg)
        run_, i = parse(msg["content"])
        say(f"L {session_id} {run_} {i}")

    store._append_transcript_message = reporting_write
    link = install(store, spool, recover=False, retry_interval=0)
    hook_sink(link.replayer.sink)
    broken = start == "broken"
    set_db_state(store, broken)
    say("P ready")
    link.recover()
    run_no, phase_len = int(run), int(phase)

    def feed(t: int) -> None:
        nonlocal broken
        sessions = thread_sessions("g", t, 2)
        i = 0
        while True:
            s = sessions[i % 2]
            store.append_to_transcript(s, message(run_no, t, i))
            i += 1
            if t == 0 and i % phase_len == 0:
                broken = not broken
                set_db_state(store, broken)
                say(f"P {'broken' if broken else 'healed'}")

    for t in range(int(threads)):
        threading.Thread(target=feed, args=(t,), daemon=True).start()
    threading.Event().wait()  # until killed


def main_finish(home: str) -> None:
    """Heal state.db, start the gateway once more and let ``install`` recover the spool."""
    import msgspec

    import walspool
    from walspool.hermes import install

    home_path = Path(home)
    store = gateway_store(home_path)
    set_db_state(store, broken=False)
    with walspool.Spool(home_path / "spool.db") as spool:
        link = install(store, spool, recover=False, retry_interval=0)
        hook_sink(link.replayer.sink)
        report = link.recover()
    store._db.close()
    say("R " + msgspec.json.encode(report).decode())


# -- importing upstream's JSON spool -------------------------------------------------


def main_import(spool_path: str, directory: str, batch_files: str) -> None:
    import walspool
    from walspool.replay.jsonspool import import_json_spool

    spool = walspool.Spool(spool_path)
    append_many = spool.append_many

    def crashing_append_many(*args: Any, **kw: Any) -> Any:
        hit("before_append")
        result = append_many(*args, **kw)
        hit("after_append")
        return result

    spool.append_many = crashing_append_many
    real_unlink = os.unlink

    def crashing_unlink(name: Any, *, dir_fd: int | None = None) -> None:
        hit("unlink")
        real_unlink(name, dir_fd=dir_fd)

    os.unlink = crashing_unlink
    say("P ready")
    report = import_json_spool(
        spool,
        directory,
        batch_files=int(batch_files),
        progress=lambda done, total: say(f"P {done} {total}"),
    )
    spool.close()
    say(f"P imported {report.imported} skipped {len(report.skipped)}")


MODES = {
    "append": main_append,
    "replay": main_replay,
    "gateway": main_gateway,
    "finish": main_finish,
    "import": main_import,
}

if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)
    MODES[sys.argv[1]](*sys.argv[2:])
