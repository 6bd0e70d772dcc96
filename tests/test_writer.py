"""Durability of the write path: killed writers, full disks, group commit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import apsw
import pytest
from _helpers import ROOT, run_python

import walspool

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


def test_concurrent_appenders_share_commits(spool):
    """64 threads: far fewer commits than appends (group commit)."""
    commits = []
    spool._conn.set_wal_hook(lambda conn, db, pages: commits.append(pages) or 0)
    barrier = threading.Barrier(64)

    def work(i: int) -> None:
        barrier.wait()
        for j in range(20):
            spool.append(f"s{i}", {"j": j})

    threads = [threading.Thread(target=work, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert spool.stats().rows == 64 * 20
    assert len(commits) < 64 * 20 / 4


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
    """The writer never dies with waiters left behind, even if mapping an error fails."""
    with walspool.Spool(spool_path, max_bytes=64 * 1024) as spool:

        def broken_error(exc, request):
            raise apsw.IOError("disk gone while asking why")

        spool._writer._error = broken_error
        with pytest.raises(walspool.WalspoolError):
            spool.submit("s", {"pad": "z" * 200_000}).result(30)
        assert spool._writer._thread.is_alive()
        assert spool.append("s", {"i": 1}).seq == 1
