"""The spool file: identity, permissions, refusals, damage handling, sqlite3 shell."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import apsw
import pytest
from _helpers import ROOT, STEP, MemorySink, child_deadline, descriptors_on, run_python
from _old_schemas import DOWNGRADE_TO_V1_SQL, make_v2_spool, make_v3_spool

import walspool
from walspool.store import maintenance, open_lock
from walspool.store.connections import open_reader
from walspool.store.schema import APPLICATION_ID, SCHEMA_VERSION, schema_problems

MSG = {"role": "user", "content": "hello 世界", "n": 1}


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_file_identity_wal_and_strict_tables(spool, spool_path):
    spool.append("s", MSG)
    conn = apsw.Connection(str(spool_path), flags=apsw.SQLITE_OPEN_READONLY)
    assert conn.execute("PRAGMA application_id").get == APPLICATION_ID
    assert conn.execute("PRAGMA user_version").get == SCHEMA_VERSION == 5
    assert conn.execute("PRAGMA journal_mode").get == "wal"
    strict = {
        name: s
        for _, name, _, _, _, s in conn.execute("PRAGMA table_list")
        if name in ("records", "sequences", "spool_meta", "audit")
    }
    assert strict == {"records": 1, "sequences": 1, "spool_meta": 1, "audit": 1}
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_schema")}
    assert {"records", "sequences", "spool_meta", "audit", "backlog", "failures"} <= names
    uid = conn.execute("SELECT value FROM spool_meta WHERE name = 'uid'").get
    assert len(uid) == 32 and int(uid, 16) >= 0
    assert not any("fts" in n.lower() for n in names)
    # No trigger on the append path: the two that keep next seqs and the two that keep
    # the next id fire on delete and on an update of a row's stream, seq or id.
    triggers = dict(conn.execute("SELECT name, sql FROM sqlite_schema WHERE type='trigger'"))
    assert set(triggers) == {
        "records_keep_next_seq_on_delete",
        "records_keep_next_seq_on_update",
        "records_keep_next_id_on_delete",
        "records_keep_next_id_on_update",
    }
    assert "AFTER DELETE ON records" in triggers["records_keep_next_seq_on_delete"]
    assert (
        "AFTER UPDATE OF session_id, session_key, seq"
        in triggers["records_keep_next_seq_on_update"]
    )
    assert "AFTER DELETE ON records" in triggers["records_keep_next_id_on_delete"]
    assert "AFTER UPDATE OF id ON records" in triggers["records_keep_next_id_on_update"]
    conn.close()


def test_private_modes_under_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        path = tmp_path / "new" / "deeper" / "spool.db"
        with walspool.Spool(path) as s:
            s.append("s", MSG)
            assert mode(path.parent) == 0o700
            for name in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
                assert name.exists(), name
                assert mode(name) == 0o600, name
    finally:
        os.umask(old)


def test_existing_loose_spool_modes_are_tightened(spool_path):
    with walspool.Spool(spool_path) as s:
        s.append("s", MSG)
    os.chmod(spool_path, 0o644)
    with walspool.Spool(spool_path) as s:
        assert mode(spool_path) == 0o600
        assert s.stats().rows == 1


def test_symlinked_path_is_refused(tmp_path):
    real = tmp_path / "real.db"
    with walspool.Spool(real) as s:
        s.append("s", MSG)
    link = tmp_path / "link.db"
    link.symlink_to(real)
    before = real.read_bytes()
    with pytest.raises(walspool.SymlinkRefused, match="symbolic link") as info:
        walspool.Spool(link)
    assert info.value.path == str(link)
    assert real.read_bytes() == before
    dangling = tmp_path / "dangling.db"
    dangling.symlink_to(tmp_path / "nowhere.db")
    with pytest.raises(walspool.SymlinkRefused):
        walspool.Spool(dangling)
    assert not (tmp_path / "nowhere.db").exists()


def test_non_sqlite_file_is_refused_and_unchanged(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("my precious notes\n" * 100)
    before = path.read_bytes()
    with pytest.raises(walspool.NotASpool, match="not a SQLite database"):
        walspool.Spool(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_other_sqlite_database_is_refused_and_unchanged(tmp_path):
    path = tmp_path / "state.db"
    conn = apsw.Connection(str(path))
    conn.execute("CREATE TABLE messages(id INTEGER PRIMARY KEY, content TEXT)")
    conn.execute("INSERT INTO messages(content) VALUES ('keep me')")
    conn.close()
    before = path.read_bytes()
    with pytest.raises(walspool.NotASpool, match="not a walspool spool") as info:
        walspool.Spool(path)
    assert info.value.path == str(path)
    assert path.read_bytes() == before
    assert not Path(f"{path}-wal").exists()
    # Closed at once, not when the error (whose traceback still holds it) goes away.
    assert descriptors_on(path) == []


def test_newer_schema_is_refused_and_unchanged(spool_path):
    with walspool.Spool(spool_path) as s:
        s.append("s", MSG)
    conn = apsw.Connection(str(spool_path))
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    before = spool_path.read_bytes()
    with pytest.raises(walspool.SchemaTooNew, match="upgrade walspool") as info:
        walspool.Spool(spool_path)
    assert (info.value.found, info.value.supported) == (SCHEMA_VERSION + 1, SCHEMA_VERSION)
    assert info.value.path == str(spool_path)
    assert isinstance(info.value, walspool.NotASpool)
    assert spool_path.read_bytes() == before


def _spool_with_rows(path: Path, n: int = 300) -> None:
    with walspool.Spool(path) as s:
        s.append_many([("s", {"i": i, "pad": "x" * 400}) for i in range(n)])


@pytest.mark.parametrize(
    "damage, cause",
    [("header", "file is not a database"), ("root_page", "database disk image is malformed")],
)
def test_damaged_spool_is_moved_aside_and_replaced(spool_path, caplog, damage, cause):
    _spool_with_rows(spool_path)
    data = bytearray(spool_path.read_bytes())
    if damage == "header":
        data[16:18] = b"\x00\x03"  # page size 3: not a valid SQLite header
    else:
        page = int.from_bytes(data[16:18], "big")
        data[page : 2 * page] = b"\xff" * page  # page 2, the records table's root
    spool_path.write_bytes(bytes(data))
    damaged = bytes(data)
    with caplog.at_level(logging.ERROR, logger="walspool"):
        with walspool.Spool(spool_path) as s:
            assert s.stats().rows == 0
            assert s.append("s", MSG).seq == 1
    aside = [p for p in spool_path.parent.iterdir() if ".damaged-" in p.name]
    main = [p for p in aside if not p.name.endswith(("-wal", "-shm"))]
    assert len(main) == 1 and len(aside) <= 3  # with its -wal and -shm, if it had them
    assert main[0].read_bytes() == damaged
    assert all(mode(p) == 0o600 for p in aside)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        f"spool {spool_path} is damaged ({cause}); moved it aside to {main[0]} and opened a "
        "fresh spool"
    ]


def test_opening_does_not_scan(spool_path):
    """A damaged page deep in the table is left for `walspool check`, not open."""
    _spool_with_rows(spool_path, 2000)
    data = bytearray(spool_path.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    middle = (len(data) // page // 2) * page
    data[middle + 100 : middle + 200] = b"\xee" * 100
    spool_path.write_bytes(bytes(data))
    with walspool.Spool(spool_path) as s:
        assert s.append("s", MSG).seq == 2001
    assert not [p for p in spool_path.parent.iterdir() if ".damaged-" in p.name]


def test_sqlite3_shell_reads_while_writer_active(spool, spool_path):
    shell = shutil.which("sqlite3")
    assert shell, "the sqlite3 shell is part of the test environment (scripts/test installs it)"
    spool.append("s1", {"role": "user", "content": "first"})
    stop = threading.Event()

    def keep_writing() -> None:
        i = 0
        while not stop.is_set():
            spool.append("busy", {"role": "user", "content": f"m{i}"})
            i += 1

    writer = threading.Thread(target=keep_writing)
    writer.start()
    try:

        def sql(query: str) -> str:
            out = subprocess.run(
                [shell, "-readonly", str(spool_path), query],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert out.returncode == 0, out.stderr
            return out.stdout.strip()

        assert sql("PRAGMA journal_mode") == "wal"
        assert (
            sql("SELECT json_extract(payload, '$.content') FROM records WHERE session_id = 's1'")
            == "first"
        )
        backlog = sql("SELECT session_id, rows FROM backlog WHERE session_id = 's1'")
        assert backlog == "s1|1"
        assert sql("SELECT count(*) FROM failures") == "0"
    finally:
        stop.set()
        writer.join(30)


def test_stdlib_sqlite3_in_another_process_reads_the_spool(spool, spool_path):
    spool.append("s", MSG)
    out = run_python(
        "import sqlite3, sys\n"
        "c = sqlite3.connect(f'file:{sys.argv[1]}?mode=ro', uri=True)\n"
        "print(c.execute(\"select json_extract(payload,'$.content') from records\").fetchone()[0])",
        str(spool_path),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == MSG["content"]
    # the other library's reader, in its own process, left this process's spool working
    assert spool.append("s", MSG).seq == 2
    assert [r.seq for r in spool.records(session_id="s")] == [1, 2]


def upgraded(spool_path: Path, caplog: pytest.LogCaptureFixture, found: int) -> walspool.Spool:
    """The spool of schema ``found`` at ``spool_path``, which a read-only open refuses
    (``SchemaTooOld``), opened for writing: upgraded, with its one line."""
    with pytest.raises(walspool.NotASpool, match="a read-only open cannot upgrade it") as old:
        open_reader(spool_path)
    assert (old.value.found, old.value.current) == (found, SCHEMA_VERSION)
    with caplog.at_level(logging.WARNING, logger="walspool.schema"):
        spool = walspool.Spool(spool_path)
    assert [r.getMessage() for r in caplog.records if r.name == "walspool.schema"] == [
        f"upgraded spool {spool_path} from schema {found} to {SCHEMA_VERSION}"
    ]
    return spool


def test_schema_3_spool_is_upgraded_in_place_and_keeps_every_next_seq(spool_path, caplog):
    """Schema 3 kept every stream's next seq on append; schema 4 keeps it when rows
    leave. The upgrade adds the triggers and the audit table and keeps `sequences`: a
    stream drained under schema 3 goes on above its old seqs."""
    make_v3_spool(spool_path, [("s", i + 1, f'{{"n":{i}}}', None) for i in range(3)], {"gone": 8})
    with upgraded(spool_path, caplog, 3) as spool:
        assert spool.append("gone", {"n": 0}).seq == 8
        assert spool.append("s", {"n": 3}).seq == 4
        assert spool.append("new", {"n": 0}).seq == 1
        walspool.Replayer(spool, MemorySink()).replay()
        assert spool.stats().rows == 0
        assert [spool.append(name, {}).seq for name in ("gone", "s", "new")] == [9, 5, 2]
    conn = open_reader(spool_path)
    try:
        assert conn.execute("PRAGMA user_version").get == SCHEMA_VERSION == 5
        assert schema_problems(conn) == []
    finally:
        conn.close()


def test_an_append_writes_no_sequences_row_and_three_pages(spool, spool_path):
    """The append path writes the row and its two index entries, nothing else: a lone
    commit is three WAL pages (records leaf, the (session_id, seq) index leaf, the
    statistics index leaf), and `sequences` gets a row only when a stream loses rows."""
    spool.append_many([(f"s{i % 8}", MSG) for i in range(400)])  # past the first pages
    frames: list[int] = []

    def on_wal(conn: apsw.Connection, name: str, pages: int) -> int:
        frames.append(pages)
        return apsw.SQLITE_OK

    spool._writer._conn.set_wal_hook(on_wal)
    for i in range(60):
        spool.append(f"s{i % 8}", MSG)
    spool._writer._conn.set_wal_hook(None)
    per_commit = sorted(b - a for a, b in zip(frames, frames[1:], strict=False) if b > a)
    assert per_commit[len(per_commit) // 2] == 3, per_commit
    assert spool.transact(lambda conn: conn.execute("SELECT count(*) FROM sequences").get) == 0
    spool.transact(lambda conn: conn.execute("DELETE FROM records WHERE session_id = 's0'"))
    kept = spool.transact(lambda conn: conn.execute("SELECT * FROM sequences").fetchall())
    assert kept == [("session_id", "s0", 59)]  # 50 + 8 appends to s0: its last seq was 58


def test_a_key_only_stream_drained_never_reuses_a_seq(spool):
    for _ in range(3):
        spool.append(None, "slot", session_key="k", reason=walspool.SHUTDOWN)
    spool.transact(lambda conn: conn.execute("DELETE FROM records"))
    assert spool.append(None, "slot", session_key="k", reason=walspool.SHUTDOWN).seq == 4
    assert spool.append("k", "by id").seq == 1  # a session id equal to the key: its own


@pytest.mark.parametrize("how", ["replayed", "dropped", "deleted by hand"])
def test_a_row_id_is_never_given_again_once_the_spool_was_emptied(spool_path, how):
    """Rows leave (a replay, an operator's drop, a DELETE in the ``sqlite3`` shell), the
    file is vacuumed empty: the next append's id is above every id given before, so an
    id noted during an incident (or kept in ``audit``) names one row for good."""
    with walspool.Spool(spool_path) as spool:
        given = [spool.append("s", {"n": i}).id for i in range(3)]
        if how == "replayed":
            walspool.Replayer(spool, MemorySink()).replay()
        elif how == "dropped":
            assert spool.supersede("s") == 3  # set aside: what an operator may drop
            assert sorted(maintenance.drop(spool, given)) == given
    if how == "deleted by hand":
        conn = apsw.Connection(str(spool_path))
        conn.execute("DELETE FROM records")
        conn.close()
    conn = apsw.Connection(str(spool_path))
    conn.execute("VACUUM")
    assert conn.execute("SELECT count(*) FROM records").get == 0
    conn.close()
    with walspool.Spool(spool_path) as spool:
        assert spool.append("t", {"n": 0}).id == max(given) + 1


def test_schema_4_spool_is_upgraded_and_keeps_ids_from_then_on(spool_path, caplog):
    """A schema 4 spool (no kept next id) is upgraded by the first open for writing;
    from then on, ids of rows that leave are not given again."""
    with walspool.Spool(spool_path) as spool:
        spool.append("s", {"n": 0})
    conn = apsw.Connection(str(spool_path))  # the file as schema 4 made it
    conn.execute(
        "DROP TRIGGER records_keep_next_id_on_delete; DROP TRIGGER records_keep_next_id_on_update;"
        "PRAGMA user_version = 4"
    )
    conn.close()
    with upgraded(spool_path, caplog, 4) as spool:
        last = spool.append("s", {"n": 1}).id
        walspool.Replayer(spool, MemorySink()).replay()
        assert spool.append("s", {"n": 2}).id == last + 1
    conn = open_reader(spool_path)
    try:
        assert schema_problems(conn) == []
    finally:
        conn.close()


def test_schema_1_spool_is_upgraded_in_place(spool_path):
    make_v2_spool(spool_path, [("s", i + 1, f'{{"n":{i}}}', None) for i in range(3)])
    conn = apsw.Connection(str(spool_path))  # rewrite the file as schema 1 had it
    conn.execute(DOWNGRADE_TO_V1_SQL)
    conn.close()
    with pytest.raises(walspool.NotASpool, match="a read-only open cannot upgrade it"):
        open_reader(spool_path)
    with walspool.Spool(spool_path) as spool:
        assert [r.message["n"] for r in spool.records()] == [0, 1, 2]
        assert spool.stats().bytes == 3 * len('{"n":0}')
        assert spool.append("s", {"n": 3}).seq == 4
    conn = apsw.Connection(str(spool_path), flags=apsw.SQLITE_OPEN_READONLY)
    assert conn.execute("PRAGMA user_version").get == SCHEMA_VERSION == 5
    assert conn.execute("SELECT rows, bytes FROM backlog").fetchall() == [(4, 4 * 7)]
    conn.close()
    assert not [p for p in spool_path.parent.iterdir() if ".damaged-" in p.name]


def test_schema_2_spool_with_rows_in_flight_is_upgraded_and_never_guessed(
    spool_path, session_db, caplog
):
    """Schema 2 marked rows in flight with state.db's max id, which cannot say exactly
    whether a row landed: the upgrade quarantines those rows (kept, named, replayable
    by hand), and every other row replays as usual, its session going on."""
    session_db.create_session("s", "cli")
    make_v2_spool(
        spool_path,
        [
            ("s", 1, '{"role": "user", "content": "maybe landed"}', 7),
            ("s", 2, '{"role": "user", "content": "next"}', None),
            ("t", 1, '{"role": "user", "content": "other"}', None),
        ],
    )
    with caplog.at_level(logging.WARNING, logger="walspool.schema"):
        spool = walspool.Spool(spool_path)
    assert [r.getMessage() for r in caplog.records if r.name == "walspool.schema"] == [
        f"{spool_path}: 1 row(s) were in flight under schema 2 and are quarantined: whether "
        "they reached state.db is unknown (see `walspool show`)",
        f"upgraded spool {spool_path} from schema 2 to {SCHEMA_VERSION}",
    ]
    with spool:
        session_db.create_session("t", "cli")
        report = walspool.Replayer(spool, walspool.SessionDBSink(session_db)).replay()
        assert (report.moved, report.held, report.quarantined) == (2, 0, 0)
        kept = list(spool.records())
        assert [(r.seq, r.status, r.message["content"]) for r in kept] == [
            (1, "quarantined", "maybe landed")
        ]
        assert "upgraded from schema 2" in kept[0].last_error
        assert spool.append("s", {"role": "user", "content": "new"}).seq == 3
        # The operator checked state.db: it is not there, so they replay it by hand.
        report = walspool.Replayer(spool, walspool.SessionDBSink(session_db)).replay(
            quarantined=True
        )
        assert report.moved == 2 and list(spool.records()) == []
    contents = [m["content"] for m in session_db.get_messages("s")]
    assert contents == ["next", "maybe landed", "new"]


# -- moving a damaged spool aside only when nobody else has it open ---------------------

APPENDER = """
import sys, walspool
spool = walspool.Spool(sys.argv[1])
n = 0
for line in sys.stdin:
    if line.strip() == "close":
        break
    n += 1
    spool.append("a", {"role": "user", "content": f"a{n}"})
    print(f"acked a{n}", flush=True)
spool.close()
print("closed", flush=True)
"""


def cannot_move_aside(path: Path, who: str) -> str:
    """The error of opening a damaged spool that ``who`` (a pid, or nobody named) has open."""
    return (
        f"spool {path} is damaged (database disk image is malformed) and another process "
        f"has it open{who}, so it cannot be moved aside now; stop the other users of it "
        f"(the gateway, a replay, Litestream) and open it again, or run `walspool check {path}`"
    )


def damage_spool_meta(path: Path) -> None:
    """Overwrite the page of ``spool_meta`` in the main file: a table an appending
    process never touches, but an opening process checks."""
    conn = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    root = conn.execute("SELECT rootpage FROM sqlite_schema WHERE name = 'spool_meta'").get
    page_size = conn.execute("PRAGMA page_size").get
    conn.close()
    with open(path, "r+b") as f:
        f.seek((root - 1) * page_size)
        f.write(b"\xa5" * page_size)


@pytest.mark.skipif(shutil.which("sqlite3") is None, reason="needs the sqlite3 shell")
def test_a_damaged_spool_an_sqlite3_shell_has_open_is_not_moved_aside(spool_path):
    """Not only walspool: any program holding SQLite's own locks on the spool (an
    operator's sqlite3 shell here, Litestream in test_litestream) keeps it in place."""
    _spool_with_rows(spool_path)
    damage_spool_meta(spool_path)
    shell = subprocess.Popen(
        ["sqlite3", str(spool_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert shell.stdin is not None and shell.stdout is not None
        # A read opens the file and its -shm: the shell now holds SQLite's locks.
        shell.stdin.write("SELECT count(*) FROM records;\n")
        shell.stdin.flush()
        with child_deadline(shell, what="the sqlite3 shell"):
            assert shell.stdout.readline() == "300\n"
        before = spool_path.read_bytes()
        with pytest.raises(walspool.SpoolCorrupt) as info:
            walspool.Spool(spool_path)
        assert str(info.value) == cannot_move_aside(spool_path, f" (pid {shell.pid})")
        assert info.value.path == str(spool_path)
        assert spool_path.read_bytes() == before
        assert not [p for p in spool_path.parent.iterdir() if ".damaged-" in p.name]
    finally:
        shell.kill()
        shell.wait(30)
    with walspool.Spool(spool_path) as spool:  # alone now: moved aside, a fresh spool
        assert spool.stats().rows == 0
    assert [p for p in spool_path.parent.iterdir() if ".damaged-" in p.name]


def test_a_damaged_spool_open_in_another_process_is_not_moved_aside(spool_path):
    """Process A appends; the file is damaged where only an opener looks; process B
    (this one) opens it: B must not rename the file from under A, or A's acknowledged
    appends would land in a file the next start never opens."""
    with walspool.Spool(spool_path) as spool:
        spool.append("a", {"role": "user", "content": "a0"})
    proc = subprocess.Popen(
        [sys.executable, "-c", APPENDER, str(spool_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        with child_deadline(proc, what="process A"):
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write("append\n")
            proc.stdin.flush()
            assert proc.stdout.readline() == "acked a1\n"  # A has the spool open
            damage_spool_meta(spool_path)
            with pytest.raises(walspool.SpoolCorrupt) as info:
                walspool.Spool(spool_path)
            # A walspool process holds the open lock: no pid to name.
            assert str(info.value) == cannot_move_aside(spool_path, "")
            assert info.value.path == str(spool_path)
            # The damaged file's connection is closed before the error reaches the caller.
            assert descriptors_on(spool_path) == []
            del info
            assert not [p for p in spool_path.parent.iterdir() if ".damaged-" in p.name]
            proc.stdin.write("append\n")
            proc.stdin.flush()
            assert proc.stdout.readline() == "acked a2\n"
            proc.stdin.write("close\n")
            proc.stdin.flush()
            assert proc.stdout.readline() == "closed\n"
            assert proc.wait(30) == 0
    finally:
        proc.kill()
    # Every acknowledged append is in the file at the spool's path.
    conn = apsw.Connection(str(spool_path), flags=apsw.SQLITE_OPEN_READONLY)
    rows = conn.execute("SELECT json_extract(payload, '$.content') FROM records ORDER BY seq")
    assert [r[0] for r in rows] == ["a0", "a1", "a2"]
    conn.close()
    # Now nobody has it open: the next opener moves it aside and starts afresh.
    with walspool.Spool(spool_path) as spool:
        assert spool.stats().rows == 0
    (aside,) = [p for p in spool_path.parent.iterdir() if p.name.endswith(tuple("0123456789"))]
    assert ".damaged-" in aside.name


def test_a_spool_whose_path_names_another_file_refuses_appends(spool_path):
    with walspool.Spool(spool_path) as spool:
        spool.append("s", MSG)
        moved = spool_path.with_name("moved.db")
        for suffix in ("", "-wal", "-shm"):  # an operator's `mv spool.db* ...`
            os.rename(f"{spool_path}{suffix}", f"{moved}{suffix}")
        with walspool.Spool(spool_path) as fresh:  # a new file at the path
            fresh.append("s", MSG)
        for attempt in (
            lambda: spool.append("s", MSG),
            lambda: spool.append_many([("s", MSG)]),
            lambda: spool.submit("s", MSG).result(),
        ):
            with pytest.raises(walspool.SpoolReplaced, match="no longer names the file"):
                attempt()
    conn = apsw.Connection(str(moved), flags=apsw.SQLITE_OPEN_READONLY)
    assert conn.execute("SELECT count(*) FROM records").get == 1
    conn.close()


class FailedConnection:
    """Stands in for the connection a failure happened on: its OS errno."""

    def __init__(self, system_errno: int | None) -> None:
        self._errno = system_errno

    @property
    def system_errno(self) -> int:
        if self._errno is None:
            raise apsw.MisuseError("connection closed")
        return self._errno


@pytest.mark.parametrize(
    "exc, os_errno, kind, text",
    [
        (apsw.CorruptError("database disk image is malformed"), None, walspool.SpoolCorrupt,
         "{path}: database disk image is malformed; run `walspool check {path}`"),
        (apsw.NotADBError("file is not a database"), None, walspool.SpoolCorrupt,
         "{path}: file is not a database; run `walspool check {path}`"),
        (apsw.FullError("database or disk is full"), None, walspool.DiskFull,
         "{path}: no room to write (database or disk is full); free disk space, nothing "
         "stored was lost"),
        (apsw.IOError("disk I/O error"), errno.ENOSPC, walspool.DiskFull,
         "{path}: no room to write (disk I/O error); free disk space, nothing stored was lost"),
        (apsw.IOError("disk I/O error"), errno.EFBIG, walspool.DiskFull,
         "{path}: no room to write (disk I/O error); free disk space, nothing stored was lost"),
        (apsw.IOError("disk I/O error"), errno.EIO, walspool.SpoolIOError,
         "{path}: disk I/O error; check the disk"),
        (apsw.IOError("disk I/O error"), None, walspool.SpoolIOError,
         "{path}: disk I/O error; check the disk"),
        (apsw.BusyError("database is locked"), errno.ENOSPC, walspool.DiskFull,
         "{path}: no room to write (database is locked); free disk space, nothing stored "
         "was lost"),
        (apsw.BusyError("database is locked"), 0, walspool.WalspoolError,
         "{path}: database is locked"),
    ],
)  # fmt: skip
def test_sqlite_errors_are_named_for_their_condition(tmp_path, exc, os_errno, kind, text):
    from walspool.store.sqlite_errors import sqlite_error

    path = tmp_path / "spool.db"
    error = sqlite_error(exc, path, "s-1", FailedConnection(os_errno))
    assert type(error) is kind
    assert str(error) == text.format(path=path)
    assert (error.path, error.session_id) == (str(path), "s-1")


def test_a_schema_1_spool_that_already_has_the_size_column_is_upgraded(spool_path):
    """A schema 1 file with ``size`` already there (the column is not added twice), its
    sizes recomputed from the payloads."""
    make_v2_spool(spool_path, [("s", i + 1, f'{{"n":{i}}}', None) for i in range(2)])
    conn = apsw.Connection(str(spool_path))
    conn.execute(DOWNGRADE_TO_V1_SQL.replace("ALTER TABLE records DROP COLUMN size;", ""))
    conn.execute("UPDATE records SET size = 0")
    conn.close()
    with walspool.Spool(spool_path) as spool:
        assert [r.message["n"] for r in spool.records()] == [0, 1]
        assert spool.stats().bytes == 2 * len('{"n":0}')


def test_opening_a_current_spool_logs_no_upgrade(spool_path, caplog):
    walspool.Spool(spool_path).close()
    caplog.set_level(logging.INFO, logger="walspool")
    walspool.Spool(spool_path).close()
    assert [r.getMessage() for r in caplog.records if r.name == "walspool.schema"] == []


def test_a_read_only_open_of_a_missing_or_empty_file_says_so(tmp_path):
    missing = tmp_path / "none.db"
    with pytest.raises(walspool.WalspoolError) as info:
        open_reader(missing)
    assert (str(info.value), info.value.path) == (f"no spool at {missing}", str(missing))
    assert not missing.exists()
    empty = tmp_path / "empty.db"
    apsw.Connection(str(empty)).close()  # a SQLite file with nothing in it
    with pytest.raises(walspool.NotASpool) as info:
        open_reader(empty)
    assert str(info.value) == (
        f"{empty} is a SQLite database but not a walspool spool (application_id=0); "
        "it was left unchanged"
    )
    assert info.value.path == str(empty)


def test_a_read_only_open_of_an_old_schema_names_the_file(spool_path):
    make_v2_spool(spool_path, [])
    with pytest.raises(walspool.NotASpool) as info:
        open_reader(spool_path)
    assert info.value.path == str(spool_path)
    assert str(info.value).startswith(f"{spool_path} has spool schema 2;")


# -- the open lock, and what SQLite itself refuses ---------------------------------------

HOLD_OPEN_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_SH)
print("held", flush=True)
sys.stdin.readline()
"""


def test_a_damaged_spool_a_process_is_opening_is_not_moved_aside(spool_path):
    """A walspool process between taking the open lock and opening the file has no SQLite
    lock on it yet: the open lock alone keeps the file where that process will look."""
    _spool_with_rows(spool_path)
    damage_spool_meta(spool_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_OPEN_LOCK, f"{spool_path}.open-lock"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        with child_deadline(holder, what="the open lock holder"):
            assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        before = spool_path.read_bytes()
        with pytest.raises(walspool.SpoolCorrupt) as info:
            walspool.Spool(spool_path)
        assert str(info.value) == cannot_move_aside(spool_path, "")
        assert spool_path.read_bytes() == before
        assert not [p for p in spool_path.parent.iterdir() if ".damaged-" in p.name]
    finally:
        holder.kill()
        holder.wait(30)


class _SteppedTime:
    """``time`` for ``walspool.store.schema``: the real clock, and a ``sleep`` that records each
    pause and sets ``stepped`` at the first."""

    def __init__(self) -> None:
        self.monotonic = time.monotonic
        self.pauses: list[float] = []
        self.stepped = threading.Event()

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.stepped.set()
        time.sleep(seconds)


def test_an_opener_waits_for_a_spool_being_moved_aside_then_opens_it(spool_path, monkeypatch):
    """The process moving a damaged spool aside holds the open lock exclusively; another
    opener waits (polling often) instead of failing, and opens the spool once it is free."""
    walspool.Spool(spool_path).close()
    clock = _SteppedTime()
    monkeypatch.setattr(open_lock, "time", clock)
    mover = os.open(f"{spool_path}.open-lock", os.O_RDWR)
    fcntl.flock(mover, fcntl.LOCK_EX)
    outcome: list[object] = []

    def open_it() -> None:
        try:
            with walspool.Spool(spool_path) as spool:
                outcome.append(spool.append("s", MSG).seq)
        except BaseException as exc:
            outcome.append(exc)
        clock.stepped.set()

    opener = threading.Thread(target=open_it)
    opener.start()
    try:
        assert clock.stepped.wait(STEP)
        assert outcome == [] and opener.is_alive()  # waiting, not failed
    finally:
        os.close(mover)  # the move is over
    opener.join(STEP)
    assert outcome == [1]
    assert clock.pauses and max(clock.pauses) <= 0.05  # notices the release at once


def test_an_open_lock_held_past_its_bound_is_a_named_error(spool_path, monkeypatch):
    walspool.Spool(spool_path).close()
    monkeypatch.setattr(open_lock, "WAIT", 0.2)
    mover = os.open(f"{spool_path}.open-lock", os.O_RDWR)
    fcntl.flock(mover, fcntl.LOCK_EX)
    try:
        with pytest.raises(walspool.SpoolIOError) as info:
            walspool.Spool(spool_path)
        assert str(info.value) == (
            f"spool {spool_path} stayed locked for 0.2 s by a process moving it aside "
            f"({spool_path}.open-lock); try again"
        )
        assert info.value.path == str(spool_path)
        # Its own descriptor of the lock is closed; only the mover's is left.
        assert descriptors_on(spool_path) == [f"{spool_path}.open-lock"]
    finally:
        os.close(mover)


def test_an_open_lock_that_is_not_a_file_is_refused_by_name(spool_path):
    spool_path.parent.mkdir(mode=0o700)
    os.mkdir(f"{spool_path}.open-lock")
    with pytest.raises(walspool.SpoolIOError) as info:
        walspool.Spool(spool_path)
    lock = f"{spool_path}.open-lock"
    assert str(info.value) == (
        f"cannot open the open lock {lock} ([Errno {errno.EISDIR}] Is a directory: {lock!r}); "
        "it must be a regular file beside the spool"
    )
    assert info.value.path == str(spool_path)


@pytest.mark.parametrize("opener", ["writer", "reader"])
def test_a_symlink_swapped_in_after_the_check_is_refused_by_sqlite(spool_path, monkeypatch, opener):
    """walspool refuses a link at the spool's path, and SQLite refuses one too
    (``SQLITE_OPEN_NOFOLLOW``): a link put there between the check and the open (a race
    by whoever can write the directory) never makes walspool write, or read, its target."""
    walspool.Spool(spool_path).close()
    victim = spool_path.with_name("victim")
    victim.write_bytes(b"")
    real_check = walspool.store.files.refuse_non_sqlite

    def check_then_swap(path: Path) -> None:
        real_check(path)
        if "open_checked" in sys._getframe(1).f_code.co_name or opener == "reader":
            os.rename(spool_path, spool_path.with_name("real.db"))
            os.symlink(victim, spool_path)

    monkeypatch.setattr(walspool.store.files, "refuse_non_sqlite", check_then_swap)
    with pytest.raises(walspool.WalspoolError) as info:
        if opener == "writer":
            walspool.Spool(spool_path)
        else:
            open_reader(spool_path)
    assert type(info.value) is walspool.WalspoolError
    assert str(info.value) == f"{spool_path}: unable to open database file"
    assert info.value.path == str(spool_path)
    assert victim.read_bytes() == b""


def test_a_read_only_open_of_a_damaged_file_names_the_damage_and_closes_it(spool_path):
    _spool_with_rows(spool_path, 10)
    data = bytearray(spool_path.read_bytes())
    data[16:18] = b"\x00\x03"  # page size 3: SQLite's own "file is not a database"
    spool_path.write_bytes(bytes(data))
    with pytest.raises(walspool.SpoolCorrupt) as info:
        open_reader(spool_path)
    assert str(info.value) == (
        f"{spool_path}: file is not a database; run `walspool check {spool_path}`"
    )
    assert info.value.path == str(spool_path)
    assert descriptors_on(spool_path) == []  # closed, not left to the error's traceback


def test_a_read_only_open_of_another_database_closes_it(tmp_path):
    path = tmp_path / "state.db"
    conn = apsw.Connection(str(path))
    conn.execute("CREATE TABLE messages(id INTEGER PRIMARY KEY)")
    conn.close()
    with pytest.raises(walspool.NotASpool, match="not a walspool spool") as info:
        open_reader(path)
    assert descriptors_on(path) == []  # closed, not left to the error's traceback
    del info


class _NoSharedMemoryFile:
    """A file of the ``unix`` VFS behind SQLite's first file interface, which has no
    shared memory: what SQLite sees on a file system that cannot map one (some network
    and FUSE file systems)."""

    def __init__(self, name: object, flags: list[int]) -> None:
        self._file = apsw.VFSFile("unix", name, flags)

    def __getattr__(self, name: str) -> object:
        return getattr(self._file, name)


class _NoSharedMemoryVFS(apsw.VFS):
    def __init__(self) -> None:
        super().__init__("walspool-no-shm", "unix")

    def xOpen(self, name: object, flags: list[int]) -> _NoSharedMemoryFile:
        return _NoSharedMemoryFile(name, flags)


@pytest.mark.parametrize("existing", [False, True])
def test_a_file_system_without_shared_memory_is_refused_by_name(spool_path, existing):
    """WAL needs shared memory; without it SQLite keeps its rollback journal, which a
    reader blocks and which walspool's durability does not describe: refused, by name,
    for a new spool and for one an operator turned out of WAL mode."""
    if existing:
        walspool.Spool(spool_path).close()
        conn = apsw.Connection(str(spool_path))
        conn.execute("PRAGMA journal_mode = DELETE")
        conn.close()
    vfs = _NoSharedMemoryVFS()
    previous = apsw.vfs_names()[0]
    apsw.set_default_vfs("walspool-no-shm")
    try:
        with pytest.raises(walspool.SpoolIOError) as info:
            walspool.Spool(spool_path)
    finally:
        apsw.set_default_vfs(previous)
        vfs.unregister()
    assert str(info.value) == (
        f"{spool_path}: SQLite refused WAL mode (got 'delete'); put the spool on a local "
        "file system"
    )
    assert info.value.path == str(spool_path)
    with walspool.Spool(spool_path) as spool:  # on a file system with shared memory: fine
        assert spool.append("s", MSG).seq == 1


def test_each_schema_problem_is_named_when_the_spool_is_moved_aside(
    spool_path, caplog, monkeypatch
):
    with walspool.Spool(spool_path) as spool:
        spool.append("s", MSG)
    conn = apsw.Connection(str(spool_path))
    conn.execute(
        "DROP VIEW failures; DROP VIEW backlog; CREATE VIEW backlog AS SELECT 1;"
        "DROP INDEX records_status_idx;"
        "CREATE INDEX records_status_idx ON records (status);"
    )
    conn.close()
    # Walspool's own definitions are read afresh here, not remembered from another test.
    monkeypatch.setattr(walspool.store.schema, "_definitions", {})
    with caplog.at_level(logging.ERROR, logger="walspool"):
        walspool.Spool(spool_path).close()
    (aside,) = [p for p in spool_path.parent.iterdir() if p.name.endswith(tuple("0123456789"))]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [
        f"spool {spool_path} is damaged (spool schema: the schema lacks the view `failures`; "
        "the index `records_status_idx` is not walspool's definition; "
        "the view `backlog` is not walspool's definition); "
        f"moved it aside to {aside} and opened a fresh spool"
    ]


# -- a spool's schema is compared before any of its statements runs (issue 29) ----------


@pytest.mark.parametrize(
    ("sql", "named"),
    [
        (
            "ALTER TABLE records ADD COLUMN g TEXT GENERATED ALWAYS AS (upper(payload))",
            "the table `records` does not have walspool's columns",
        ),
        ("CREATE TABLE extra (x)", "the table `extra` is not walspool's"),
        ("CREATE VIEW evil AS SELECT 1", "the view `evil` is not walspool's"),
        ("CREATE INDEX evil_idx ON records (length(payload))", "the index `evil_idx` is not"),
        (
            "CREATE TABLE _litestream_seq (id INTEGER PRIMARY KEY, seq INTEGER, g AS (1))",
            "the table `_litestream_seq` is not walspool's",
        ),
    ],
)
def test_an_object_walspool_did_not_make_is_named_by_every_reader(spool_path, capsys, sql, named):
    from walspool.cli import main

    with walspool.Spool(spool_path) as spool:
        spool.append("s", {"role": "user", "content": "x"})
    conn = apsw.Connection(str(spool_path))
    conn.execute(sql)
    conn.close()
    for command in ("stats", "ls", "export"):
        assert main([command, str(spool_path)]) == 1
        assert named in capsys.readouterr().err
    assert main(["check", str(spool_path), "--json"]) == 1
    assert any(named in p for p in json.loads(capsys.readouterr().out)["problems"])


def test_the_tables_litestream_makes_are_taken_as_litestream_makes_them(spool_path):
    """Litestream (0.5) adds two plain tables to a database it replicates; a spool it
    replicates stays a spool (tests/test_litestream.py runs the real binary)."""
    with walspool.Spool(spool_path) as spool:
        spool.append("s", {"role": "user", "content": "x"})
    conn = apsw.Connection(str(spool_path))
    conn.execute("CREATE TABLE _litestream_seq (id INTEGER PRIMARY KEY, seq INTEGER)")
    conn.execute("CREATE TABLE _litestream_lock (id INTEGER)")
    conn.close()
    with walspool.Spool(spool_path) as spool:
        assert [r.message for r in spool.records()] == [{"role": "user", "content": "x"}]
    assert not list(spool_path.parent.glob("*.damaged-*"))  # not moved aside


def test_an_upgrade_runs_no_trigger_planted_in_an_older_spool(spool_path, caplog):
    """A schema 2 spool with a trigger that would fire on the upgrade's UPDATE of rows
    in flight: refused (moved aside, kept) before the upgrade runs, the trigger unfired."""
    make_v2_spool(spool_path, [("s", 1, '{"n": 1}', 7)])
    conn = apsw.Connection(str(spool_path))
    conn.execute(
        "CREATE TRIGGER planted AFTER UPDATE ON records BEGIN "
        "INSERT INTO sequences VALUES ('session_id', 'fired', 1); END"
    )
    conn.close()
    with walspool.Spool(spool_path) as spool:
        assert list(spool.records()) == []  # a fresh spool
    assert "the trigger `planted` is not walspool's" in caplog.text
    (moved,) = [p for p in spool_path.parent.iterdir() if p.name.endswith(tuple("0123456789"))]
    conn = apsw.Connection(
        f"file:{moved}?mode=ro", flags=apsw.SQLITE_OPEN_READONLY | apsw.SQLITE_OPEN_URI
    )
    try:
        assert conn.execute("SELECT user_version FROM pragma_user_version").get == 2
        assert conn.execute("SELECT count(*) FROM sequences WHERE name = 'fired'").get == 0
    finally:
        conn.close()
