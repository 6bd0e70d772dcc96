"""walspool under Litestream: a spool replicated by a real ``litestream replicate``
child process to a ``file`` replica, and restored with ``litestream restore``.

* Host loss, on the real hermes-agent 0.19.0 gateway link during an outage: the
  gateway and Litestream are SIGKILLed and the host's directory deleted; the README's
  restore-and-replay procedure, run as written, recovers on a new host every message
  acknowledged (committed in the spool) before the replica's last position, in order,
  exactly once. The recovery point (how long before the loss the first lost
  acknowledgement was made) is measured and printed, not asserted.
* walspool's own checkpoints, its ``journal_size_limit``, ``walspool vacuum`` and a
  schema upgrade leave a replica that restores with every row; after a damaged spool is
  moved aside, so does the README's remedy (Litestream restarted).
* A damaged spool that Litestream has open is not moved aside (the open fails with
  SpoolCorrupt naming the holder and changes nothing), and ``walspool vacuum``'s
  TRUNCATE checkpoint never keeps the gateway's appends out while it waits for
  Litestream's read lock.
* Every restored spool opens as a spool (application id, schema) and ``walspool
  check`` passes on it.

Marked ``litestream``; skipped, with the reason, where the binary is missing
(scripts/test fetches it). Waits for the replica restore it until it shows what is
awaited, bounded by ``_litestream.WAIT``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import apsw
import pytest
from _helpers import MemorySink, doc_section, terminal_line
from _litestream import WAIT, GatewayHost, Replication, Row, binary, missing_reason, read_rows
from _old_schemas import DOWNGRADE_TO_V1_SQL, make_v2_spool

import walspool
import walspool.store.connections as connections
import walspool.store.schema as schema
from walspool.cli import main as cli_main
from walspool.errors import SpoolCorrupt
from walspool.replay.replayer import Replayer
from walspool.store.maintenance import vacuum

LITESTREAM = binary()
pytestmark = [
    pytest.mark.litestream,
    pytest.mark.skipif(LITESTREAM is None, reason=missing_reason()),
]

#: Litestream settings for the tests that do not measure the lag: sync often.
FAST = {"monitor_interval": "100ms", "sync_interval": "100ms"}
PAD = "p" * 2000  # a row of about 2 KB: 2,000 of them in one commit pass 1,000 WAL pages


def home(tmp_path: Path, name: str = "host") -> Path:
    path = tmp_path / name / "hermes"
    path.mkdir(mode=0o700, parents=True)
    return path


def append(spool: walspool.Spool, session: str, count: int, tag: str) -> list[str]:
    contents = [f"{tag}:{i}" for i in range(count)]
    spool.append_many([(session, {"content": c, "pad": PAD}) for c in contents])
    return contents


def contents(rows: list[Row]) -> list[str]:
    return [content for _, _, content in rows]


def restored_spool(replication: Replication, out: Path, *, txid: str | None = None) -> list[Row]:
    """Restore the replica to ``out`` and check it as walspool would any spool: it opens
    as a spool of the current schema and ``walspool check`` passes. Its rows."""
    replication.restored(out, txid=txid)
    assert cli_main(["check", str(out)]) == 0
    conn = apsw.Connection(
        f"file:{out}?immutable=1", flags=apsw.SQLITE_OPEN_READONLY | apsw.SQLITE_OPEN_URI
    )
    try:
        assert conn.execute("PRAGMA application_id").get == schema.APPLICATION_ID
        assert conn.execute("PRAGMA user_version").get == schema.SCHEMA_VERSION
    finally:
        conn.close()
    rows = read_rows(out)
    with walspool.Spool(out) as spool:  # opens for writing, as a new host's gateway would
        assert spool.stats().rows == len(rows)
    assert cli_main(["check", str(out)]) == 0
    return rows


# -- README: the configuration and the procedure, as written ----------------------------

#: The placeholders the README's examples use, replaced by the test's own paths.
README_HOME = "/home/hermes/.hermes"
README_REPLICA = "/var/backups/hermes/spool"


def readme_section() -> str:
    """docs/beyond-one-host.md's section, where the README sends its readers."""
    return doc_section("Running beyond one host")


def readme_block(language: str, marker: str) -> str:
    (block,) = [
        b for b in re.findall(rf"```{language}\n(.*?)```", readme_section(), re.S) if marker in b
    ]
    return block


def readme_directory_config(hermes_home: Path, replica: Path) -> str:
    config = readme_block("yaml", "type: file")
    assert README_HOME in config and README_REPLICA in config
    return config.replace(README_HOME, str(hermes_home)).replace(README_REPLICA, str(replica))


def run_readme_restore(hermes_home: Path, replica: Path) -> None:
    """The README's restore-and-replay commands, run by bash as written (``set -e``)."""
    script = readme_block("sh", "litestream restore")
    assert README_HOME in script and README_REPLICA in script
    script = script.replace(README_HOME, str(hermes_home)).replace(README_REPLICA, str(replica))
    assert LITESTREAM is not None
    path = os.pathsep.join([str(LITESTREAM.parent), str(Path(sys.executable).parent)])
    env = {**os.environ, "PATH": f"{path}{os.pathsep}{os.environ['PATH']}"}
    env.pop("HERMES_HOME", None)
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        capture_output=True,
        text=True,
        timeout=WAIT,
        env=env,
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])


# -- host loss ------------------------------------------------------------------------------


def key(session: str, content: str) -> tuple[str, int, int]:
    """A gateway message's identity as the gateway host prints it: (session, run, index)."""
    run, _, i = content.split(":")
    return session, int(run), int(i)


def test_host_loss_recovers_every_acknowledged_message_before_the_recovery_point(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    pytest.importorskip("hermes_state")
    hermes_home = home(tmp_path)
    spool_path = hermes_home / "spool.db"
    walspool.Spool(spool_path).close()  # a host's spool exists before Litestream starts
    replica = tmp_path / "backup" / "spool"
    config = readme_directory_config(hermes_home, replica)
    with Replication(LITESTREAM, spool_path, replica, config=config) as replication:
        replication.wait_for(lambda rows: rows == [], "the first snapshot")
        gateway = GatewayHost(hermes_home, threads=4, rate=400)
        try:
            gateway.wait_acks(2000)
            probe, acked = gateway.acks[-1]
            replication.wait_for(
                lambda rows: probe in {key(s, c) for s, _, c in rows},
                f"the acknowledged eviction {probe}",
            )
            probe_latency = time.monotonic() - acked
            gateway.wait_acks(len(gateway.acks) + 1000)
            lost_at = time.monotonic()
            # The host is gone: both processes at once, then its disk.
            assert replication.proc is not None
            os.kill(gateway.proc.pid, signal.SIGKILL)
            os.kill(replication.proc.pid, signal.SIGKILL)
        finally:
            gateway.kill()
    shutil.rmtree(hermes_home.parent)
    # in commit order (record ids), not in the order the acknowledgements were printed
    acks = sorted(gateway.acks, key=lambda ack: gateway.record_ids[ack[0]])

    new_home = home(tmp_path, "new-host")
    run_readme_restore(new_home, replica)

    with walspool.Spool(new_home / "spool.db") as spool:
        assert spool.stats().rows == 0  # everything restored was replayed
    assert cli_main(["check", str(new_home / "spool.db")]) == 0
    state = sqlite3.connect(new_home / "state.db")
    try:
        written = state.execute("SELECT session_id, content FROM messages ORDER BY id").fetchall()
    finally:
        state.close()
    transcripts: dict[str, list[int]] = defaultdict(list)
    for session, content in written:
        _, run, i = key(session, content)
        assert run == 1
        transcripts[session].append(i)
    recovered = {(s, 1, i) for s, indexes in transcripts.items() for i in indexes}
    assert len(recovered) == len(written), "a message was written twice"
    for session, indexes in transcripts.items():
        assert indexes == sorted(indexes), f"{session} out of order"

    # What the replica held is the spool as of one commit: the acknowledgements it
    # holds are a prefix of them in commit order, and the probe is in it.
    prefix = 0
    while prefix < len(acks) and acks[prefix][0] in recovered:
        prefix += 1
    lost = acks[prefix:]
    assert not {k for k, _ in lost} & recovered, "the replica skipped a commit"
    assert probe in {k for k, _ in acks[:prefix]}
    recovery_point = lost_at - lost[0][1] if lost else 0.0
    terminal_line(
        request.config,
        f"litestream host loss: {len(acks):,} evictions acknowledged, {prefix:,} recovered "
        f"in order exactly once, {len(lost):,} lost: recovery point {recovery_point:.2f} s "
        f"before the loss; a probe eviction reached the replica "
        f"{probe_latency:.2f} s after its acknowledgement (README directory config)",
    )


# -- walspool's own file operations under Litestream ------------------------------------------


def test_checkpoints_and_journal_size_limit_leave_the_replica_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under Litestream, with its checkpoints frequent: many small commits from threads
    and batches past 1,000 WAL pages (walspool keeps SQLite's autocheckpoint, which runs
    after those commits), a close and an open. With Litestream stopped: the
    autocheckpoint completes, the next commit restarts the WAL and truncates it to
    ``journal_size_limit``, and close checkpoints and removes the WAL. Litestream,
    started again, replicates on; the restore holds every row."""
    limit = 256 * 1024
    monkeypatch.setattr(connections, "JOURNAL_SIZE_LIMIT", limit)  # read by each open
    path = home(tmp_path) / "spool.db"
    walspool.Spool(path).close()
    settings = {**FAST, "checkpoint_interval": "1s", "min_checkpoint_page_count": 100}
    expected: list[str] = []
    with Replication(LITESTREAM, path, tmp_path / "replica", **settings) as replication:
        replication.wait_for(lambda rows: rows == [], "the first snapshot")
        with walspool.Spool(path, durability="normal") as spool:
            assert spool._conn.execute("PRAGMA wal_autocheckpoint").get == 1000
            # The WAL file's size says nothing afterwards (any commit after a complete
            # checkpoint truncates it to the limit); the pages a lone batch adds to the
            # database are frames of its one commit, so it passes 1,000 WAL pages.
            pages = spool._conn.execute("PRAGMA page_count").get
            expected += append(spool, "batch", 2000, "b0")
            batch_pages = spool._conn.execute("PRAGMA page_count").get - pages
            assert batch_pages >= 1000  # so SQLite's autocheckpoint ran after such commits
            stop = time.monotonic() + 1.5
            done: dict[int, list[str]] = {}

            def lone_appends(t: int) -> None:
                mine = done.setdefault(t, [])
                while time.monotonic() < stop:
                    spool.append(f"t{t}", {"content": f"t{t}:{len(mine)}"})
                    mine.append(f"t{t}:{len(mine)}")

            threads = [threading.Thread(target=lone_appends, args=(t,)) for t in range(4)]
            for t in threads:
                t.start()
            for batch in range(1, 4):
                expected += append(spool, "batch", 2000, f"b{batch}")
            for t in threads:
                t.join(WAIT)
            for mine in done.values():
                expected += mine
        with walspool.Spool(path) as spool:  # closed and opened again under Litestream
            expected += append(spool, "reopened", 100, "r")
            replication.stop()
            # Litestream is down: walspool's own checkpoint completes, then its next
            # commit starts the WAL over and truncates it to journal_size_limit.
            expected += append(spool, "down", 2500, "d")
            sizes = [os.path.getsize(f"{path}-wal")]  # that commit's frames, past the limit
            for i in range(5):
                spool.append("down", {"content": f"d1:{i}"})
                expected.append(f"d1:{i}")
                sizes.append(os.path.getsize(f"{path}-wal"))
                if sizes[-1] <= limit:
                    break
            assert sizes[-1] <= limit < sizes[0], sizes
        assert not Path(f"{path}-wal").exists()  # close checkpointed and removed it
        replication.start()
        with walspool.Spool(path) as spool:
            expected += append(spool, "after", 100, "a")
        want = sorted(expected)
        replication.wait_for(lambda rows: sorted(contents(rows)) == want, f"{len(want)} rows")
    rows = restored_spool(replication, tmp_path / "restored" / "spool.db")
    assert sorted(contents(rows)) == want
    assert len(rows) == len(want)


@pytest.mark.parametrize("version", [1, 2])
def test_a_schema_upgrade_replicates(tmp_path: Path, version: int) -> None:
    """A schema 1 or 2 spool under Litestream, upgraded in place by walspool's open (one
    transaction): the restore is of the current schema, with the old rows and the new."""
    path = home(tmp_path) / "spool.db"
    old = [f"old:{i}" for i in range(50)]
    make_v2_spool(path, [("s", i + 1, f'{{"content": "{c}"}}', None) for i, c in enumerate(old)])
    if version == 1:
        conn = apsw.Connection(str(path))
        conn.execute(DOWNGRADE_TO_V1_SQL)
        conn.close()
    with Replication(LITESTREAM, path, tmp_path / "replica", **FAST) as replication:
        replication.wait_for(lambda rows: contents(rows) == old, f"the schema {version} spool")
        with walspool.Spool(path) as spool:  # upgrades in place, in one transaction
            receipt = spool.append("s", {"content": "new:0"})
            assert receipt.seq == len(old) + 1
            new = ["new:0", *append(spool, "t", 100, "new")]
        replication.wait_for(lambda rows: contents(rows) == old + new, "the upgraded spool")
    rows = restored_spool(replication, tmp_path / "restored" / "spool.db")
    assert contents(rows) == old + new
    assert [seq for session, seq, _ in rows if session == "s"] == list(range(1, len(old) + 2))


def drained(tmp_path: Path, spool: walspool.Spool, replication: Replication) -> list[str]:
    """Rows Litestream has replicated, most of them then replayed away: free pages for a
    vacuum to give back. The rows left."""
    append(spool, "gone", 3000, "gone")
    kept = append(spool, "kept", 50, "kept")
    replication.wait_for(lambda rows: len(rows) == 3050, "the spool's rows")
    Replayer(spool, MemorySink()).replay(session_id="gone")
    replication.wait_for(lambda rows: contents(rows) == kept, "the drained spool")
    return kept


def test_a_vacuum_leaves_the_replica_whole(tmp_path: Path) -> None:
    """``walspool vacuum`` rewrites the whole file (VACUUM) and checkpoints with TRUNCATE.
    Under Litestream, the rewrite is replicated; with Litestream stopped (README's way),
    the checkpoint completes and truncates the WAL, and Litestream, started again,
    replicates on. The restore holds every row left and every row appended after."""
    path = home(tmp_path) / "spool.db"
    with walspool.Spool(path) as spool:
        with Replication(LITESTREAM, path, tmp_path / "replica", **FAST) as replication:
            kept = drained(tmp_path, spool, replication)
            vacuum(spool)
            kept += append(spool, "kept", 50, "new")
            replication.wait_for(lambda rows: contents(rows) == kept, "the vacuumed spool")
            Replayer(spool, MemorySink()).replay(session_id="kept", limit=50)
            kept = kept[50:]
            replication.stop()
            report = vacuum(spool)
            assert report.checkpointed and report.wal_bytes == 0
            assert report.db_bytes < report.db_bytes_before
            replication.start()
            kept += append(spool, "kept", 50, "last")
            replication.wait_for(lambda rows: contents(rows) == kept, "the spool vacuumed again")
    rows = restored_spool(replication, tmp_path / "restored" / "spool.db")
    assert contents(rows) == kept
    assert [seq for _, seq, _ in rows] == list(range(51, 151))


def test_a_vacuum_under_litestream_does_not_hold_appends_back(tmp_path: Path) -> None:
    """Litestream holds a read transaction on the spool between its own checkpoints (set
    far apart here). A checkpoint that waits for readers blocks new writers while it
    waits: the gateway's appends must not wait on it for more than a moment."""
    path = home(tmp_path) / "spool.db"
    apart = {**FAST, "checkpoint_interval": "1h", "min_checkpoint_page_count": 1_000_000}
    with walspool.Spool(path) as spool:
        with Replication(LITESTREAM, path, tmp_path / "replica", **apart) as replication:
            drained(tmp_path, spool, replication)
            done = threading.Event()
            waits: list[float] = []
            errors: list[BaseException] = []

            def appender() -> None:
                while not done.is_set():
                    started = time.monotonic()
                    try:
                        spool.append("live", {"content": "during the vacuum"})
                    except walspool.WalspoolError as exc:  # SpoolBusy: the lock outlasted it
                        errors.append(exc)
                    waits.append(time.monotonic() - started)

            live = threading.Thread(target=appender)
            live.start()
            try:
                vacuum(spool)
            finally:
                done.set()
                live.join(WAIT)
    assert errors == []
    assert waits and max(waits) < 2.0, f"an append waited {max(waits):.1f} s"


def damage_records_root(path: Path) -> None:
    """Overwrite the records table's root page in the database file itself, as bad
    storage would: nothing goes through SQLite, so nothing reaches Litestream."""
    conn = apsw.Connection(
        f"file:{path}?mode=ro", flags=apsw.SQLITE_OPEN_READONLY | apsw.SQLITE_OPEN_URI
    )
    try:
        root = conn.execute("SELECT rootpage FROM sqlite_schema WHERE name = 'records'").get
        page = conn.execute("PRAGMA page_size").get
    finally:
        conn.close()
    with open(path, "r+b") as f:
        f.seek((root - 1) * page)
        f.write(b"\xff" * page)


def replicated_then_damaged(tmp_path: Path) -> tuple[Path, Replication, list[str]]:
    """A spool whose rows Litestream (started, returned) has replicated; its records
    root then damaged on disk. Its rows are all in the database file (the spool was
    closed before Litestream opened it), so walspool's next open reads the damage."""
    path = home(tmp_path) / "spool.db"
    with walspool.Spool(path) as spool:
        old = append(spool, "s", 200, "old")
    replication = Replication(LITESTREAM, path, tmp_path / "replica", **FAST)
    replication.start()
    try:
        replication.wait_for(lambda rows: contents(rows) == old, "the spool's rows")
        damage_records_root(path)
    except BaseException:
        replication.kill()
        raise
    return path, replication, old


def test_after_a_move_aside_under_litestream_a_restart_replicates_the_fresh_spool(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """README's remedy: while Litestream has the damaged spool open, the gateway's open
    refuses to move it aside; Litestream is stopped, the gateway opens it again (now it
    is moved aside), Litestream's metadata directory is deleted and Litestream started
    again. The replica then follows the fresh spool, and still holds the damaged
    spool's last replicated state."""
    path, replication, old = replicated_then_damaged(tmp_path)
    with replication:
        before = replication.txid()
        with pytest.raises(SpoolCorrupt, match="another process has it open"):
            _open_and_close(path)
        replication.stop(check=False)
        with caplog.at_level(logging.ERROR, logger="walspool"):
            spool = walspool.Spool(path)
        try:
            assert "moved it aside" in caplog.text
            assert [p for p in path.parent.iterdir() if ".damaged-" in p.name]
            fresh = append(spool, "s", 100, "fresh")
            shutil.rmtree(path.with_name(f".{path.name}-litestream"))
            replication.start()
            fresh += append(spool, "s", 100, "more")
            replication.wait_for(lambda rows: contents(rows) == fresh, "the fresh spool")
        finally:
            spool.close()
    rows = restored_spool(replication, tmp_path / "restored" / "spool.db")
    assert contents(rows) == fresh
    assert [seq for _, seq, _ in rows] == list(range(1, len(fresh) + 1))
    earlier = restored_spool(replication, tmp_path / "earlier" / "spool.db", txid=before)
    assert contents(earlier) == old


def _open_and_close(path: Path) -> None:
    with walspool.Spool(path):
        pass


def test_a_damaged_spool_litestream_has_open_is_not_moved_aside(tmp_path: Path) -> None:
    """DESIGN.md: a spool is moved aside only by a process that can prove no other
    process has it open; otherwise opening fails with SpoolCorrupt and changes nothing."""
    path, replication, old = replicated_then_damaged(tmp_path)
    with replication:
        damaged = path.read_bytes()
        with pytest.raises(SpoolCorrupt, match="another process has it open"):
            _open_and_close(path)
        assert path.read_bytes() == damaged
        assert not [p for p in path.parent.iterdir() if ".damaged-" in p.name]
    assert contents(restored_spool(replication, tmp_path / "restored" / "spool.db")) == old
