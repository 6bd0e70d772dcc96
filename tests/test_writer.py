"""Durability of the write path: killed writers, full disks, group commit."""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import weakref
from types import SimpleNamespace

import apsw
import pytest
from _gateway import found_locked
from _helpers import ROOT, child_deadline, run_python
from _lock_holder import write_lock_held

import walspool
import walspool.store.writer as walspool_writer
from walspool.store.writer import Append, Batched, NotInTime, Operation, SpoolBusy

WRITER_CHILD = r"""
import sys, threading, walspool
path, threads = sys.argv[1], int(sys.argv[2])
spool = walspool.Spool(path, durability=sys.argv[3])
lock = threading.Lock()
def work(t):
    i = 0
    while True:
        r = spool.append(f"s{t % 4}", {"t": t, "i": i, "pad": "x" * 300})
        with lock:
            sys.stdout.write(f"{r.session_id} {r.seq} {t} {i}\n")
            sys.stdout.flush()
        i += 1
for t in range(threads):
    threading.Thread(target=work, args=(t,), daemon=True).start()
threading.Event().wait()
"""


@pytest.mark.parametrize("threads,durability", [(1, "full"), (8, "normal")])
def test_sigkill_mid_stream_loses_no_acknowledged_append(spool_path, threads, durability):
    spool_path.parent.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER_CHILD, str(spool_path), str(threads), durability],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    acked = []
    try:
        with child_deadline(proc, what="the writer"):  # a hung writer fails, not hangs
            for line in proc.stdout:
                acked.append(line.split())
                if len(acked) >= 1500:
                    break
            proc.send_signal(signal.SIGKILL)
            # receipts printed before the kill landed are acknowledged too
            acked += [line.split() for line in proc.stdout if line.endswith("\n")]
    finally:
        proc.kill()
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    with walspool.Spool(spool_path) as spool:
        stored = {(r.session_id, r.seq): r.message for r in spool.records()}
        by_session: dict[str, list[int]] = {}
        for r in spool.records():
            by_session.setdefault(r.session_id, []).append(r.seq)
    for session, seq, t, i in acked:
        msg = stored[(session, int(seq))]
        assert (msg["t"], msg["i"]) == (int(t), int(i))
    for session, seqs in by_session.items():
        assert seqs == list(range(1, len(seqs) + 1)), session
    # each producer's messages keep their order, no duplicates
    for t in range(threads):
        mine = [m["i"] for m in stored.values() if m["t"] == t]
        assert sorted(mine) == list(range(len(mine)))


FULL_DISK_CHILD = r"""
import os, resource, signal, sys, walspool
path = sys.argv[1]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
spool = walspool.Spool(path)
acked = 0
limit = 2 * 1024 * 1024  # about 12 KiB of WAL per commit
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    while True:
        spool.append("s", {"i": acked, "pad": "y" * 400})
        acked += 1
except walspool.DiskFull as exc:
    print(acked, type(exc).__name__, exc.path, "|", exc, flush=True)
try:
    spool.append("s", {"i": -1})
except walspool.WalspoolError as exc:
    print("again", type(exc).__name__, flush=True)
"""


def test_full_disk_raises_and_keeps_committed_rows(spool_path):
    out = run_python(FULL_DISK_CHILD, str(spool_path))
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    acked = int(first.split()[0])
    assert first.split()[1] == "DiskFull" and str(spool_path) in first
    assert "nothing stored was lost" in first
    assert second == "again DiskFull"
    assert acked > 100
    with walspool.Spool(spool_path) as spool:
        got = [r.message["i"] for r in spool.records()]
        assert got == list(range(acked))
        assert spool.append("s", {"i": acked}).seq == acked + 1
    conn = apsw.Connection(str(spool_path))
    assert conn.execute("PRAGMA integrity_check").get == "ok"
    conn.close()


def _pause_commits(writer, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Step the writer: each commit sets ``taken`` (its group has left the queue) and
    waits for ``go`` before it starts its transaction."""
    taken, go = threading.Event(), threading.Event()
    commit = writer._commit

    def paused(requests):
        taken.set()
        assert go.wait(60), "the test never let the commit go on"
        commit(requests)

    monkeypatch.setattr(writer, "_commit", paused)
    return taken, go


def _until(condition, what: str) -> None:
    """Poll ``condition`` (a state another thread reaches) for at most 30 s."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.001)


def test_concurrent_appenders_share_commits(spool):
    """Group commit, step by step: 64 threads append while a commit is running (held
    here); once it ends, all 64 appends commit together, in one transaction. (With
    free-running threads the grouping depends on how slow a commit is: on tmpfs it
    often is not, and each thread commits alone.)"""
    commits = []
    spool._conn.set_wal_hook(lambda conn, db, pages: commits.append(pages) or 0)
    writer = spool._writer
    threads = [threading.Thread(target=spool.append, args=(f"s{i}", {"i": i})) for i in range(64)]
    with writer._commit_lock:
        for t in threads:
            t.start()
        _until(lambda: len(writer._pending) == 64, "64 appends queued")
    for t in threads:
        t.join(60)
    assert spool.stats().rows == 64
    assert len(commits) == 1


def test_lone_caller_pays_one_commit_per_append(spool):
    commits = []
    spool._conn.set_wal_hook(lambda conn, db, pages: commits.append(pages) or 0)
    for i in range(50):
        spool.append("s", {"i": i})
    assert len(commits) == 50


def test_failed_request_fails_alone_in_its_group(spool_path):
    with walspool.Spool(spool_path, max_bytes=128 * 1024) as spool:
        big = {"pad": "z" * 200_000}
        small = [spool.submit("s", {"i": i}) for i in range(5)]
        doomed = spool.submit("s", big)
        after = [spool.submit("t", {"i": i}) for i in range(5)]
        assert [f.result(30).seq for f in small] == [1, 2, 3, 4, 5]
        with pytest.raises(walspool.SpoolFull):
            doomed.result(30)
        assert [f.result(30).seq for f in after] == [1, 2, 3, 4, 5]
        with pytest.raises(walspool.SpoolFull):
            spool.append_many([("u", {"i": 1}), ("u", big)])
        assert list(spool.records(session_id="u")) == []


def test_a_failure_while_describing_a_failure_still_reaches_the_caller(spool_path):
    """The writer never dies with waiters left behind, even if mapping an error fails
    (asking SQLite about it fails too): the caller gets the failure named as well as
    it can be without asking, the cap's SQLITE_FULL as a full disk, with its spool
    and session."""
    with walspool.Spool(spool_path, max_bytes=64 * 1024) as spool:

        def broken_error(exc, request):
            raise apsw.IOError("disk gone while asking why")

        spool._writer._error = broken_error
        with pytest.raises(walspool.DiskFull, match="no room to write") as caught:
            spool.submit("s", {"pad": "z" * 200_000}).result(30)
        assert caught.value.path == str(spool_path) and caught.value.session_id == "s"
        assert str(spool_path) in str(caught.value)
        assert spool._writer._thread.is_alive()
        assert spool.append("s", {"i": 1}).seq == 1


# -- a write lock held by another process -------------------------------------


@pytest.fixture
def short_busy(monkeypatch: pytest.MonkeyPatch) -> float:
    """A busy bound short enough for a test; the production default is 10 s."""
    monkeypatch.setattr(walspool_writer, "BUSY_RETRY_SECONDS", 0.5)
    return 0.5


def test_a_write_lock_held_elsewhere_fails_with_spool_busy_after_the_bound(spool_path, short_busy):
    with walspool.Spool(spool_path) as spool, write_lock_held(spool_path):
        started = time.monotonic()
        future = spool.submit("s", {"i": 1})
        with pytest.raises(SpoolBusy, match="-readonly") as caught:
            future.result(30)
        waited = time.monotonic() - started
        assert short_busy <= waited < short_busy + 5
        assert caught.value.path == str(spool_path) and caught.value.session_id == "s"
        assert caught.value.seconds == short_busy
        assert isinstance(caught.value, walspool.WalspoolError)
        with pytest.raises(SpoolBusy):  # the blocking path is bounded the same way
            spool.append("s", {"i": 2})
        assert spool._writer.busy_since is not None
    with walspool.Spool(spool_path) as spool:
        assert spool.append("s", {"i": 3}).seq == 1  # nothing of the failed ones stayed
        assert spool._writer.busy_since is None


def test_a_group_failing_on_a_held_lock_names_each_requests_own_session(spool_path, short_busy):
    """A group waits for the lock once and fails as a whole; each caller's error still
    names the session of its own message."""
    with walspool.Spool(spool_path) as spool, write_lock_held(spool_path):
        with spool._writer._commit_lock:  # both queued: one group
            futures = {session_id: spool.submit(session_id, {"i": 0}) for session_id in "st"}
        for session_id, future in futures.items():
            with pytest.raises(SpoolBusy) as caught:
                future.result(30)
            assert caught.value.session_id == session_id
            assert caught.value.path == str(spool_path)
            assert caught.value.seconds == short_busy


def test_appends_queued_before_the_path_changed_are_refused_when_their_group_commits(
    spool_path,
):
    """The path check is made once per group, just before its transaction: appends that
    were queued while the path still named the spool's file, and an `append_async`, are
    refused (each error naming its own session) once the file is moved before their
    commit, and none of them is written to the moved file; an operation in the same group
    still runs there (``transact`` acts on the file this Spool opened)."""
    moved = spool_path.with_name("moved.db")
    with walspool.Spool(spool_path) as spool:
        spool.append("s", {"i": 0})

        async def append_async() -> None:
            await spool.append_async("u", {"i": 3})

        with spool._writer._commit_lock:  # all queued: one group
            futures = {session_id: spool.submit(session_id, {"i": 1}) for session_id in "st"}
            counted = spool._writer.submit(
                Operation(lambda conn: conn.execute("SELECT count(*) FROM records").get)
            )
            for suffix in ("", "-wal", "-shm"):
                os.rename(f"{spool_path}{suffix}", f"{moved}{suffix}")
        for session_id, future in futures.items():
            with pytest.raises(walspool.SpoolReplaced, match="no longer names") as caught:
                future.result(30)
            assert caught.value.session_id == session_id
            assert caught.value.path == str(spool_path)
        assert counted.result(30) == 1
        with pytest.raises(walspool.SpoolReplaced) as caught:
            asyncio.run(append_async())
        assert caught.value.session_id == "u"
    with walspool.Spool(moved) as old:
        assert [(r.session_id, r.message) for r in old.records()] == [("s", {"i": 0})]


@pytest.mark.parametrize("where", ["on the caller's thread", "queued behind a waiting group"])
def test_a_commit_asked_within_a_bound_fails_not_in_time_and_never_lands_later(
    spool_path, monkeypatch, where
):
    """``put_within`` while another process holds the write lock (longer than the
    bound, shorter than the busy bound): ``NotInTime``, and nothing of it is written
    once the lock is free, whether it waited for the lock itself or behind a group that
    does (taken back from the queue). What was queued without a bound still lands."""
    monkeypatch.setattr(walspool_writer, "BUSY_RETRY_SECONDS", 60.0)
    with walspool.Spool(spool_path) as spool:
        row = spool.prepare("s", {"i": "timed"}, walspool.CAP_DROP)
        with write_lock_held(spool_path) as holder:
            waiting = None
            if where == "queued behind a waiting group":
                waiting = spool.submit("s", {"i": "untimed"})
                assert found_locked(spool)  # the writer waits for the lock with it
            with pytest.raises(NotInTime) as caught:
                spool.put_within(row, 0.2)
            assert caught.value.session_id == "s" and caught.value.seconds == 0.2
            assert "nothing was written" in str(caught.value)
            holder.release()
            if waiting is not None:
                assert waiting.result(30).seq == 1
        spool.flush()
        assert [r.message["i"] for r in spool.records()] == (["untimed"] if waiting else [])
        receipt = spool.put_within(row, 30)  # the lock free: committed in time
        assert [r.message["i"] for r in spool.records()][-1] == "timed"
        assert receipt.seq == (2 if waiting else 1)


def test_a_commit_within_a_bound_on_a_full_queue_is_refused_at_once(spool, monkeypatch):
    monkeypatch.setattr(walspool_writer, "QUEUE_REQUESTS", 1)
    row = spool.prepare("s", {"i": 0}, walspool.CAP_DROP)
    with spool._writer._commit_lock:  # the writer (any committer) is busy
        spool.submit("s", {"i": 1})
        with pytest.raises(queue.Full):
            spool.put_within(row, 30)
    spool.flush()
    assert [r.message["i"] for r in spool.records()] == [1]


def test_waiters_wake_as_soon_as_the_lock_is_released(spool_path, monkeypatch):
    monkeypatch.setattr(walspool_writer, "BUSY_RETRY_SECONDS", 60.0)
    with walspool.Spool(spool_path) as spool:
        with write_lock_held(spool_path) as holder:
            futures = [spool.submit("s", {"i": i}) for i in range(5)]
            holder.release()
            assert [f.result(30).seq for f in futures] == [1, 2, 3, 4, 5]
        assert [r.message["i"] for r in spool.records()] == [0, 1, 2, 3, 4]


def test_notify_nowait_raises_full_instead_of_waiting(spool_path, monkeypatch):
    """Step by step: the writer holds one group, the queue (one request) one more; the
    third ``notify_nowait`` raises at once, and the two accepted commit in order."""
    monkeypatch.setattr(walspool_writer, "QUEUE_REQUESTS", 1)
    committed: list[int] = []
    with walspool.Spool(spool_path) as spool:
        writer = spool._writer
        taken, go = _pause_commits(writer, monkeypatch)

        def notify(i: int) -> None:
            writer.notify_nowait(
                Append((spool._row("s", {"i": i}, walspool.CAP_DROP, None),), single=True),
                lambda request: committed.append(request.result.seq),
            )

        notify(0)
        assert taken.wait(30)  # the writer holds the first; the queue is empty again
        notify(1)
        with pytest.raises(queue.Full):
            notify(2)
        assert len(writer._pending) == 1
        go.set()
        spool.flush()
        assert committed == [1, 2]
        assert [r.message["i"] for r in spool.records()] == [0, 1]


@pytest.mark.parametrize("group_rows", [None, 1])
def test_close_is_bounded_and_logs_what_was_not_committed(
    spool_path, monkeypatch, caplog, group_rows
):
    """With ``group_rows`` 1, each request fails in a group of its own after close gave
    up: the count adds them all up."""
    monkeypatch.setattr(walspool_writer, "BUSY_RETRY_SECONDS", 60.0)
    monkeypatch.setattr(walspool_writer, "CLOSE_TIMEOUT", 0.5)
    if group_rows is not None:
        monkeypatch.setattr(walspool_writer, "GROUP_ROWS", group_rows)
    spool = walspool.Spool(spool_path)
    with write_lock_held(spool_path):
        futures = [spool.submit("s", {"i": i}) for i in range(3)]
        # Two messages in one request, and an operation, which holds none.
        rows = tuple(spool._row("t", {"i": i}, walspool.CAP_DROP, None) for i in range(2))
        futures.append(spool._writer.submit(Append(rows, single=False)))
        futures.append(spool._writer.submit(Operation(lambda conn: None)))
        started = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="walspool.writer"):
            spool.close()
        assert time.monotonic() - started < 0.5 + walspool_writer.CLOSE_GRACE + 2
        for future, session_id in zip(futures, ["s", "s", "s", "t", None], strict=True):
            with pytest.raises(walspool.SpoolClosed) as caught:
                future.result(0)
            assert str(caught.value) == (
                f"spool {spool_path} was closed before this message was committed "
                "(its write lock was held elsewhere)"
            )
            assert caught.value.path == str(spool_path)
            assert caught.value.session_id == session_id
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert errors == [
            f"spool {spool_path}: closed after waiting 0.5 s for its write lock; 5 accepted "
            "message(s) were not committed"
        ]
    with walspool.Spool(spool_path) as spool:
        assert spool.stats().rows == 0


def test_a_producer_waiting_for_room_wakes_when_the_lock_is_found_held(spool_path, monkeypatch):
    """Step by step: the writer has taken a group, the queue is full again and a producer
    waits for room; the writer's commit then finds the write lock held elsewhere, so no
    room comes soon: the producer wakes with False at once, not at its timeout."""
    monkeypatch.setattr(walspool_writer, "QUEUE_REQUESTS", 1)
    monkeypatch.setattr(walspool_writer, "BUSY_RETRY_SECONDS", 60.0)
    with walspool.Spool(spool_path) as spool, write_lock_held(spool_path) as holder:
        writer = spool._writer
        taken, go = _pause_commits(writer, monkeypatch)
        first = spool.submit("s", {"i": 0})
        assert taken.wait(30)
        second = spool.submit("s", {"i": 1})
        assert not writer.has_room()
        answers: list[bool] = []
        producer = threading.Thread(target=lambda: answers.append(writer.wait_for_room(60)))
        producer.start()
        _until(lambda: writer._cond._waiters, "the producer waits for room")
        assert writer.busy_since is None
        go.set()  # the commit starts and meets the lock
        producer.join(30)
        assert not producer.is_alive(), "the producer slept on while the lock was held"
        assert answers == [False]
        assert writer.busy_since is not None
        holder.release()
        assert [first.result(30).seq, second.result(30).seq] == [1, 2]
        assert writer.busy_since is None


def test_busy_waits_back_off_from_1_ms_to_the_poll_bound_and_end_at_the_deadline(
    spool, monkeypatch
):
    """The busy handler's schedule, on a stepped clock: pauses of 1, 2, 4 ... ms up to
    ``BUSY_POLL_SECONDS``, never past the commit's deadline; at the deadline, or once
    ``close`` gives up (the pause ends early), it tells SQLite to stop waiting."""
    writer = spool._writer
    now = [1000.0]
    monkeypatch.setattr(walspool_writer, "time", SimpleNamespace(monotonic=lambda: now[0]))
    pauses: list[float] = []
    given_up = [False]

    class Abandon:  # records each pause instead of sleeping it
        def is_set(self) -> bool:
            return False

        def wait(self, seconds: float) -> bool:
            pauses.append(seconds)
            return given_up[0]

    monkeypatch.setattr(writer, "_abandon", Abandon())
    monkeypatch.setattr(writer, "_busy_deadline", 1001.0)
    assert all(writer._on_busy(calls) for calls in range(13))
    assert pauses == pytest.approx([0.001, 0.002, 0.004, 0.008, 0.016, 0.032] + [0.05] * 7)
    assert writer.busy_since == 1000.0  # the first call marks the lock found held
    now[0] = 1000.99  # 10 ms before the deadline: the pause ends there
    assert writer._on_busy(20)
    assert pauses[-1] == pytest.approx(0.01)
    now[0] = 1001.0  # at the deadline: no more waiting
    assert not writer._on_busy(21)
    assert len(pauses) == 14
    now[0] = 1000.5
    given_up[0] = True  # ``close`` gives up during the pause
    assert not writer._on_busy(3)
    assert writer.busy_since == 1000.0
    writer.busy_since = None


# -- the queue's bounds and what an idle writer holds -------------------------


def _eviction(spool: walspool.Spool, i: int, pad: int = 400) -> Append:
    """One message as the gateway link hands it over: about ``pad`` payload bytes."""
    return Append((spool._row("s", {"i": i, "pad": "x" * pad}, walspool.CAP_DROP, None),), True)


def test_notify_nowait_raises_full_on_the_byte_bound(spool, monkeypatch):
    """Two messages of ~430 bytes fill a 1,000-byte queue, far below its request bound."""
    monkeypatch.setattr(walspool_writer, "QUEUE_BYTES", 1000)
    writer = spool._writer
    committed: list[int] = []
    with writer._commit_lock:  # the writer is held up: nothing leaves the queue
        for i in range(2):
            writer.notify_nowait(_eviction(spool, i), lambda r: committed.append(r.result.seq))
        with pytest.raises(queue.Full):
            writer.notify_nowait(_eviction(spool, 2), lambda r: committed.append(r.result.seq))
        assert len(writer._pending) == 2 < walspool_writer.QUEUE_REQUESTS
        # no room for the message just refused, and none comes while the writer is held
        assert not writer.has_room()
        assert not writer.wait_for_room(0.1)
    spool.flush()
    assert committed == [1, 2]
    assert writer.has_room()  # this thread's last put found room


def test_a_batched_callback_runs_once_per_group_with_its_requests_in_order(spool, caplog):
    writer = spool._writer
    calls: list[list[int]] = []
    batched = Batched(lambda requests: calls.append([r.result.seq for r in requests]))
    single: list[int] = []
    with writer._commit_lock:  # held up: everything below is one group
        for i in range(5):
            writer.notify_nowait(_eviction(spool, i), batched)
        writer.notify_nowait(_eviction(spool, 5), lambda r: single.append(r.result.seq))
        writer.notify_nowait(_eviction(spool, 6), batched)
    spool.flush()
    assert calls == [[1, 2, 3, 4, 5, 7]] and single == [6]
    # A callback that raises is logged; the writer and later groups go on.
    failing = Batched(lambda requests: 1 / 0)
    with caplog.at_level(logging.ERROR, logger="walspool.writer"):
        writer.notify_nowait(_eviction(spool, 7), failing)
        spool.flush()
    assert "callback for 1 committed spool requests failed" in caplog.text
    writer.notify_nowait(_eviction(spool, 8), batched)
    spool.flush()
    assert calls == [[1, 2, 3, 4, 5, 7], [9]]


def test_a_thread_that_never_put_asks_for_room_for_a_request_with_no_payload(spool, monkeypatch):
    """A queue filled to its byte bound exactly still has room for a request with no
    payload, which is what ``has_room`` answers on a thread with nothing refused."""
    writer = spool._writer
    request = _eviction(spool, 0)
    monkeypatch.setattr(walspool_writer, "QUEUE_BYTES", request.payload_bytes)
    answers: list[bool] = []
    with writer._commit_lock:  # the writer is held up: nothing leaves the queue
        writer.notify_nowait(request, lambda r: None)
        assert writer._pending_bytes == walspool_writer.QUEUE_BYTES
        other = threading.Thread(
            target=lambda: answers.extend([writer.has_room(), writer.wait_for_room(0)])
        )
        other.start()
        other.join(30)
        # This thread: refused a message, then put an operation (no payload) that fit;
        # it now asks for room as for a request with no payload again.
        with pytest.raises(queue.Full):
            writer.notify_nowait(_eviction(spool, 1), lambda r: None)
        assert not writer.has_room()
        writer.notify_nowait(Operation(lambda conn: None), lambda r: None)
        assert writer.has_room() and writer.wait_for_room(0)
    assert answers == [True, True]
    spool.flush()


def test_a_producer_waits_for_room_in_bytes(spool, monkeypatch):
    monkeypatch.setattr(walspool_writer, "QUEUE_BYTES", 1000)
    writer = spool._writer
    futures = []
    with writer._commit_lock:
        futures += [spool.submit("s", {"i": i, "pad": "x" * 400}) for i in range(2)]
        producer = threading.Thread(
            target=lambda: futures.append(spool.submit("s", {"i": 2, "pad": "x" * 400}))
        )
        producer.start()
        # Held up, the producer stays blocked whatever the bound; a queue that ignored
        # bytes would have let it return at once.
        producer.join(0.3)
        assert producer.is_alive()
        assert len(writer._pending) == 2
    producer.join(30)
    assert not producer.is_alive()
    assert [f.result(30).seq for f in futures] == [1, 2, 3]
    assert writer._pending_bytes == 0


def test_a_request_larger_than_the_byte_bound_is_taken_alone(spool, monkeypatch):
    monkeypatch.setattr(walspool_writer, "QUEUE_BYTES", 100)
    writer = spool._writer
    committed: list[int] = []
    with writer._commit_lock:
        writer.notify_nowait(_eviction(spool, 0), lambda r: committed.append(r.result.seq))
        with pytest.raises(queue.Full):
            writer.notify_nowait(_eviction(spool, 1), lambda r: committed.append(r.result.seq))
    spool.flush()
    assert committed == [1]
    assert spool.submit("s", {"pad": "y" * 5000}).result(30).seq == 2
    receipts = spool.append_many([("s", {"pad": "z" * 400}) for _ in range(3)])
    assert [r.seq for r in receipts] == [3, 4, 5]


class _Rows(list):
    """Rows a weak reference can follow (a tuple cannot)."""


@pytest.mark.parametrize("path", ["writer thread", "caller's thread"])
def test_the_writer_keeps_no_reference_to_a_committed_group(spool, path):
    """Once its waiters are woken, nothing of a group stays referenced by the writer,
    so an idle writer holds no payloads."""
    writer = spool._writer
    released = threading.Event()

    def make() -> tuple[weakref.ref[_Rows], Append]:
        rows = _Rows([spool._row("s", {"pad": "x" * 100_000}, walspool.CAP_DROP, None)])
        return weakref.ref(rows, lambda _: released.set()), Append(rows, single=False)

    ref, request = make()
    if path == "writer thread":
        with writer._commit_lock:  # queued, so the writer thread takes it
            future = writer.submit(request)
        del request
        assert [r.seq for r in future.result(30)] == [1]
    else:
        assert [r.seq for r in writer.call(request)] == [1]
        del request
    assert released.wait(30), "the writer still refers to a committed request"
    assert ref() is None
    assert not writer._pending and writer._pending_bytes == 0


@pytest.mark.parametrize(("durability", "pragmas"), [("full", (2, 1, 1)), ("normal", (1, 0, 0))])
def test_durability_sets_the_sync_pragmas(tmp_path, durability, pragmas):
    """FULL: every commit fsyncs, and asks for F_FULLFSYNC where there is one (macOS)."""
    with walspool.Spool(tmp_path / "s.db", durability=durability) as spool:
        conn = spool._writer._conn
        got = tuple(
            conn.execute(f"PRAGMA {name}").get
            for name in ("synchronous", "fullfsync", "checkpoint_fullfsync")
        )
    assert got == pragmas


# -- asyncio callers ------------------------------------------------------------


def test_an_async_append_on_a_full_queue_waits_off_the_event_loop(spool, monkeypatch):
    """While the queue is full, ``append_async`` waits for room on an executor thread:
    the event loop runs other work meanwhile, and the message is committed in order."""
    monkeypatch.setattr(walspool_writer, "QUEUE_REQUESTS", 1)
    writer = spool._writer
    held, release, gave_up = threading.Event(), threading.Event(), threading.Event()

    def hold_the_writer() -> None:  # nothing leaves the queue until ``release``
        with writer._commit_lock:
            held.set()
            if not release.wait(10):
                gave_up.set()  # the event loop was blocked: let it go, and fail below

    holder = threading.Thread(target=hold_the_writer)
    holder.start()
    assert held.wait(30)

    async def main() -> list[int]:
        first = asyncio.ensure_future(spool.append_async("s", {"i": 0}))
        second = asyncio.ensure_future(spool.append_async("s", {"i": 1}))
        while len(writer._pending) < 1:
            await asyncio.sleep(0)
        for _ in range(10):  # the loop goes on running other work
            await asyncio.sleep(0)
        assert not gave_up.is_set(), "the event loop was blocked by a full queue"
        assert not second.done() and len(writer._pending) == 1
        release.set()
        receipts = await asyncio.wait_for(asyncio.gather(first, second), 30)
        return [r.seq for r in receipts]

    assert asyncio.run(main()) == [1, 2]
    holder.join(30)
    assert [r.message["i"] for r in spool.records()] == [0, 1]


def test_a_cancelled_async_append_is_still_committed_and_others_in_its_group_resolve(spool):
    """Cancelling the awaiting task does not take the message back, and the other
    callers acknowledged by the same group still get their receipts."""
    writer = spool._writer

    async def main() -> list[int]:
        with writer._commit_lock:  # all three land in one group
            tasks = [asyncio.ensure_future(spool.append_async("s", {"i": i})) for i in range(3)]
            while len(writer._pending) < 3:
                await asyncio.sleep(0)
            tasks[0].cancel()
            await asyncio.sleep(0)
        receipts = await asyncio.wait_for(asyncio.gather(*tasks[1:]), 10)
        assert tasks[0].cancelled()
        return [r.seq for r in receipts]

    assert asyncio.run(main()) == [2, 3]
    spool.flush()
    assert [r.message["i"] for r in spool.records()] == [0, 1, 2]


def test_the_async_appends_of_one_pass_of_the_loop_wake_the_writer_once_and_commit_together(
    spool,
):
    """``append_async`` queues at once but wakes the writer only when the loop's pass
    ends: 64 tasks appending in one pass wake it once, with all 64 queued, and share one
    commit. (Woken at the first, the writer would take what was queued by the time it
    got the GIL back from the loop, and the rest would wait for a second commit.)"""
    writer = spool._writer
    commits = []
    spool._conn.set_wal_hook(lambda conn, db, pages: commits.append(pages) or 0)
    wakes = []  # the requests queued at each wake of the writer
    notify_all = writer._cond.notify_all

    def counting_notify_all() -> None:
        wakes.append(len(writer._pending))
        notify_all()

    writer._cond.notify_all = counting_notify_all

    async def main() -> list[walspool.Receipt]:
        appends = [spool.append_async(f"s{i}", {"i": i}) for i in range(64)]
        return await asyncio.wait_for(asyncio.gather(*appends), 30)

    try:
        receipts = asyncio.run(main())
    finally:
        del writer._cond.notify_all
    assert wakes[0] == 64
    assert len(commits) == 1
    assert sorted((r.session_id, r.seq) for r in receipts) == sorted(
        (f"s{i}", 1) for i in range(64)
    )
    assert getattr(writer._wakes, "loop", None) is None  # its wake has run


def test_an_async_append_whose_loop_stops_before_its_wake_is_committed_by_the_next(spool):
    """A loop closed before the end of the pass that queued a request never wakes the
    writer for it; the request stays queued, and the next wake (anyone's request, or
    ``close``) commits it: nothing accepted is dropped."""
    loop = asyncio.new_event_loop()
    task = loop.create_task(spool.append_async("s", {"i": 0}))
    loop.call_soon(loop.stop)  # runs in the pass that runs the task's first step
    loop.run_forever()
    assert len(spool._writer._pending) == 1  # queued, its wake still to come
    loop.close()
    task._log_destroy_pending = False  # its caller is gone with the loop: no warning
    spool.append("t", {"i": 1})
    assert [(r.session_id, r.seq) for r in spool.records()] == [("s", 1), ("t", 1)]


def test_an_async_request_that_fails_raises_its_error_in_the_caller(spool):
    class Refused(Exception):
        pass

    def refuse(conn):
        raise Refused("no")

    async def main() -> None:
        with pytest.raises(Refused, match="no"):
            await asyncio.wait_for(spool._writer.call_async(Operation(refuse)), 10)
        receipt = await asyncio.wait_for(spool.append_async("s", {"i": 0}), 30)
        assert receipt.seq == 1  # the writer goes on

    asyncio.run(main())


async def awaited(call_async, request):
    """What ``call_async(request)`` gives, awaited on the running loop."""
    return await call_async(request)


def test_a_closed_writer_refuses_every_request_naming_its_session(spool_path):
    """After ``close``, each way in raises ``SpoolClosed`` for the request's session."""
    spool = walspool.Spool(spool_path)
    writer = spool._writer
    row = spool._row("s", {"i": 0}, walspool.CAP_DROP, None)
    spool.close()
    ways = {
        "call": lambda request: writer.call(request),
        "submit": lambda request: writer.submit(request),
        "notify": lambda request: writer.notify(request, lambda r: None),
        "notify_nowait": lambda request: writer.notify_nowait(request, lambda r: None),
        "call_async": lambda request: asyncio.run(awaited(writer.call_async, request)),
    }
    for way, put in ways.items():
        with pytest.raises(walspool.SpoolClosed, match="is closed") as caught:
            put(Append((row,), single=True))
        assert caught.value.session_id == "s", way
        assert caught.value.path == str(spool_path), way
    assert not writer._pending


def test_the_writer_looks_up_the_next_id_and_a_streams_next_seq_once(spool):
    """While no other connection commits, the ids and seqs handed out are remembered
    across transactions: later appends run no lookup but for a new stream, and the
    numbers stay consecutive."""
    assert (spool.append("s", {"i": 0}).id, spool.append("s", {"i": 1}).seq) == (1, 2)
    statements: list[str] = []

    def trace(cursor, sql, bindings) -> bool:
        statements.append(sql)
        return True

    spool._writer._conn.exec_trace = trace
    try:
        receipts = [spool.append("s", {"i": i}) for i in range(2, 5)]
        receipts.append(spool.append("t", {"i": 0}))
    finally:
        spool._writer._conn.exec_trace = None
    assert [(r.id, r.session_id, r.seq) for r in receipts] == [
        (3, "s", 3),
        (4, "s", 4),
        (5, "s", 5),
        (6, "t", 1),
    ]
    lookups = [s for s in statements if s == walspool_writer.MAX_ID_SQL or "max(seq)" in s]
    assert lookups == [walspool_writer.NEXT_SEQ_BY_ID_SQL]  # for "t" alone


def test_a_group_stops_at_group_rows_and_notify_calls_back_after_its_commit(spool, monkeypatch):
    """Five one-row requests queued behind a held writer commit as groups of at most
    ``GROUP_ROWS`` (3 here), in order; each ``notify`` callback runs after its commit."""
    monkeypatch.setattr(walspool_writer, "GROUP_ROWS", 3)
    writer = spool._writer
    groups: list[list[int]] = []
    single: list[int] = []
    batched = Batched(lambda requests: groups.append([r.result.seq for r in requests]))
    with writer._commit_lock:  # nothing leaves the queue until all five are in
        for i in range(5):
            writer.notify(_eviction(spool, i), batched)
        writer.notify(_eviction(spool, 5), lambda request: single.append(request.result.seq))
    spool.flush()
    assert groups == [[1, 2, 3], [4, 5]]
    assert single == [6]
    receipt = spool.append("s", {"i": 6})
    (record,) = [r for r in spool.records() if r.seq == receipt.seq]
    assert receipt.created_at == record.created_at


@pytest.mark.parametrize("queued_first", [1, 2])
def test_a_caller_committing_on_its_own_thread_takes_and_wakes_what_was_queued(spool, queued_first):
    """Step by step: a blocking caller finds the queue empty and commits on its own
    thread; requests queued meanwhile (before its take) go in its group, first, and
    their futures are resolved by that caller."""
    writer = spool._writer
    check_open = writer._check_open
    futures: list = []
    queued = threading.Event()

    def queue_some_first(request) -> None:
        check_open(request)
        if not queued.is_set() and writer._commit_lock.locked():  # in the caller's commit
            queued.set()
            futures.extend(spool.submit("s", {"i": i}) for i in range(queued_first))

    writer._check_open = queue_some_first
    try:
        receipt = spool.append("s", {"i": queued_first})
    finally:
        writer._check_open = check_open
    assert [f.result(10).seq for f in futures] == list(range(1, queued_first + 1))
    assert receipt.seq == queued_first + 1
    assert [r.message["i"] for r in spool.records()] == list(range(queued_first + 1))


# -- errors the writer hands back, and operations in a group -------------------


def test_a_spool_at_max_bytes_fails_with_spool_full_naming_the_cap(spool_path):
    with walspool.Spool(spool_path, max_bytes=128 * 1024) as spool:
        with pytest.raises(walspool.SpoolFull) as caught:
            spool.append("s", {"pad": "z" * 200_000})
    assert caught.value.limit == 128 * 1024
    assert caught.value.path == str(spool_path) and caught.value.session_id == "s"
    assert "max_bytes=131072" in str(caught.value)
    assert isinstance(caught.value.__cause__, apsw.FullError)


def test_sqlite_full_is_the_caps_when_the_requests_pages_and_8_more_reach_the_limit(spool_path):
    """SQLITE_FULL comes from ``max_bytes`` (``SpoolFull``) or from the disk
    (``DiskFull``): the writer calls it the cap's when the pages in use, the request's
    payload in pages and 8 pages of slack reach ``max_page_count``."""
    with walspool.Spool(spool_path, max_bytes=1024 * 1024) as spool:
        writer = spool._writer
        conn = writer._conn
        page_size = conn.execute("PRAGMA page_size").get
        pages = conn.execute("PRAGMA page_count").get
        request = _eviction(spool, 0)
        request.payload_bytes = 3 * page_size + page_size // 2  # 3 whole pages
        limits = {}
        for limit in (pages + 3 + 7, pages + 3 + 8, pages + 3 + 9):
            conn.execute(f"PRAGMA max_page_count = {limit}")
            limits[limit - pages - 3] = writer._at_max_bytes(request)
    assert limits == {7: True, 8: True, 9: False}


def _woken_by_the_writer_thread(spool: walspool.Spool) -> None:
    """Block until the writer thread has woken the waiters of every group it took.

    ``flush`` is not enough: it may commit on the caller's thread while the writer
    thread is still waking an earlier group. The writer thread wakes one group's
    waiters before it takes the next, so once a request queued now has been called
    back there, every earlier wake has run.
    """
    spool.flush()
    woken = threading.Event()
    spool._writer.notify(Operation(lambda conn: None), lambda request: woken.set())
    assert woken.wait(30)


def test_a_failing_callback_is_logged_by_name_and_the_writer_goes_on(spool, caplog):
    writer = spool._writer
    with caplog.at_level(logging.ERROR, logger="walspool.writer"):
        writer.notify(_eviction(spool, 0), lambda request: 1 / 0)
        writer.notify(_eviction(spool, 1), Batched(lambda requests: 1 / 0))
        _woken_by_the_writer_thread(spool)
    assert sorted(r.getMessage() for r in caplog.records) == [
        "callback for 1 committed spool requests failed",
        "callback for a committed spool request failed",
    ]
    assert all(r.exc_info and r.exc_info[0] is ZeroDivisionError for r in caplog.records)
    assert spool.append("s", {"i": 2}).seq == 3


def test_an_async_append_whose_loop_closed_is_committed_and_logged_at_debug(spool, caplog):
    """The writer resolves asyncio waiters through their loop; a loop closed meanwhile
    cannot take the result, and that is no error: the row is committed all the same."""
    loop = asyncio.new_event_loop()
    future = loop.create_future()
    loop.close()
    with caplog.at_level(logging.DEBUG, logger="walspool.writer"):
        with spool._writer._commit_lock:  # queued, then committed by the writer thread
            spool._writer.notify(_eviction(spool, 0), (loop, future))
        _woken_by_the_writer_thread(spool)
    assert [r.getMessage() for r in caplog.records if r.name == "walspool.writer"] == [
        "event loop closed before its appends were acknowledged"
    ]
    assert not future.done()
    assert [r.seq for r in spool.records()] == [1]


def test_an_operation_in_a_group_sees_the_appends_before_it_and_not_after(spool):
    """A group of append, operation, append (queued behind a held writer): the
    operation runs in the same transaction after the first append's row is written;
    the rows after it are added to the same group and land with consecutive seqs."""
    writer = spool._writer
    counts: list[int] = []
    with writer._commit_lock:
        first = spool.submit("s", {"i": 0})
        seen = writer.submit(
            Operation(lambda conn: counts.append(conn.execute("SELECT count(*) FROM records").get))
        )
        rest = [spool.submit("s", {"i": i}) for i in (1, 2)]
    assert [f.result(10).seq for f in (first, *rest)] == [1, 2, 3]
    seen.result(10)
    assert counts == [1]
    assert [r.message["i"] for r in spool.records()] == [0, 1, 2]


def test_after_an_operation_the_writer_reads_its_numbers_again(spool):
    """An operation may write rows itself (any SQL in the writer's transaction); the
    ids and seqs the writer remembers are then read again, never handed out twice."""
    assert spool.append("s", {"i": 0}).seq == 1
    row = spool._row("s", {"i": 1}, walspool.CAP_DROP, None)

    def insert_next(conn) -> None:
        conn.execute(
            walspool_writer.INSERT_RECORD_SQL,
            (2, "s", 2, row.reason, None, row.created_at, row.payload, row.size),
        )

    spool.transact(insert_next)
    receipt = spool.append("s", {"i": 2})
    assert (receipt.id, receipt.seq) == (3, 3)
    assert [r.message["i"] for r in spool.records()] == [0, 1, 2]


class _Statements:
    """The writer's connection, with ``execute`` going through ``hook(real, sql)``
    first: a hook that raises fails the statement as SQLite would."""

    def __init__(self, real: apsw.Connection, hook) -> None:
        self._real = real
        self._hook = hook

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def execute(self, sql: str, *args):
        self._hook(self._real, sql)
        return self._real.execute(sql, *args)


def test_a_rollback_that_fails_never_hides_the_failure_that_caused_it(spool, monkeypatch):
    writer = spool._writer

    def rollback_reports_an_error(real: apsw.Connection, sql: str) -> None:
        if sql == "ROLLBACK":
            real.execute(sql)  # rolled back, and then an I/O error on the way out
            raise apsw.IOError("disk I/O error")

    monkeypatch.setattr(writer, "_conn", _Statements(writer._conn, rollback_reports_an_error))

    def refuse(conn: apsw.Connection) -> None:
        raise ValueError("refused by the operation")

    with pytest.raises(ValueError, match="refused by the operation"):
        spool.transact(refuse)
    assert spool.append("s", {"i": 0}).seq == 1


def test_sqlite_busy_without_the_busy_handler_marks_the_writer_busy_until_it_commits(
    spool, monkeypatch
):
    """SQLite may report SQLITE_BUSY without asking the busy handler (a WAL snapshot, a
    recovery in another process): the writer tries again shortly, and meanwhile says it
    is busy (``busy_since``, which producers waiting for room watch) as when the handler
    waits; the commit that then succeeds clears it."""
    writer = spool._writer
    free = threading.Event()
    seen: list[float | None] = []

    def busy_until_free(real: apsw.Connection, sql: str) -> None:
        if sql == "BEGIN IMMEDIATE" and not free.is_set():
            seen.append(writer.busy_since)
            raise apsw.BusyError("database is locked")

    monkeypatch.setattr(writer, "_conn", _Statements(writer._conn, busy_until_free))
    future = spool.submit("s", {"i": 0})
    _until(lambda: len(seen) >= 2, "the writer tried twice")
    assert seen[0] is None and seen[1] is not None  # set by the first try, not the handler
    free.set()
    assert future.result(30).seq == 1
    assert writer.busy_since is None


def test_the_footprint_is_measured_after_each_commit_once_tracked(spool):
    writer = spool._writer
    spool.append("s", {"i": 0})
    assert writer.footprint is None  # nobody asked: commits do not pay for it
    writer.track_footprint()
    before = writer.footprint
    assert before is not None and before > 0
    for i in range(50):
        spool.append("s", {"i": i, "pad": "x" * 4000})
    assert writer.footprint >= before + 50 * 4000


def test_close_past_a_commit_that_never_ends_counts_the_queue_and_says_the_thread_is_stuck(
    spool, monkeypatch, caplog
):
    """Step by step: the writer thread is inside a commit that does not end (an operation
    waiting on an event) and three appends wait behind it. ``close`` gives up after its
    timeout and grace, reports the three as not committed and the thread as stuck; once
    the commit ends, the three fail with ``SpoolClosed``."""
    monkeypatch.setattr(walspool_writer, "CLOSE_TIMEOUT", 0.2)
    monkeypatch.setattr(walspool_writer, "CLOSE_GRACE", 0.2)
    writer = spool._writer
    inside, release = threading.Event(), threading.Event()

    def stuck(conn: apsw.Connection) -> str:
        inside.set()
        assert release.wait(60), "the test never let the commit end"
        return "done"

    operation = writer.submit(Operation(stuck))
    assert inside.wait(10)
    queued = [spool.submit("s", {"i": i}) for i in range(3)]
    with caplog.at_level(logging.ERROR, logger="walspool.writer"):
        writer.close()
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [
        f"spool {spool.path}: closed after waiting 0.2 s for its write lock; 3 accepted "
        "message(s) were not committed (the writer thread is still stuck in a commit)"
    ]
    release.set()
    assert operation.result(30) == "done"
    for future in queued:
        with pytest.raises(walspool.SpoolClosed, match="was closed before"):
            future.result(30)
    writer._thread.join(30)
    assert not writer._thread.is_alive()


def test_the_writer_thread_is_named_for_its_spool(spool):
    """What an operator reads in a thread dump (py-spy, faulthandler) of a gateway."""
    assert spool._writer._thread.name == f"walspool-writer {spool.path}"


def test_tracking_the_footprint_never_waits_for_a_running_commit(spool, tmp_path):
    """``track_footprint`` while a commit runs (its lock held by another thread) returns
    at once with the footprint tracked but not measured yet (0); the next commit
    measures it. A missing ``-wal`` counts 0 bytes."""
    writer = spool._writer
    held, done = threading.Event(), threading.Event()

    def commit_running() -> None:
        with writer._commit_lock:
            held.set()
            done.wait(30)

    thread = threading.Thread(target=commit_running)
    thread.start()
    assert held.wait(10)
    try:
        writer.track_footprint()
        assert writer.footprint == 0
    finally:
        done.set()
        thread.join(30)
    spool.append("s", {"i": 0})
    assert writer.footprint > 0
    assert walspool_writer._size(str(tmp_path / "no-such-wal")) == 0


def test_the_writer_keeps_no_more_than_a_bound_of_stream_names_after_its_commits(tmp_path):
    """Sessions named with 4 MiB ids (a name may be as long as a payload): once the
    appends are committed, what the writer keeps of their names is bounded by
    ``_Numbers.NAME_CHARS`` (about 8 MiB), not by how many streams it saw (100,000 of
    these would be 400 GiB). Measured with tracemalloc, which sees the names' str."""
    import gc
    import tracemalloc

    names = [chr(ord("a") + i) * (4 * 1024 * 1024) for i in range(12)]
    with walspool.Spool(tmp_path / "spool.db") as spool:
        spool.append("warm", {"n": 0})
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            for i, name in enumerate(names):
                spool.append(name, {"n": i})
            names.clear()
            gc.collect()
            kept = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
    assert kept < 16 * 1024 * 1024, kept  # twice the bound: 8 Mi characters of names
