"""Appending and reading back through the public Spool API."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from pathlib import Path

import apsw
import pytest
from _helpers import descriptors_on, run_python

import walspool
from walspool import CAP_DROP, SHUTDOWN

MSG = {"role": "user", "content": "x" * 450}


def test_append_returns_receipt_with_per_session_seq(spool):
    a1 = spool.append("a", {"n": 1})
    b1 = spool.append("b", {"n": 1})
    a2 = spool.append("a", {"n": 2}, reason=SHUTDOWN)
    assert (a1.session_id, a1.seq, a1.reason) == ("a", 1, CAP_DROP)
    assert (b1.seq, a2.seq, a2.reason) == (1, 2, SHUTDOWN)
    assert a1.id < b1.id < a2.id


def test_records_read_back_in_drop_order_with_fields(spool):
    spool.append("a", {"n": 1})
    spool.append_many([("a", {"n": 2}), ("b", {"n": 9})], reason=SHUTDOWN)
    spool.append(None, "text", session_key="agent:main:telegram:dm:1", reason=SHUTDOWN)
    recs = list(spool.records())
    assert [(r.session_id, r.seq, r.message) for r in recs] == [
        ("a", 1, {"n": 1}),
        ("a", 2, {"n": 2}),
        ("b", 1, {"n": 9}),
        (None, 1, "text"),
    ]
    assert recs[3].session_key == "agent:main:telegram:dm:1"
    assert [r.message["n"] for r in spool.records(session_id="a")] == [1, 2]
    assert [r.seq for r in spool.records(reasons=[SHUTDOWN])] == [2, 1, 1]
    assert all(r.attempts == 0 and r.last_error is None for r in recs)
    assert recs[0].created_at <= recs[1].created_at


def test_records_pages_through_many_rows(spool):
    """Over several pages, all of them and one session's, its rows between another's
    (so a row's id is not its seq)."""
    spool.append_many([(s, {"i": i}) for i in range(1300) for s in ("s", "t")])
    assert [r.message["i"] for r in spool.records(session_id="s")] == list(range(1300))
    assert [(r.session_id, r.seq) for r in spool.records()] == [
        (s, seq) for seq in range(1, 1301) for s in ("s", "t")
    ]


def test_seq_continues_after_reopen(spool_path):
    with walspool.Spool(spool_path) as s:
        assert [s.append("a", MSG).seq for _ in range(3)] == [1, 2, 3]
    with walspool.Spool(spool_path, durability="normal") as s:
        assert s.append("a", MSG).seq == 4
        assert s.append("new", MSG).seq == 1


def test_seq_never_reused_after_rows_are_removed(spool):
    for _ in range(3):
        spool.append("a", MSG)
    spool.transact(lambda conn: conn.execute("DELETE FROM records"))
    assert spool.append("a", MSG).seq == 4


#: Appends to one session and one key-only stream of the spool at argv[1]; prints seqs.
OTHER_PROCESS = """
import sys, walspool
with walspool.Spool(sys.argv[1]) as spool:
    by_id = spool.append("a", {"by": "other"}).seq
    by_key = spool.append(None, "slot", session_key="k", reason=walspool.SHUTDOWN).seq
print(by_id, by_key)
"""


def test_seq_and_id_continue_after_another_process_appends(spool, spool_path):
    """This spool keeps its next seqs and row id between transactions; a commit by
    another process in between must make it read them again, on either commit path
    (a lone ``append`` on the caller's thread, ``submit`` on the writer thread)."""
    seqs = []
    for _ in range(3):
        by_id = spool.append("a", MSG).seq
        by_key = spool.submit(None, "slot", session_key="k", reason=SHUTDOWN).result(30).seq
        seqs.append((by_id, by_key))
        other = run_python(OTHER_PROCESS, str(spool_path))
        assert other.returncode == 0, other.stderr
        by_id, by_key = map(int, other.stdout.split())
        seqs.append((by_id, by_key))
    assert seqs == [(n, n) for n in range(1, 7)]
    records = list(spool.records())
    assert len(records) == 12 and len({r.id for r in records}) == 12


def test_seq_contiguous_with_64_threads(spool):
    per = 40
    barrier = threading.Barrier(64)
    receipts: dict[int, list] = {}

    def work(i: int) -> None:
        barrier.wait()
        receipts[i] = [spool.append(f"t{i % 8}", {"t": i, "j": j}) for j in range(per)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    by_session: dict[str, list] = {}
    for rec in spool.records():
        by_session.setdefault(rec.session_id, []).append(rec)
    for session, recs in by_session.items():
        assert [r.seq for r in recs] == list(range(1, len(recs) + 1)), session
        # each thread's own messages keep their order within the session
        for i in range(64):
            mine = [r.message["j"] for r in recs if r.message["t"] == i]
            assert mine == sorted(mine)
    assert sum(len(v) for v in by_session.values()) == 64 * per
    assert {r.seq for rs in receipts.values() for r in rs} <= set(range(1, 8 * per + 1))


def test_submit_reserves_order_before_returning(spool):
    lock = threading.Lock()
    futures = []
    with lock:
        for i in range(200):
            futures.append(spool.submit("s", {"i": i}))
    seqs = [f.result(timeout=30).seq for f in futures]
    assert seqs == list(range(1, 201))


def test_append_async_runs_off_the_loop(spool):
    loop_thread: list[int] = []

    async def main():
        loop_thread.append(threading.get_ident())
        return await asyncio.gather(
            *(spool.append_async(f"s{i % 4}", {"i": i}) for i in range(100))
        )

    receipts = asyncio.run(main())
    assert sorted(r.seq for r in receipts if r.session_id == "s0") == list(range(1, 26))
    assert len(list(spool.records())) == 100


def test_append_many_is_one_transaction(spool, spool_path):
    spool.append_many([("s", MSG)] * 10)
    with pytest.raises(walspool.InvalidArgument):
        spool.append_many([("s", MSG), ("", MSG)])
    assert spool.stats().rows == 10
    assert spool.append_many([]) == []


def test_close_commits_everything_accepted(spool_path):
    s = walspool.Spool(spool_path, durability="normal")
    futures = [s.submit("s", {"i": i}) for i in range(500)]
    s.close()
    assert all(f.done() for f in futures)
    with walspool.Spool(spool_path) as again:
        assert again.stats().rows == 500
    with pytest.raises(walspool.SpoolClosed):
        s.append("s", MSG)
    with pytest.raises(walspool.SpoolClosed):
        list(s.records())
    s.close()  # idempotent


def test_stats_counts_rows_bytes_reasons(spool):
    spool.append("a", {"x": 1})
    spool.append("b", {"x": 1}, reason=SHUTDOWN)
    spool.append(None, {"x": 1}, session_key="k", reason=SHUTDOWN)
    st = spool.stats()
    assert (st.rows, st.sessions, st.failing) == (3, 3, 0)
    assert st.bytes == 3 * len('{"x":1}')
    assert st.by_reason == {CAP_DROP: 1, SHUTDOWN: 2}
    assert st.oldest <= st.newest
    assert st.db_bytes > 0


@pytest.mark.parametrize(
    "bad,what",
    [
        ("", "must not be empty"),
        ("x" * (64 * 1024 * 1024 + 1), "over the spool's max_payload_bytes"),
        ("a\udc80", "lone surrogate"),
        (42, "must be a str"),
    ],
)
def test_bad_session_ids_are_refused_clearly(spool, bad, what):
    spool.append("ok", MSG)
    with pytest.raises(walspool.InvalidArgument, match=what):
        spool.append(bad, MSG)
    with pytest.raises(walspool.InvalidArgument, match=what):
        spool.append("s", MSG, reason=bad)
    assert spool.stats().rows == 1


def test_hostile_but_valid_names_are_stored_faithfully(spool):
    names = ["a\x00b", "'; DROP TABLE records; --", "名前 🎉", "x" * 4096]
    for name in names:
        spool.append(name, {"n": name}, reason=name)
    got = [(r.session_id, r.reason, r.message["n"]) for r in spool.records()]
    assert got == [(n, n, n) for n in names]


def test_needs_session_id_or_key(spool):
    with pytest.raises(walspool.InvalidArgument) as info:
        spool.append(None, MSG)
    assert str(info.value) == "a message needs a session_id or a session_key"
    assert info.value.path == str(spool.path)


def test_payload_too_large_names_sizes(spool_path):
    """A payload of exactly ``max_payload_bytes`` is taken; one byte more is refused."""
    with walspool.Spool(spool_path, max_payload_bytes=1000) as s:
        s.append("s", {"c": "x" * 992})  # {"c":"x...x"}: 1000 bytes
        with pytest.raises(walspool.PayloadTooLarge) as info:
            s.append("s", {"c": "x" * 993})
        assert (info.value.size, info.value.limit, info.value.session_id) == (1001, 1000, "s")
        assert info.value.path == str(spool_path)
        assert str(info.value) == (
            "message for session 's' is 1001 bytes as JSON, over the spool's "
            "max_payload_bytes=1000; raise the limit or trim the message"
        )
        assert s.stats().rows == 1


def test_spool_full_keeps_everything_stored(spool_path):
    with walspool.Spool(spool_path, max_bytes=256 * 1024) as s:
        stored = 0
        with pytest.raises(walspool.SpoolFull) as info:
            for _ in range(10_000):
                s.append("s", MSG)
                stored += 1
        assert "is full (max_bytes=262144)" in str(info.value)
        assert info.value.path == str(spool_path)
        assert s.stats().rows == stored > 100
        assert [r.seq for r in s.records()] == list(range(1, stored + 1))
        # a concurrent group with one failure does not fail its neighbours
        with pytest.raises(walspool.SpoolFull):
            s.submit("s", MSG).result(10)


@pytest.mark.parametrize(
    "options, text",
    [
        ({"durability": "sometimes"}, "durability must be 'full' or 'normal', not 'sometimes'"),
        ({"max_payload_bytes": "1000"}, "max_payload_bytes must be an int, not '1000'"),
        ({"max_payload_bytes": True}, "max_payload_bytes must be an int, not True"),
        ({"max_payload_bytes": 0}, "max_payload_bytes must be positive, not 0"),
        ({"max_bytes": 2.5}, "max_bytes must be an int, not 2.5"),
        ({"max_bytes": -1}, "max_bytes must be positive, not -1"),
    ],
)
def test_bad_options_refused(tmp_path: Path, options, text):
    with pytest.raises(walspool.InvalidArgument) as info:
        walspool.Spool(tmp_path / "s.db", **options)
    assert str(info.value) == text
    assert info.value.path == str(tmp_path / "s.db")
    assert not (tmp_path / "s.db").exists()


def test_the_smallest_options_are_taken(tmp_path: Path):
    with walspool.Spool(tmp_path / "s.db", max_payload_bytes=1, durability="normal") as spool:
        assert (spool.max_payload_bytes, spool.durability) == (1, "normal")
        assert repr(spool) == f"Spool({str(tmp_path / 's.db')!r}, durability='normal')"
    with walspool.Spool(tmp_path / "t.db", max_bytes=1 << 20) as spool:
        assert spool.max_bytes == 1 << 20


def test_a_spool_opened_without_a_path_is_spool_db_in_hermes_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HERMES_HOME", str(tmp_path / "home"))
    with walspool.Spool() as spool:
        assert spool.path == tmp_path / "home" / "spool.db"
        spool.append("s", MSG)
    assert (tmp_path / "home" / "spool.db").exists()


def test_public_api_is_pinned():
    assert sorted(walspool.__all__) == sorted([
        "AGENT_HISTORY", "CAP_DROP", "QUARANTINED", "SHUTDOWN", "SUPERSEDED", "DiskFull",
        "ForgetsTickets", "ImportReport", "InvalidArgument", "NotAMessage", "NotASpool",
        "PayloadTooLarge",
        "Receipt", "Record", "ReplayBusy", "ReplayReport", "Replayer", "SchemaTooNew",
        "SessionDBSink", "SessionMissing", "Sink",
        "Spool", "SpoolClosed", "SpoolCorrupt", "SpoolFull", "SpoolIOError", "SpoolReplaced",
        "Stats",
        "StreamReport", "SymlinkRefused", "UnsupportedGateway", "UntrustedSpool", "WalspoolError",
        "WritesMany", "import_json_spool",
    ])  # fmt: skip
    for name in walspool.__all__:
        assert getattr(walspool, name) is not None
    assert walspool.CAP_DROP == "transcript_cap_drop"
    assert walspool.SHUTDOWN == "shutdown"
    assert walspool.AGENT_HISTORY == "shutdown-with-unpersisted-agent-history"


@pytest.mark.parametrize("doc", ["README.md", "docs/spool.md"])
def test_the_docs_spool_example_runs(doc):
    """The spool example of README and of docs/spool.md is real code: run it as written."""
    import re

    from _helpers import ROOT

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), re.S)
    (example,) = [b for b in blocks if "walspool.Spool(" in b and "tempfile" in b]
    exec(compile(example, doc, "exec"), {})


def test_append_many_takes_pairs_and_triples_with_a_session_key(spool):
    receipts = spool.append_many([("s", MSG), (None, {"k": 1}, "key"), ("t", {"t": 1}, "route")])
    assert [(r.session_id, r.session_key, r.seq) for r in receipts] == [
        ("s", None, 1),
        (None, "key", 1),
        ("t", "route", 1),
    ]
    assert [(r.session_id, r.session_key, r.message) for r in spool.records()] == [
        ("s", None, MSG),
        (None, "key", {"k": 1}),
        ("t", "route", {"t": 1}),
    ]


@pytest.mark.parametrize(
    "item, kind", [(["s", MSG], "list"), (("s",), "tuple"), (("s", MSG, None, "x"), "tuple")]
)
def test_append_many_refuses_an_item_that_is_not_a_pair_or_triple(spool, item, kind):
    with pytest.raises(walspool.InvalidArgument) as info:
        spool.append_many([("s", MSG), item])
    assert str(info.value) == (
        "append_many item 1 must be a (session_id, message) or "
        f"(session_id, message, session_key) tuple, not {kind}"
    )
    assert info.value.path == str(spool.path)
    assert spool.stats().rows == 0


def test_append_async_keeps_the_message_and_its_session_key(spool):
    receipt = asyncio.run(spool.append_async(None, MSG, session_key="key", reason=SHUTDOWN))
    assert (receipt.session_id, receipt.session_key, receipt.reason) == (None, "key", SHUTDOWN)
    ((session_key, message),) = [(r.session_key, r.message) for r in spool.records()]
    assert (session_key, message) == ("key", MSG)


def test_stats_counts_the_wal_while_the_spool_is_open(spool, spool_path):
    spool.append("s", MSG)
    wal = Path(f"{spool_path}-wal")
    assert spool.stats().wal_bytes == wal.stat().st_size > 0


def test_the_default_path_is_spool_db_in_hermes_home(monkeypatch, tmp_path):
    from walspool.store.spool import default_path

    monkeypatch.setenv("HERMES_HOME", str(tmp_path / "home"))
    assert default_path() == tmp_path / "home" / "spool.db"
    monkeypatch.setenv("HERMES_HOME", "")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert default_path() == tmp_path / "user" / ".hermes" / "spool.db"
    monkeypatch.delenv("HERMES_HOME")
    assert default_path() == tmp_path / "user" / ".hermes" / "spool.db"


def test_stats_oldest_and_newest_are_the_first_and_last_created(spool):
    spool.append("s", MSG)
    spool.append("t", MSG)
    first, last = spool.records()
    st = spool.stats()
    assert (st.oldest, st.newest) == (first.created_at, last.created_at)


def test_appending_to_a_path_that_names_another_file_says_why(spool, spool_path):
    moved = spool_path.with_name("moved.db")
    for suffix in ("", "-wal", "-shm"):
        os.rename(f"{spool_path}{suffix}", f"{moved}{suffix}")
    with pytest.raises(walspool.SpoolReplaced) as info:
        spool.append("s", MSG)
    assert str(info.value) == (
        f"spool {spool_path} no longer names the file this Spool opened (it was moved, "
        "replaced or deleted); nothing more is appended to it: open the spool again, and "
        "look for the old file beside it"
    )
    assert info.value.path == str(spool_path)


def test_reading_a_path_that_names_another_spool_now_is_refused(spool, spool_path, tmp_path):
    """Another spool renamed over the path after this Spool opened it: a read that opens
    the reader then refuses (it returned the other spool's rows, while the writes of a
    replay reading them went to this Spool's file); a reader opened before goes on
    reading this Spool's file."""
    spool.append("mine", MSG)
    with walspool.Spool(tmp_path / "other" / "spool.db") as other:
        other.append("theirs", MSG)
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(tmp_path / "other" / f"spool.db{suffix}"):
            os.rename(tmp_path / "other" / f"spool.db{suffix}", f"{spool_path}{suffix}")
    with pytest.raises(walspool.SpoolReplaced, match="reading the path would show another"):
        list(spool.records())
    with pytest.raises(walspool.SpoolReplaced):
        spool.stats()


def test_a_reader_opened_before_the_path_changed_keeps_reading_its_file(spool, spool_path):
    spool.append("mine", MSG)
    assert [r.session_id for r in spool.records()] == ["mine"]  # the reader is open now
    moved = spool_path.with_name("moved.db")
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(f"{spool_path}{suffix}"):
            os.rename(f"{spool_path}{suffix}", f"{moved}{suffix}")
    assert [r.session_id for r in spool.records()] == ["mine"]


def test_a_name_may_take_max_payload_bytes_and_no_more(tmp_path):
    with walspool.Spool(tmp_path / "spool.db", max_payload_bytes=1000) as spool:
        spool.append("x" * 1000, MSG)  # exactly the limit
        spool.append("é" * 400, MSG)  # 400 characters, 800 bytes
        with pytest.raises(walspool.InvalidArgument) as info:
            spool.append("é" * 501, MSG)
        assert (
            str(info.value) == "session_id is 1002 bytes, over the spool's max_payload_bytes=1000"
        )
        assert info.value.path == str(spool.path)
        with pytest.raises(walspool.InvalidArgument) as info:
            spool.append(None, MSG, session_key="")
        assert (str(info.value), info.value.path) == (
            "session_key must not be empty",
            str(spool.path),
        )
        with pytest.raises(walspool.InvalidArgument) as info:
            spool.append("s", MSG, reason=7)  # type: ignore[arg-type]
        assert (str(info.value), info.value.path) == (
            "reason must be a str, not int",
            str(spool.path),
        )
        assert spool.stats().rows == 2


@pytest.mark.parametrize(
    "call, text",
    [
        (lambda s: list(s.records(session_id=42)), "session_id must be a str, not int"),
        (
            lambda s: list(s.records(session_id="a\udc80")),
            "session_id 'a\\udc80' contains a lone surrogate, which UTF-8 cannot store",
        ),
        (
            lambda s: list(s.records(reasons="shutdown")),
            "reasons must be a list of reasons, not the string 'shutdown'; "
            "write reasons=['shutdown']",
        ),
        (lambda s: list(s.records(reasons=[42])), "reason must be a str, not int"),
        (lambda s: s.supersede(42), "session_id must be a str, not int"),
    ],
)
def test_a_lookup_the_spool_cannot_make_is_refused_word_for_word(spool, call, text):
    spool.append("s", MSG)
    with pytest.raises(walspool.InvalidArgument) as info:
        call(spool)
    assert str(info.value) == text
    assert info.value.path == str(spool.path)
    assert spool.stats().rows == 1


def test_a_row_whose_payload_is_not_json_is_named_when_read(spool, spool_path):
    spool.append("s", MSG)
    conn = apsw.Connection(str(spool_path))  # an operator's hand edit
    conn.execute("UPDATE records SET payload = '{not json'")
    conn.close()
    with pytest.raises(walspool.SpoolCorrupt) as info:
        list(spool.records())
    text = str(info.value)
    assert text.startswith(f"row 1 (session s, seq 1) of {spool_path} has a payload that is ")
    assert text.endswith("; export the others and delete it by hand")
    assert (info.value.path, info.value.session_id) == (str(spool_path), "s")


def test_reading_a_closed_spool_says_so(spool_path):
    spool = walspool.Spool(spool_path)
    spool.close()
    with pytest.raises(walspool.SpoolClosed) as info:
        list(spool.records())
    assert str(info.value) == f"spool {spool_path} is closed"
    assert info.value.path == str(spool_path)


def test_a_damaged_page_found_by_a_read_is_named_for_its_condition(spool_path):
    """Opening does not scan the table; the read that reaches a damaged page raises the
    error named for it, with the command that checks the file."""
    with walspool.Spool(spool_path) as spool:
        spool.append_many([("s", {"i": i, "pad": "x" * 400}) for i in range(2000)])
    conn = apsw.Connection(str(spool_path))
    leaves = [n for (n,) in conn.execute(
        "SELECT pageno FROM dbstat WHERE name = 'records' AND pagetype = 'leaf' ORDER BY pageno"
    )]  # fmt: skip
    page_size = conn.execute("PRAGMA page_size").get
    conn.close()
    with open(spool_path, "r+b") as f:  # a leaf of the table, halfway: its header
        f.seek((leaves[len(leaves) // 2] - 1) * page_size)
        f.write(b"\xee" * 8)
    with walspool.Spool(spool_path) as spool:
        with pytest.raises(walspool.SpoolCorrupt) as info:
            list(spool.records())
        assert str(info.value) == (
            f"{spool_path}: database disk image is malformed; run `walspool check {spool_path}`"
        )
        assert info.value.path == str(spool_path)


def test_a_spool_path_turned_into_a_link_to_the_same_file_refuses_appends(spool, spool_path):
    """walspool never follows a link at the spool's path, so it does not name the file
    this Spool opened any more, even when the link leads to it: appends are refused, as
    the next open refuses the link."""
    spool.append("s", MSG)
    real = spool_path.with_name("real.db")
    os.rename(spool_path, real)
    os.symlink(real, spool_path)
    with pytest.raises(walspool.SpoolReplaced):
        spool.append("s", MSG)
    with pytest.raises(walspool.SymlinkRefused):
        walspool.Spool(spool_path)


#: Run in another process: the pid holding a POSIX lock on the spool database's shared
#: range (SQLite's read lock while a connection has it open), 0 for none. Linux layout.
PROBE_SQLITE_LOCK = """
import fcntl, os, struct, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
probe = struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 0x40000002, 510, 0)
kind, _, _, _, pid = struct.unpack("hhqqi", fcntl.fcntl(fd, fcntl.F_GETLK, probe))
print(pid if kind != fcntl.F_UNLCK else 0)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="struct flock layout of Linux")
def test_a_second_open_in_the_same_process_keeps_sqlites_locks_of_the_first(spool_path):
    """Closing any descriptor of a file drops every POSIX lock the process holds on it:
    a second Spool on a path this process has open must not open and close the file to
    read its header, or the first one's SQLite locks are gone (and with them what keeps
    other processes from treating the spool as unused)."""

    def holder() -> str:
        return run_python(PROBE_SQLITE_LOCK, str(spool_path)).stdout.strip()

    with walspool.Spool(spool_path) as first:
        first.append("s", MSG)
        assert holder() == str(os.getpid())
        walspool.Spool(spool_path).close()
        assert holder() == str(os.getpid())
        assert first.append("s", MSG).seq == 2


def test_a_spool_overwritten_in_place_after_close_is_refused_as_someone_elses_file(spool_path):
    """Once closed, the file is read afresh at the next open in this process: text
    written over it in place (same inode) is refused and left alone, not moved aside as
    a damaged spool."""
    walspool.Spool(spool_path).close()
    with open(spool_path, "r+b") as f:  # in place: the inode stays
        f.truncate(0)
        f.write(b"my notes\n" * 100)
    with pytest.raises(walspool.NotASpool, match="not a SQLite database"):
        walspool.Spool(spool_path)
    assert spool_path.read_bytes() == b"my notes\n" * 100
    assert not [p for p in spool_path.parent.iterdir() if ".damaged-" in p.name]


def test_a_page_ends_once_its_rows_cost_page_bytes():
    """A page holds rows until what they cost reaches ``PAGE_BYTES`` (the row that
    reaches it included), and at least one row however big. (Rows here have no payload
    to decode: their cost is the last column alone.)"""
    from walspool.store.paging import PAGE_BYTES, read_page

    conn = apsw.Connection(":memory:")
    sql = (
        # RECORD_COLUMNS' eleven, then the cost
        "SELECT key, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, value "
        "FROM json_each(:sizes) "
        "WHERE key >= :after ORDER BY key"
    )

    def page(*sizes: int) -> tuple[list[int], bool]:
        rows, full = read_page(conn, sql, {"sizes": json.dumps(sizes), "after": 0}, limit=10)
        return [r[-1] for r in rows], full

    assert page(PAGE_BYTES - 1, 1, 5) == ([PAGE_BYTES - 1, 1], True)
    assert page(PAGE_BYTES - 2, 1, 5) == ([PAGE_BYTES - 2, 1, 5], True)
    assert page(3 * PAGE_BYTES, 5) == ([3 * PAGE_BYTES], True)
    assert page(1, 2) == ([1, 2], False)
    assert page(*[1] * 10, 1) == ([1] * 10, True)  # the row limit


def test_a_spool_whose_writer_cannot_start_closes_what_its_open_took(spool_path, monkeypatch):
    """A failure after the file is open (no thread for the writer, say) closes the
    connection and the open lock: nothing is left open, and the next open works."""

    def no_thread(*args: object, **kwargs: object) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(walspool.store.spool, "Writer", no_thread)
    with pytest.raises(RuntimeError, match="can't start new thread") as info:
        walspool.Spool(spool_path)
    assert descriptors_on(spool_path) == []  # while the error still holds its frames
    del info
    monkeypatch.undo()
    with walspool.Spool(spool_path) as spool:
        assert spool.append("s", MSG).seq == 1


@pytest.mark.parametrize("how", ["deleted", "moved"])
def test_put_nowait_gets_the_path_check_append_gets(spool, how):
    """The gateway link's non-blocking path is refused as ``append`` is once the path no
    longer names the spool's file: ``check_path`` raises at once, and rows handed over
    fail when their group commits (the writer's check), none written to the old file."""
    row = spool.prepare("s", {"content": "m"}, CAP_DROP)
    assert spool.stats().rows == 0  # its reader is open on the file from now on
    spool.check_path()  # names it still
    if how == "deleted":
        spool.path.unlink()
    else:
        spool.path.rename(spool.path.with_name("moved.db"))
    with pytest.raises(walspool.SpoolReplaced, match="no longer names the file"):
        spool.check_path()
    done: list = []
    spool.put_nowait((row,), done.append)
    spool.flush()
    (request,) = done
    assert isinstance(request.error, walspool.SpoolReplaced)
    assert request.error.session_id == "s"
    assert spool.stats().rows == 0


def test_the_internal_surface_answers_as_the_spool_is(spool):
    assert not spool.has_replayable() and not spool.busy() and spool.has_room()
    spool.append("s", {"content": "h"}, reason=walspool.AGENT_HISTORY)
    assert not spool.has_replayable()  # agent histories are never replayed
    done: list = []
    spool.put_nowait((spool.prepare("s", {"content": "m"}, CAP_DROP),), done.append)
    spool.flush()
    (request,) = done
    assert request.error is None and request.result.seq == 2
    assert spool.has_replayable()
    assert not spool.closed
    spool.close()
    assert spool.closed


class _TimeRaises:
    """A timestamp whose every attribute access (``__class__`` included) raises."""

    def __getattribute__(self, name: str) -> object:
        raise RuntimeError(f"no {name}")

    def __repr__(self) -> str:
        return "<TimeRaises>"


def test_a_message_whose_timestamp_raises_when_inspected_is_appended_as_it_is(spool):
    """A timestamp that raises when looked at is no time: the message is appended with
    the value converted by the codec's rule (its repr), its other fields as they were."""
    message = {"role": "assistant", "content": "c", "timestamp": _TimeRaises()}
    assert spool.append("s", message).seq == 1
    (rec,) = spool.records()
    assert rec.message == {"role": "assistant", "content": "c", "timestamp": "<TimeRaises>"}


@pytest.mark.parametrize("how", ["moved", "replaced"])
def test_supersede_after_the_path_is_replaced_marks_the_file_this_spool_opened(
    spool, spool_path, how
):
    """``supersede`` (a transcript rewrite) and ``transact`` take no path check: they only
    change or take out rows of the file this Spool opened, so they act on that file (the
    moved one, whose rows an operator may still replay) and never on whatever the path
    names now; appends, which would leave new rows where no start looks, are refused."""
    for i in range(3):
        spool.append("s", {"content": f"m{i}"})
    moved = spool_path.with_name("moved.db")
    for suffix in ("", "-wal", "-shm"):
        os.rename(f"{spool_path}{suffix}", f"{moved}{suffix}")
    fresh = walspool.Spool(spool_path) if how == "replaced" else None
    try:
        with pytest.raises(walspool.SpoolReplaced):
            spool.append("s", {"content": "late"})
        assert spool.supersede("s") == 3
        assert spool.transact(lambda conn: conn.execute("SELECT count(*) FROM records").get) == 3
        if fresh is not None:
            assert fresh.stats().rows == 0  # the file now at the path is untouched
        else:
            assert not spool_path.exists()  # nothing was created there
    finally:
        if fresh is not None:
            fresh.close()
    spool.close()
    with walspool.Spool(moved) as old:
        assert [(r.message["content"], r.status) for r in old.records()] == [
            (f"m{i}", "superseded") for i in range(3)
        ]
