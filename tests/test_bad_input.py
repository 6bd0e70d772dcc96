"""Bad input everywhere: each gets a clear error or is stored faithfully, nothing is lost.

Hostile session ids and reasons on every way in (append, append_many, submit,
append_async, records, replay, the gateway link, the shutdown_flush drop-ins, the
command line); payloads at and over the size limit; a spool whose bookkeeping was
edited by hand; a state.db with broken FTS, a missing session, or a read-only file.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import apsw
import pytest
from _helpers import ROOT, MemorySink

import walspool
from walspool import AGENT_HISTORY, CAP_DROP, SHUTDOWN
from walspool import shutdown_flush as sf
from walspool.cli import main
from walspool.replay.replayer import Replayer
from walspool.replay.sinks import SessionDBSink

hermes_state = pytest.importorskip("hermes_state")

BREAK = (
    "CREATE TRIGGER broken BEFORE INSERT ON messages BEGIN "
    "SELECT RAISE(ABORT, 'database disk image is malformed'); END"
)

#: Names the spool must store and find exactly as given. Their test ids are plain words
#: (``ODD_IDS``; pytest refuses a list of another length): ids made from these values'
#: ``repr`` were "not found" when mutmut passed them back to pytest.
ODD_BUT_VALID = [
    "a\x00b",
    "'); DROP TABLE records;--",
    '" OR 1=1 --',
    "x" * 4096,
    "x" * 100_000,  # state.db takes any length: so does the spool
    "ü🙂 \u202e/..\\",
    " ",
    "\n",
    "%s %d {0} ? :name @p $1",
    "NULL",
]
ODD_IDS = ["nul", "sql-quote", "sql-or", "x4096", "x100000", "unicode-rtl-path", "space",
           "newline", "format-chars", "NULL"]  # fmt: skip
#: (value, what the error says) for names the spool cannot store as given.
UNSTORABLE = [
    ("", "must not be empty"),
    ("x" * (64 * 1024 * 1024 + 1), "over the spool's max_payload_bytes=67108864"),
    ("\ud800", "lone surrogate"),
    ("\udcff", "lone surrogate"),  # what os.fsdecode makes of a non-UTF-8 byte
    (5, "must be a str, not int"),
    (b"bytes", "must be a str, not bytes"),
    (1.5, "must be a str, not float"),
    (object(), "must be a str, not object"),
]
UNSTORABLE_IDS = ["empty", "over-max", "surrogate-d800", "surrogate-dcff", "int", "bytes",
                  "float", "object"]  # fmt: skip


def msg(i: int, session: str = "s") -> dict[str, Any]:
    return {"role": "user", "content": f"{session}-{i}", "timestamp": 1_700_000_000 + i}


def snapshot(spool: walspool.Spool) -> list[tuple[Any, ...]]:
    return [(r.session_id, r.session_key, r.seq, r.reason, r.message) for r in spool.records()]


def raw(path: Path, sql: str, params: Any = ()) -> list[tuple[Any, ...]]:
    """Run SQL on the spool file on a connection of its own (an operator's hand edit)."""
    conn = apsw.Connection(str(path))
    try:
        conn.set_busy_timeout(5000)
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def check(path: Path) -> tuple[int, dict[str, Any]]:
    rc, out, _ = run_cli("check", str(path), "--json")
    return rc, json.loads(out)


def has_surrogate(value: Any) -> bool:
    return isinstance(value, str) and any("\ud800" <= c <= "\udfff" for c in value)


def looks_up(fn: Callable[[], Any], says: str | None, nothing: Any) -> None:
    """A lookup by a name that cannot have been stored: a str SQLite can be asked about
    finds ``nothing`` (``says`` is None); any other value is an ``InvalidArgument`` that
    ``says`` why (``spool.check_lookup``)."""
    if says is None:
        assert fn() == nothing
    else:
        with pytest.raises(walspool.InvalidArgument, match=re.escape(says)):
            fn()


@pytest.fixture
def state_db(tmp_path: Path) -> Iterator[Any]:
    db = hermes_state.SessionDB(db_path=tmp_path / "state.db")
    yield db
    db.close()


def db_contents(db: Any, session_id: str) -> list[str]:
    return [m["content"] for m in db.get_messages(session_id, include_inactive=True)]


# -- hostile names on the way in ---------------------------------------------------


@pytest.mark.parametrize(("value", "says"), UNSTORABLE, ids=UNSTORABLE_IDS)
@pytest.mark.parametrize("where", ["session_id", "session_key", "reason"])
def test_unstorable_names_are_refused_on_every_append_path(spool, value, says, where):
    spool.append("keep", msg(0))
    before = snapshot(spool)

    def args() -> tuple[Any, dict[str, Any]]:
        if where == "session_id":
            return value, {}
        if where == "session_key":
            return None, {"session_key": value}
        return "s", {"reason": value}

    session_id, kw = args()
    with pytest.raises(walspool.InvalidArgument, match=rf"^{where}\b.*{re.escape(says)}") as info:
        spool.append(session_id, msg(1), **kw)
    assert info.value.path == str(spool.path)
    with pytest.raises(walspool.InvalidArgument, match=says):
        spool.submit(session_id, msg(1), **kw)
    with pytest.raises(walspool.InvalidArgument, match=says):
        asyncio.run(spool.append_async(session_id, msg(1), **kw))
    # all or nothing: a good item before the bad one is not committed either
    if where == "reason":
        with pytest.raises(walspool.InvalidArgument, match=says):
            spool.append_many([("s", msg(2))], reason=value)
    else:
        item = (value, msg(3)) if where == "session_id" else (None, msg(3), value)
        with pytest.raises(walspool.InvalidArgument, match=says):
            spool.append_many([("keep", msg(2)), item])
    assert snapshot(spool) == before


def test_a_message_needs_a_session_id_or_a_key(spool):
    with pytest.raises(walspool.InvalidArgument, match="needs a session_id or a session_key"):
        spool.append(None, msg(0))
    assert snapshot(spool) == []


@pytest.mark.parametrize("name", ODD_BUT_VALID, ids=ODD_IDS)
def test_odd_names_are_stored_found_and_replayed_faithfully(spool, name):
    spool.append("other", msg(0, "other"))
    spool.append(name, msg(0, name), reason=name)
    spool.append_many([(name, msg(1, name))], reason=name)
    spool.submit(name, msg(2, name), reason=name).result(timeout=30)
    asyncio.run(spool.append_async(name, msg(3, name), reason=name))
    spool.append(None, msg(4, name), session_key=name, reason=name)
    mine = list(spool.records(session_id=name))
    assert [(r.session_id, r.seq, r.reason, r.message) for r in mine] == [
        (name, i + 1, name, msg(i, name)) for i in range(4)
    ]
    assert len(list(spool.records(reasons=[name]))) == 5
    assert spool.stats().by_reason == {CAP_DROP: 1, name: 5}
    # the hostile text never became SQL: the tables are all there
    assert check(spool.path)[0] == 0

    sink = MemorySink()
    report = Replayer(spool, sink, resolver=lambda key: name).replay(
        session_id=name, reasons=[name]
    )
    assert (report.moved, report.held) == (4, 0)
    assert sink.rows == [(name, msg(i, name)) for i in range(4)]
    report = Replayer(spool, sink, resolver=lambda key: name).replay(reasons=[name])
    assert (report.moved, report.held) == (1, 0)
    assert sink.rows[-1] == (name, msg(4, name))
    assert snapshot(spool) == [("other", None, 1, CAP_DROP, msg(0, "other"))]


@pytest.mark.parametrize(
    "value, says",
    [
        (5, "must be a str, not int"),
        (b"bytes", "must be a str, not bytes"),
        (None, "must be a str, not NoneType"),
        (1.5, "must be a str, not float"),
        ("", None),
        ("x" * 100_000, None),
    ],
    ids=lambda v: repr(v)[:20],
)
def test_lookups_by_names_never_stored_find_nothing_or_say_why(spool, value, says):
    spool.append("s", msg(0))
    looks_up(lambda: list(spool.records(reasons=[value])), says, [])
    if value is not None:  # session_id=None means every session
        looks_up(lambda: list(spool.records(session_id=value)), says, [])
        looks_up(lambda: moved_or_held(spool, session_id=value), says, 0)
    looks_up(lambda: moved_or_held(spool, reasons=[value]), says, 0)
    assert len(snapshot(spool)) == 1


def moved_or_held(spool: walspool.Spool, **kw: Any) -> int:
    report = Replayer(spool, MemorySink()).replay(**kw)
    return report.moved + report.held


@pytest.mark.parametrize("value", ["\ud800", "\udcff"], ids=["d800", "dcff"])
def test_lookups_by_lone_surrogates_say_why(spool, value):
    spool.append("s", msg(0))
    says = "contains a lone surrogate, which UTF-8 cannot store"
    looks_up(lambda: list(spool.records(session_id=value)), says, None)
    looks_up(lambda: list(spool.records(reasons=[value])), says, None)
    looks_up(lambda: moved_or_held(spool, session_id=value), says, None)
    looks_up(lambda: moved_or_held(spool, reasons=[value]), says, None)
    assert len(snapshot(spool)) == 1


def test_reasons_given_as_one_string_are_not_split_into_characters(spool):
    spool.append("s", msg(0), reason=SHUTDOWN)
    says = "reasons must be a list of reasons, not the string 'shutdown'; write reasons=["
    with pytest.raises(walspool.InvalidArgument, match=re.escape(says)):
        list(spool.records(reasons=SHUTDOWN))  # type: ignore[arg-type]
    with pytest.raises(walspool.InvalidArgument, match=re.escape(says)):
        Replayer(spool, MemorySink()).replay(reasons=SHUTDOWN)  # type: ignore[arg-type]
    assert len(snapshot(spool)) == 1


def test_append_many_refuses_malformed_items(spool):
    for items in ([("s",)], ["ab"], [("s", 1, None, "extra")], [None]):
        with pytest.raises(walspool.InvalidArgument):
            spool.append_many(items)  # type: ignore[arg-type]
    assert snapshot(spool) == []


# -- payloads at and over the limit ----------------------------------------------------


def test_payload_at_the_limit_is_stored_one_byte_more_is_refused_everywhere(spool_path):
    limit = 1000
    at = "x" * (limit - 2)  # a JSON string: two quotes around it
    with walspool.Spool(spool_path, max_payload_bytes=limit) as spool:
        assert spool.append("s", at).seq == 1
        assert spool.submit("s", at).result(timeout=30).seq == 2
        assert asyncio.run(spool.append_async("s", at)).seq == 3
        assert [r.seq for r in spool.append_many([("s", at)])] == [4]
        over = at + "y"
        attempts: list[Callable[[], Any]] = [
            lambda: spool.append("s", over),
            lambda: spool.submit("s", over),
            lambda: asyncio.run(spool.append_async("s", over)),
            lambda: spool.append_many([("s", at), ("s", over)]),
        ]
        for attempt in attempts:
            with pytest.raises(walspool.PayloadTooLarge) as info:
                attempt()
            assert (info.value.size, info.value.limit, info.value.session_id) == (
                limit + 1,
                limit,
                "s",
            )
            assert str(info.value) == (
                f"message for session 's' is {limit + 1} bytes as JSON, over the spool's "
                f"max_payload_bytes={limit}; raise the limit or trim the message"
            )
        # nothing already spooled was dropped, the all-or-nothing batch left nothing
        assert [(r.seq, r.message) for r in spool.records()] == [(i, at) for i in range(1, 5)]
        # a multi-byte character counts as its UTF-8 bytes
        assert spool.append("s", "é" * ((limit - 2) // 2)).seq == 5
        with pytest.raises(walspool.PayloadTooLarge):
            spool.append("s", "é" * ((limit - 2) // 2 + 1))


def test_default_limit_is_64_mib_exactly(spool):
    at = "x" * (64 * 1024 * 1024 - 2)
    spool.append("s", at)
    with pytest.raises(walspool.PayloadTooLarge, match="max_payload_bytes=67108864"):
        spool.append("s", at + "x")
    (rec,) = spool.records()
    assert rec.message == at


@pytest.mark.parametrize("bad", [0, -1])
def test_limits_must_be_positive(spool_path, bad):
    with pytest.raises(walspool.InvalidArgument, match="must be positive"):
        walspool.Spool(spool_path, max_payload_bytes=bad)
    with pytest.raises(walspool.InvalidArgument, match="must be positive"):
        walspool.Spool(spool_path, max_bytes=bad)


# -- bookkeeping edited by hand ----------------------------------------------------------


def filled(path: Path) -> None:
    with walspool.Spool(path) as spool:
        spool.append_many([("s", msg(i)) for i in range(3)] + [("t", msg(0, "t"))])


def seqs(path: Path, session: str) -> list[int]:
    with walspool.Spool(path) as spool:
        return [r.seq for r in spool.records(session_id=session)]


def replay_all(path: Path, sink: MemorySink) -> walspool.ReplayReport:
    with walspool.Spool(path) as spool:
        report = Replayer(spool, sink, batch_rows=2).replay()
        assert list(spool.records()) == []
        return report


def test_a_stream_emptied_by_hand_never_reuses_a_seq(spool_path):
    """Rows deleted in an operator's shell (no replay involved) keep their stream's
    next seq: the delete itself records it in `sequences`, and check finds nothing."""
    filled(spool_path)
    assert raw(spool_path, "SELECT count(*) FROM sequences") == [(0,)]  # appends write none
    raw(spool_path, "DELETE FROM records WHERE session_id = 's'")
    assert raw(spool_path, "SELECT stream, name, next_seq FROM sequences") == [
        ("session_id", "s", 4)
    ]
    with walspool.Spool(spool_path) as spool:
        assert spool.append("s", msg(3)).seq == 4  # not 1
    assert check(spool_path)[0] == 0


def test_a_seq_moved_by_hand_is_never_reused(spool_path):
    """An operator renumbering the last row down (or moving it to another stream)
    leaves its old seq used: the update records it."""
    filled(spool_path)
    raw(spool_path, "UPDATE records SET seq = 10 WHERE session_id = 's' AND seq = 3")
    raw(spool_path, "UPDATE records SET seq = 3 WHERE session_id = 's' AND seq = 10")
    with walspool.Spool(spool_path) as spool:
        assert spool.append("s", msg(3)).seq == 11
    raw(spool_path, "UPDATE records SET session_id = 'u' WHERE session_id = 't'")
    with walspool.Spool(spool_path) as spool:
        assert spool.append("t", msg(1, "t")).seq == 2
        assert [r.seq for r in spool.records(session_id="u")] == [1]


def test_deleted_sequences_row_with_rows_left(spool_path):
    filled(spool_path)
    raw(spool_path, "DELETE FROM records WHERE session_id = 's' AND seq = 3")
    raw(spool_path, "DELETE FROM sequences WHERE name = 's'")  # the kept number, gone
    with walspool.Spool(spool_path) as spool:
        # Only rows 1 and 2 say what was used: 3 is handed out again. This is the one
        # edit the spool cannot see through, and check cannot tell it from a stream that
        # never lost a row (`sequences` holds rows only for streams that did).
        assert spool.append("s", msg(3)).seq == 3
    assert check(spool_path)[0] == 0


def test_next_seq_set_below_existing_seqs(spool_path):
    filled(spool_path)
    raw(spool_path, "INSERT INTO sequences VALUES ('session_id', 's', 1)")
    with walspool.Spool(spool_path) as spool:
        # the rows say 3 was used, whatever the bookkeeping says
        assert [r.seq for r in spool.append_many([("s", msg(3)), ("s", msg(4))])] == [4, 5]
    assert check(spool_path)[0] == 0
    sink = MemorySink()
    replay_all(spool_path, sink)
    assert [m for s, m in sink.rows if s == "s"] == [msg(i) for i in range(5)]
    assert raw(spool_path, "SELECT next_seq FROM sequences WHERE name = 's'") == [(6,)]


def test_records_row_with_a_bogus_seq(spool_path):
    filled(spool_path)
    raw(
        spool_path,
        "INSERT INTO records (session_id, seq, reason, created_at, payload, size) "
        "VALUES ('s', 1000, ?1, 0, ?2, length(CAST(?2 AS BLOB)))",
        (CAP_DROP, json.dumps(msg(1000))),
    )
    assert check(spool_path)[0] == 0  # a gap in a stream's seqs is no problem
    with walspool.Spool(spool_path) as spool:
        assert spool.append("s", msg(1001)).seq == 1001
        with pytest.raises(apsw.ConstraintError):  # the spool itself refuses a duplicate seq
            raw(
                spool_path,
                "INSERT INTO records (session_id, seq, reason, created_at, payload) "
                "VALUES ('s', 2, 'x', 0, '1')",
            )
    assert check(spool_path)[0] == 0
    sink = MemorySink()
    assert replay_all(spool_path, sink).moved == 6
    assert [m["content"] for s, m in sink.rows if s == "s"] == [
        "s-0",
        "s-1",
        "s-2",
        "s-1000",
        "s-1001",
    ]


def test_records_row_inserted_out_of_id_order(spool_path):
    filled(spool_path)
    raw(spool_path, "DELETE FROM records WHERE session_id = 's' AND seq = 2")
    raw(
        spool_path,
        "INSERT INTO records (id, session_id, seq, reason, created_at, payload, size) "
        "VALUES (100, 's', 2, ?1, 0, ?2, length(CAST(?2 AS BLOB)))",
        (CAP_DROP, json.dumps(msg(1))),
    )
    rc, result = check(spool_path)
    assert rc == 1
    assert result["problems"] == [
        "1 rows whose seq is not above the seq of the row before them (by id) in their stream"
    ]
    with walspool.Spool(spool_path) as spool:
        assert spool.append("s", msg(3)).seq == 4
    sink = MemorySink()
    replay_all(spool_path, sink)
    assert [m for s, m in sink.rows if s == "s"] == [msg(i) for i in range(4)]  # seq order


@pytest.mark.parametrize("mark", [0, -1, 2**62, "next"])
def test_inflight_set_by_hand_never_duplicates(spool_path, state_db, mark):
    """In-flight marks on rows no replay had out: each row still lands exactly once."""
    state_db.create_session("s", "cli")
    state_db.create_session("t", "cli")
    state_db.append_message("s", "user", "already there", timestamp=1.0)
    filled(spool_path)
    # "next": the ticket number the replay itself gives its first row.
    value = (
        raw(spool_path, "SELECT value FROM spool_meta WHERE name = 'next_ticket'")[0][0]
        if mark == "next"
        else mark
    )
    raw(spool_path, "UPDATE records SET inflight = ? WHERE seq IN (1, 3)", (value,))
    rc, result = check(spool_path)
    assert rc == 0 and "3 rows in flight" in result["notes"][0]
    with walspool.Spool(spool_path) as spool:
        assert spool.append("s", msg(3)).seq == 4
        report = Replayer(spool, SessionDBSink(state_db), batch_rows=2).replay()
        assert (report.moved, report.held, report.recovered) == (5, 0, 0)
        assert list(spool.records()) == []
    # Exactly once. Not in seq order: a replay writes a stream's in-flight rows before
    # its idle ones, and a mark set by hand on seq 1 and 3 but not 2 is a state no
    # replay leaves behind (a batch always has the lowest idle seqs of its stream out).
    landed = db_contents(state_db, "s")
    assert landed[0] == "already there"
    assert sorted(landed[1:]) == [f"s-{i}" for i in range(4)]
    assert db_contents(state_db, "t") == ["t-0"]
    assert check(spool_path)[0] == 0


def test_inflight_on_random_rows_with_a_memory_sink(spool_path):
    with walspool.Spool(spool_path) as spool:
        spool.append_many([(s, msg(i, s)) for i in range(20) for s in "abc"])
    # scattered rows of every session, with scattered marks (see the test above on order)
    raw(spool_path, "UPDATE records SET inflight = id % 5 WHERE (id * 7919) % 4 = 0")
    marked = "FROM records WHERE inflight NOT NULL"
    assert raw(spool_path, f"SELECT count(*), count(DISTINCT session_id) {marked}") == [(15, 3)]
    sink = MemorySink()
    replay_all(spool_path, sink)
    assert len(sink.rows) == 60
    for s in "abc":
        landed = [m for sid, m in sink.rows if sid == s]
        assert sorted(landed, key=lambda m: m["timestamp"]) == [msg(i, s) for i in range(20)]


def test_check_reports_a_payload_that_is_not_json(spool_path):
    filled(spool_path)
    raw(
        spool_path,
        "INSERT INTO records (session_id, seq, reason, created_at, payload, size) "
        "VALUES ('bad', 1, ?, 0, 'not json', 8)",
        (CAP_DROP,),
    )
    raw(spool_path, "INSERT INTO sequences VALUES ('session_id', 'bad', 2)")
    rc, result = check(spool_path)
    # Each bad row named by id, session and seq (issue 13, defect 11).
    assert rc == 1 and result["problems"] == [
        "1 rows whose payload is not valid JSON: id 5 (session bad, seq 1)"
    ]


def _not_json_row(path: Path) -> None:
    filled(path)
    raw(
        path,
        "INSERT INTO records (session_id, seq, reason, created_at, payload) "
        "VALUES ('bad', 1, ?, 0, 'not json'), ('bad', 2, ?, 0, '{\"content\": \"after\"}')",
        (CAP_DROP, CAP_DROP),
    )
    raw(path, "INSERT INTO sequences VALUES ('session_id', 'bad', 3)")


def test_a_payload_that_is_not_json_is_quarantined_and_its_session_goes_on(spool_path):
    _not_json_row(spool_path)
    sink = MemorySink()
    with walspool.Spool(spool_path) as spool:
        report = Replayer(spool, sink).replay()
        assert (report.moved, report.held, report.quarantined) == (5, 0, 1)
        assert report.sessions["bad"].quarantined == 1
    assert [m for s, m in sink.rows if s == "s"] == [msg(i) for i in range(3)]
    assert sink.contents("bad") == ["after"]
    kept = raw(spool_path, "SELECT session_id, status, last_error FROM records")
    assert len(kept) == 1 and kept[0][:2] == ("bad", "quarantined") and "JSON" in kept[0][2]


def test_reading_a_payload_that_is_not_json_is_a_walspool_error(spool_path):
    _not_json_row(spool_path)
    with walspool.Spool(spool_path) as spool, pytest.raises(walspool.WalspoolError, match="JSON"):
        list(spool.records())


# -- state.db that cannot take the rows ------------------------------------------------


def spool_for(tmp_path: Path, sessions: list[str], n: int = 3) -> walspool.Spool:
    spool = walspool.Spool(tmp_path / "spool" / "spool.db")
    spool.append_many([(s, msg(i, s)) for s in sessions for i in range(n)])
    return spool


def test_corrupt_fts_index_is_repaired_by_session_db_and_rows_land_once(tmp_path, state_db):
    state_db.create_session("s", "cli")
    state_db.append_message("s", "user", "before")
    with state_db._lock:
        state_db._conn.execute("UPDATE messages_fts_data SET block = x'deadbeefdeadbeef'")
    with spool_for(tmp_path, ["s"]) as spool:
        report = Replayer(spool, SessionDBSink(state_db)).replay()
        assert (report.moved, report.held) == (3, 0)
        assert list(spool.records()) == []
    assert db_contents(state_db, "s") == ["before", "s-0", "s-1", "s-2"]


def test_dropped_fts_shadow_table_holds_rows_until_healed(tmp_path, state_db):
    state_db.create_session("s", "cli")
    state_db.create_session("t", "cli")
    with state_db._lock:
        state_db._conn.execute("DROP TABLE messages_fts_data")
    with spool_for(tmp_path, ["s", "t"]) as spool:
        before = snapshot(spool)
        for attempt in (1, 2):
            report = Replayer(spool, SessionDBSink(state_db)).replay()
            assert (report.moved, report.held) == (0, 6)
            assert report.errors == dict.fromkeys(
                ("s", "t"), "DatabaseError: database disk image is malformed"
            )
            assert snapshot(spool) == before
            assert [r.attempts for r in spool.records() if r.seq == 1] == [attempt, attempt]
        assert db_contents(state_db, "s") == []
        with state_db._lock:  # an operator's repair: the broken index no longer gates inserts
            state_db._conn.execute("DROP TRIGGER messages_fts_insert")
        report = Replayer(spool, SessionDBSink(state_db)).replay()
        assert (report.moved, report.held, report.recovered) == (6, 0, 0)
    for s in ("s", "t"):
        assert db_contents(state_db, s) == [f"{s}-{i}" for i in range(3)]


def test_missing_sessions_with_hostile_ids_are_held_then_created(tmp_path, state_db):
    names = ["'); DROP TABLE sessions;--", "a\x00b", "ü🙂"]
    with spool_for(tmp_path, names) as spool:
        report = Replayer(spool, SessionDBSink(state_db)).replay()
        assert (report.moved, report.held) == (0, 9)
        for name in names:
            assert report.errors[name] == (
                f"session {name} does not exist in state.db (FOREIGN KEY constraint "
                "failed); replay with create_missing=True to create it"
            )
        report = Replayer(spool, SessionDBSink(state_db, create_missing=True)).replay()
        assert (report.moved, report.held) == (9, 0)
    for name in names:
        assert db_contents(state_db, name) == [f"{name}-{i}" for i in range(3)]
        assert state_db.get_session(name)["source"] == "walspool"


def test_read_only_session_db_holds_rows_with_a_clear_error(tmp_path, state_db):
    state_db.create_session("s", "cli")
    read_only = hermes_state.SessionDB(db_path=tmp_path / "state.db", read_only=True)
    try:
        with spool_for(tmp_path, ["s"]) as spool:
            before = snapshot(spool)
            report = Replayer(spool, SessionDBSink(read_only)).replay()
            assert (report.moved, report.held) == (0, 3)
            assert report.errors == {"s": "OperationalError: attempt to write a readonly database"}
            assert snapshot(spool) == before
            report = Replayer(spool, SessionDBSink(state_db)).replay()
            assert (report.moved, report.held) == (3, 0)
    finally:
        read_only.close()
    assert db_contents(state_db, "s") == ["s-0", "s-1", "s-2"]


@contextlib.contextmanager
def read_only_file(path: Path) -> Iterator[None]:
    """Make ``path`` unwritable for this process: 0444, or immutable when we are root."""
    if os.geteuid() != 0:
        os.chmod(path, 0o444)
        try:
            yield
        finally:
            os.chmod(path, 0o600)
        return
    chattr = shutil.which("chattr")
    if chattr is None or subprocess.run([chattr, "+i", str(path)], capture_output=True).returncode:
        pytest.skip("running as root, and this file system cannot make a file immutable")
    try:
        yield
    finally:
        subprocess.run([chattr, "-i", str(path)], check=True)


def test_cli_replay_into_a_read_only_state_db_keeps_every_row(tmp_path):
    db = hermes_state.SessionDB(db_path=tmp_path / "state.db")
    db.create_session("s", "cli")
    db.close()
    with spool_for(tmp_path, ["s"]) as spool:
        before = snapshot(spool)
    spool_path = str(tmp_path / "spool" / "spool.db")
    with read_only_file(tmp_path / "state.db"):
        rc, out, err = run_cli("replay", spool_path, "--into", str(tmp_path / "state.db"))
    # The pre-check writes (and rolls back) before the spool is touched: one line, exit 1
    # (issue 13, defect 5; the rows used to be held one session after another).
    assert (rc, out) == (1, ""), err
    assert err.startswith("walspool replay: cannot write state.db at ") and err.count("\n") == 1
    assert "attempt to write a readonly database" in err
    with walspool.Spool(spool_path) as spool:
        assert snapshot(spool) == before
    rc, out, err = run_cli("replay", spool_path, "--into", str(tmp_path / "state.db"))
    assert rc == 0, err
    db = hermes_state.SessionDB(db_path=tmp_path / "state.db")
    assert db_contents(db, "s") == ["s-0", "s-1", "s-2"]
    db.close()


# -- the gateway link -------------------------------------------------------------------


def test_gateway_link_with_hostile_session_ids(store, hermes_home, caplog):
    from walspool.hermes import install

    good = ["'); DROP TABLE records;--", "a\x00b", "x" * 4096, "y" * 5000, "ü🙂/..\\"]
    bad = [""]
    for s in good + bad:
        store._db.create_session(s, "telegram")
    with walspool.Spool(hermes_home / "spool.db") as spool:
        install(store, spool, retry_interval=0)
        with store._db._lock:
            store._db._conn.execute(BREAK)
        with caplog.at_level(logging.WARNING, logger="walspool"):
            for s in good + bad:
                for i in range(203):
                    store.append_to_transcript(s, {"role": "user", "content": f"m{i}"})
            spool.flush()
        assert spool.stats().rows == 3 * len(good)
        assert {r.session_id for r in spool.records()} == set(good)
        # what the spool cannot store falls back to the released drop-and-warn, saying why
        drops = [r.getMessage() for r in caplog.records if "dropping oldest" in r.getMessage()]
        assert len(drops) == 3 * len(bad)
        assert sum("session_id must not be empty" in d for d in drops) == 3
        with store._db._lock:
            store._db._conn.execute("DROP TRIGGER broken")
        for s in good + bad:
            store.append_to_transcript(s, {"role": "user", "content": "fin"})
        for s in good:
            assert [m["content"] for m in store._db.get_messages(s)] == [
                f"m{i}" for i in range(203)
            ] + ["fin"], repr(s)[:30]
        for s in bad:  # "fin" made 201 queued, so one more was dropped
            assert [m["content"] for m in store._db.get_messages(s)] == [
                f"m{i}" for i in range(4, 203)
            ] + ["fin"]
        assert spool.stats().rows == 0


# -- the shutdown_flush drop-ins -------------------------------------------------------


@pytest.fixture
def home(tmp_path: Path, monkeypatch) -> Iterator[Path]:
    home = tmp_path / "hermes"
    monkeypatch.setenv("HERMES_HOME", str(home))
    monkeypatch.setattr(hermes_state, "DEFAULT_DB_PATH", home / "state.db")
    yield home
    sf.close_shared_spools()


@pytest.mark.parametrize(
    "value", [v for v, _ in UNSTORABLE] + [None], ids=[*UNSTORABLE_IDS, "None"]
)
def test_shutdown_flush_never_raises_for_unstorable_ids(home, value):
    message = {"role": "user", "content": "x"}
    assert sf.spool_dropped_transcript_message(value, message) is None
    if isinstance(value, (str, int, float, bytes, type(None))) and not has_surrogate(value):
        assert sf.drain_transcript_spool(value, lambda m: None) == (0, 0)
    # one bad slot key costs only that slot
    assert sf.flush_pending_to_file({value: "lost", "good": "kept"}) == 1
    assert sf.flush_pending_to_file({"k": "t"}, reason=value) == 0
    sf.flush_agent_history_to_file(value, [{"role": "user", "content": "h"}])  # never raises
    with walspool.Spool(home / "spool.db") as spool:
        rows = [(r.session_key, r.reason, r.message) for r in spool.records()]
    assert (("good", SHUTDOWN, {"text": "kept"})) in rows
    assert all(r[1] != CAP_DROP for r in rows)


@pytest.mark.parametrize("value", ["\udcff", object(), ["s"]], ids=["surrogate", "object", "list"])
def test_drain_with_an_id_no_row_can_have_returns_nothing(home, value):
    assert sf.drain_transcript_spool(value, lambda m: None) == (0, 0)


@pytest.mark.parametrize("name", ODD_BUT_VALID[:3], ids=ODD_IDS[:3])
def test_shutdown_flush_round_trip_with_odd_ids(home, name):
    for i in range(3):
        assert sf.spool_dropped_transcript_message(name, msg(i, name)) == home / "spool.db"
    seen: list[Any] = []
    assert sf.drain_transcript_spool(name, seen.append) == (3, 0)
    assert seen == [msg(i, name) for i in range(3)]
    assert sf.flush_pending_to_file({name: "slot"}) == 1
    sf.flush_agent_history_to_file(name, [{"role": "user", "content": "h"}])
    with walspool.Spool(home / "spool.db") as spool:
        rows = [(r.session_id, r.session_key, r.reason) for r in spool.records()]
    assert rows == [(None, name, SHUTDOWN), (name, None, AGENT_HISTORY)]


# -- the command line --------------------------------------------------------------------


@pytest.mark.parametrize("name", ODD_BUT_VALID, ids=ODD_IDS)
def test_cli_show_and_export_find_odd_sessions(spool, name):
    spool.append(name, msg(0, name))
    spool.append("other", msg(0, "other"))
    rc, out, err = run_cli("show", str(spool.path), name, "--json")
    assert (rc, err) == (0, "")
    (row,) = json.loads(out)
    assert (row["session_id"], row["seq"]) == (name, 1)
    rc, out, err = run_cli("export", str(spool.path), "--session", name)
    assert (rc, err) == (0, "")
    assert [json.loads(line)["message"] for line in out.splitlines()] == [msg(0, name)]


@pytest.mark.parametrize("name", ["", "nobody", "x" * 5000, "'; --"], ids=repr)
def test_cli_show_of_an_unknown_session_is_one_line_on_stderr(spool, name):
    spool.append("s", msg(0))
    rc, out, err = run_cli("show", str(spool.path), name)
    assert (rc, out) == (1, "")
    assert err == f"walspool show: no rows for session {name!r} in {spool.path}\n"


@pytest.mark.parametrize("command", ["show", "export"])
def test_cli_with_a_non_utf8_session_argument_is_one_line_on_stderr(spool, command):
    spool.append("s", msg(0))
    name = os.fsdecode(b"\xff")
    argv = (
        ["show", str(spool.path), name]
        if command == "show"
        else ["export", str(spool.path), "--session", name]
    )
    rc, _, err = run_cli(*argv)
    assert rc == 1 and err.count("\n") == 1 and err.startswith(f"walspool {command}: ")


# -- message timestamps ------------------------------------------------------------------


@pytest.mark.parametrize("ts", ["nan", "NaN", "inf", "-inf", "Infinity", "1e999", "-1e999"])
def test_a_non_finite_message_timestamp_falls_back_to_the_spool_time(spool, state_db, ts):
    """``float()`` reads these strings as NaN or an infinity: the message is written
    with the time it was spooled, as a timestamp that is not a time at all would be
    (a NaN would reach state.db as NULL and the row would be refused)."""
    state_db.create_session("s", "cli")
    spool.append("s", {"role": "user", "content": "odd time", "timestamp": ts})
    spool.append("s", {"role": "user", "content": "own time", "timestamp": 1_700_000_000.5})
    spooled_at = {r.message["content"]: r.created_at for r in spool.records()}
    report = Replayer(spool, SessionDBSink(state_db)).replay()
    assert (report.moved, report.held, report.quarantined) == (2, 0, 0), report.errors
    landed = [(m["content"], m["timestamp"]) for m in state_db.get_messages("s")]
    assert landed == [("odd time", spooled_at["odd time"]), ("own time", 1_700_000_000.5)]


# -- a payload that is not UTF-8 ---------------------------------------------------------


def spool_with_a_payload_not_utf8(path: Path) -> int:
    """Three rows in two sessions; the first one's payload made bytes that are not
    UTF-8 (0xff inside a string: a hand edit or a damaged page). Its row id."""
    with walspool.Spool(path) as spool:
        bad = spool.append("s1", {"role": "user", "content": "a"}).id
        spool.append("s1", {"role": "user", "content": "b"})
        spool.append("s2", {"role": "user", "content": "c"})
    with apsw.Connection(str(path)) as conn:
        conn.execute(
            "UPDATE records SET payload = CAST(CAST(? AS BLOB) AS TEXT) WHERE id = ?",
            (b'{"role":"user","content":"\xff"}', bad),
        )
    return bad


def test_a_payload_that_is_not_utf8_is_one_bad_row(tmp_path, capsys):
    """``show``, ``export`` and a replay meet a row whose payload is not UTF-8: it is
    flagged (a one-line error, exit 1; the --json error object), quarantined by the
    replay, and every other row and session goes on (before: a UnicodeDecodeError
    traceback from show and export, and a replay that wrote nothing)."""
    path = tmp_path / "spool.db"
    bad = spool_with_a_payload_not_utf8(path)
    assert main(["show", str(path), "s1"]) == 1
    out, err = capsys.readouterr()
    assert "[NOT JSON]" in out and "user: b" in out
    assert f"id {bad} (session s1, seq 1)" in err and "Traceback" not in err
    assert main(["export", str(path), "--json"]) == 1
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line.get("message") for line in lines[:3]] == [
        None,
        {"role": "user", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert "Invalid UTF-8" in lines[0]["bad_payload"]["error"]
    assert lines[3]["command"] == "export" and lines[3]["exit"] == 1
    sink = MemorySink()
    with walspool.Spool(path) as spool:
        report = walspool.Replayer(spool, sink).replay()
        assert (report.moved, report.quarantined) == (2, 1)
    assert [m["content"] for _, m in sink.rows] == ["b", "c"]
    with apsw.Connection(str(path)) as conn:
        ((row_id, status, last_error),) = conn.execute(
            "SELECT id, status, last_error FROM records"
        ).fetchall()
    assert (row_id, status) == (bad, walspool.QUARANTINED) and "not valid JSON" in last_error


# -- a session id, reason or key that is not UTF-8 ---------------------------------------


def spool_with_names_not_utf8(path: Path) -> dict[str, int]:
    """Good rows in sessions a and c; a row of b whose reason, a row whose session id
    (b'b\\xff'), a row whose session key (b'k\\xff', by key only) and a row of a whose last
    error are bytes that are not UTF-8 (hand edits in the sqlite3 shell). Their ids."""
    with walspool.Spool(path) as spool:
        ids = {
            "a1": spool.append("a", {"role": "user", "content": "a1"}).id,
            "reason": spool.append("b", {"role": "user", "content": "b1"}).id,
            "a2": spool.append("a", {"role": "user", "content": "a2"}).id,
            "id": spool.append("x", {"role": "user", "content": "x1"}).id,
            "key": spool.append(None, {"role": "user", "content": "k1"}, session_key="k").id,
            "c1": spool.append("c", {"role": "user", "content": "c1"}).id,
        }
    with apsw.Connection(str(path)) as conn:
        for column, value, which in (
            ("reason", b"r\xff", "reason"),
            ("session_id", b"b\xff", "id"),
            ("session_key", b"k\xff", "key"),
            ("last_error", b"e\xff", "a1"),
        ):
            conn.execute(
                f"UPDATE records SET {column} = CAST(? AS TEXT) WHERE id = ?", (value, ids[which])
            )
    return ids


def test_names_that_are_not_utf8_are_bad_rows_and_the_rest_goes_on(tmp_path, capsys):
    """Every command meets rows whose session id, reason or key (or last error) are bytes
    that are not UTF-8: none fails with a traceback. ``ls``, ``stats``, ``metrics`` list
    them, the bytes escaped (``\\\\udcff``, ``$'b\\\\xff'`` to paste); ``show`` and
    ``export`` flag them (exit 1, one line naming them) and give every other row; the
    replay quarantines them, saying which column, and moves the others in order;
    ``check`` names them; ``drop`` removes one, its audit keeping the exact bytes (before:
    a UnicodeDecodeError traceback from ls, stats, show, export, metrics, replay and the
    gateway's start)."""
    path = tmp_path / "spool.db"
    ids = spool_with_names_not_utf8(path)
    bad_id = os.fsdecode(b"b\xff")

    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([argv[0], str(path), *argv[1:]])
        out, err = capsys.readouterr()
        assert "Traceback" not in out + err, argv
        return code, out, err

    code, out, _ = run("ls")
    assert code == 0 and "$'b\\xff'" in out and "$'key:k\\xff'" in out and "e\\udcff" in out
    code, out, _ = run("ls", "--json")
    assert code == 0 and {s["session_id"] for s in json.loads(out)} == {"a", "b", bad_id, "c", None}
    code, out, _ = run("stats", "--json")
    assert code == 0 and json.loads(out)["by_reason"][os.fsdecode(b"r\xff")] == 1
    assert run("stats")[0] == 0 and run("metrics")[0] == 0

    code, out, err = run("show", bad_id)  # as a shell gives $'b\xff' to Python
    assert code == 1 and "[NOT UTF-8]" in out and err.count("\n") == 1
    assert f"id {ids['id']} (session b\\udcff, seq 1)" in err
    code, out, err = run("export")
    lines = [json.loads(line) for line in out.splitlines()]
    assert code == 1 and err.count("\n") == 1
    flagged = {line["id"] for line in lines if "bad_payload" in line}
    assert flagged == {ids["reason"], ids["id"], ids["key"]}
    assert {line["id"]: line.get("message") for line in lines}[ids["c1"]] == {
        "role": "user",
        "content": "c1",
    }
    code, out, _ = run("check", "--json")
    (problem,) = json.loads(out)["problems"]
    assert code == 1 and problem.startswith("3 rows whose session id, reason or session key")

    sink = MemorySink()
    with walspool.Spool(path) as spool:
        report = Replayer(spool, sink).replay()  # every reason but agent history
    assert (report.moved, report.quarantined) == (3, 2)
    assert [m["content"] for _, m in sink.rows] == ["a1", "a2", "c1"]
    with apsw.Connection(str(path)) as conn:
        errors = dict(conn.execute("SELECT id, last_error FROM records WHERE status IS NOT NULL"))
    assert "has a reason that is not UTF-8" in errors[ids["reason"]]
    assert "has a session id that is not UTF-8" in errors[ids["id"]]
    with walspool.Spool(path) as spool:  # the key's row, held until a resolver finds it
        report = Replayer(spool, sink, resolver=lambda key: "a").replay()
    assert (report.moved, report.quarantined) == (0, 1)
    with apsw.Connection(str(path)) as conn:
        (error,) = conn.execute("SELECT last_error FROM records WHERE id = ?", (ids["key"],))
    assert "has a session key that is not UTF-8" in error[0]

    assert run("drop", "--id", str(ids["id"]), "--yes")[0] == 0
    with apsw.Connection(str(path)) as conn:
        ((session, detail),) = conn.execute(
            "SELECT CAST(session_id AS BLOB), detail FROM audit WHERE record_id = ?", (ids["id"],)
        )
    assert session == b"b\xff" and json.loads(detail)["payload"] == '{"role":"user","content":"x1"}'


def test_the_shell_word_ls_prints_for_an_id_that_is_not_utf8_finds_its_row(tmp_path, capsys):
    """``ls`` prints an id holding a byte that is not UTF-8 as ``$'b\\\\xff'``; pasted
    into bash, it gives ``show`` that byte, and ``show`` finds the row."""
    path = tmp_path / "spool.db"
    ids = spool_with_names_not_utf8(path)
    capsys.readouterr()
    assert main(["ls", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    (word,) = [line.split()[0] for line in lines if line.startswith("$'b")]
    assert word == "$'b\\xff'"
    command = f"{shlex.quote(sys.executable)} -m walspool show {shlex.quote(str(path))} {word}"
    done = subprocess.run(
        ["bash", "-c", command + " --json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT), "LC_ALL": "C.UTF-8"},
    )
    assert done.returncode == 1, done.stderr  # found, and flagged
    assert [row["id"] for row in json.loads(done.stdout.splitlines()[0])] == [ids["id"]]
