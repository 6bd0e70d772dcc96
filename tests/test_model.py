"""A hypothesis stateful model of the spool: append, submit, replay with sink failures,
crashes, reopen and JSON import, checked against a plain in-memory model.

Every message carries a unique ``uid``, so wherever a message is (spool, sink, both)
the model knows which append it came from. After every step:

* every seq a stream ever handed out strictly increases in append order (so a seq is
  never reused, also across drains, reopens and imports);
* every message appended is in the spool or in the sink, and in the sink at most once;
  it is in both only while its spool row is in flight (a crash cut the replay short
  after the sink's commit);
* per stream and reason, the sink holds a prefix of the append order, and, while no
  replay chose rows by reason, per stream too;
* each message reads back equal to what was appended.

At teardown a clean replay moves everything exactly once and ``walspool check`` passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import shutil
import tempfile
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import apsw
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import walspool
from walspool import AGENT_HISTORY, CAP_DROP, SHUTDOWN
from walspool.cli import main as cli_main
from walspool.replay.replayer import Replayer
from walspool.store.records import Record

#: Streams as the spool keys them: ("session_id" | "session_key", name).
ID_STREAMS = [
    ("session_id", "a"),
    ("session_id", "b"),
    ("session_id", "ü'); DROP TABLE records;--"),
]
KEY_STREAMS = [("session_key", "k1"), ("session_key", "k2")]
STREAMS = ID_STREAMS + KEY_STREAMS
#: Where a key stream's rows go; k2 resolves only while the model says so.
KEY_TARGET = {"k1": "a", "k2": "b"}
REASONS = [CAP_DROP, SHUTDOWN, AGENT_HISTORY]
IMPORT_TS = 1_760_000_000

streams = st.sampled_from(STREAMS)
reasons = st.sampled_from(REASONS)
failures = st.one_of(
    st.just(("none", None)),
    st.tuples(st.just("refuse_session"), st.sampled_from(["a", "b", ID_STREAMS[2][1]])),
    st.tuples(st.just("refuse_nth"), st.integers(1, 6)),
    st.tuples(st.just("crash_before"), st.integers(1, 6)),
    st.tuples(st.just("crash_after"), st.integers(1, 6)),
)


class Crash(BaseException):
    """Stands in for the process dying: nothing after it runs."""


class ModelSink:
    """The ``walspool.Sink`` protocol over a list, with injected failures."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, Any]] = []
        self.tickets: set[tuple[str, int, int]] = set()
        self.failure: tuple[str, Any] = ("none", None)
        self.writes = 0

    def write(self, session_id: str, record: Record, ticket: tuple[str, int, int]) -> None:
        self.writes += 1
        kind, arg = self.failure
        if kind == "refuse_session" and session_id == arg:
            raise RuntimeError(f"sink refuses session {session_id}")
        if kind == "refuse_nth" and self.writes == arg:
            raise RuntimeError(f"sink refuses write {arg}")
        if kind == "crash_before" and self.writes == arg:
            raise Crash
        self.rows.append((session_id, record.message))
        self.tickets.add(ticket)
        if kind == "crash_after" and self.writes == arg:
            raise Crash

    def landed(self, tickets: list[tuple[str, int, int]]) -> set[tuple[str, int, int]]:
        return {t for t in tickets if t in self.tickets}


def stream_of(session_id: str | None, session_key: str | None) -> tuple[str, str]:
    if session_id is not None:
        return ("session_id", session_id)
    assert session_key is not None
    return ("session_key", session_key)


class SpoolModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="walspool-model-"))
        self.path = self.tmp / "spool" / "spool.db"
        self.pending = self.tmp / "pending_messages"
        self.pending.mkdir()
        self.spool = walspool.Spool(self.path, durability="normal")
        self.sink = ModelSink()
        self.next_uid = 0
        # uid -> (stream, reason, message as it must read back)
        self.appended: dict[int, tuple[tuple[str, str], str, Any]] = {}
        self.order: dict[tuple[str, str], list[int]] = {s: [] for s in STREAMS}
        self.seq_of: dict[int, int] = {}
        self.k2_resolves = True
        self.chose_by_reason = False

    # -- helpers -----------------------------------------------------------------

    def _message(self, stream: tuple[str, str], reason: str) -> tuple[int, dict[str, Any]]:
        uid = self.next_uid
        self.next_uid += 1
        return uid, {"uid": uid, "role": "user", "content": f"{stream[1]}-{uid}", "n": [uid, None]}

    def _expect(self, uid: int, stream: tuple[str, str], reason: str, message: Any) -> None:
        self.appended[uid] = (stream, reason, message)
        self.order[stream].append(uid)

    def _receipt(self, uid: int, receipt: walspool.Receipt, stream: tuple[str, str]) -> None:
        assert stream_of(receipt.session_id, receipt.session_key) == stream
        self.seq_of[uid] = receipt.seq

    def _args(self, stream: tuple[str, str]) -> tuple[str | None, str | None]:
        return (stream[1], None) if stream[0] == "session_id" else (None, stream[1])

    def _resolver(self, key: str) -> str | None:
        if key == "k2" and not self.k2_resolves:
            return None
        return KEY_TARGET.get(key)

    def _spool_rows(self) -> list[tuple[int, Record, int | None]]:
        """(uid, record, inflight) of every spool row, read as an operator would."""
        inflight = {}
        conn = apsw.Connection(str(self.path), flags=apsw.SQLITE_OPEN_READONLY)
        try:
            for row_id, mark in conn.execute("SELECT id, inflight FROM records"):
                inflight[row_id] = mark
        finally:
            conn.close()
        rows = []
        for rec in self.spool.records():
            message = rec.message
            uid = message["uid"] if "uid" in message else message["data_uid"]
            rows.append((uid, rec, inflight.get(rec.id)))
        return rows

    # -- appending ---------------------------------------------------------------

    @rule(stream=streams, reason=reasons)
    def append(self, stream: tuple[str, str], reason: str) -> None:
        uid, message = self._message(stream, reason)
        session_id, session_key = self._args(stream)
        receipt = self.spool.append(session_id, message, reason=reason, session_key=session_key)
        self._expect(uid, stream, reason, message)
        self._receipt(uid, receipt, stream)

    @rule(items=st.lists(streams, max_size=6), reason=reasons)
    def append_many(self, items: list[tuple[str, str]], reason: str) -> None:
        batch = []
        for stream in items:
            uid, message = self._message(stream, reason)
            session_id, session_key = self._args(stream)
            batch.append((uid, stream, message, (session_id, message, session_key)))
        receipts = self.spool.append_many([b[3] for b in batch], reason=reason)
        assert len(receipts) == len(batch)
        for (uid, stream, message, _), receipt in zip(batch, receipts, strict=True):
            self._expect(uid, stream, reason, message)
            self._receipt(uid, receipt, stream)

    @rule(items=st.lists(streams, min_size=1, max_size=5), reason=reasons)
    def submit(self, items: list[tuple[str, str]], reason: str) -> None:
        futures = []
        for stream in items:
            uid, message = self._message(stream, reason)
            session_id, session_key = self._args(stream)
            future = self.spool.submit(session_id, message, reason=reason, session_key=session_key)
            # submit takes the place in order now, so the model records it now
            self._expect(uid, stream, reason, message)
            futures.append((uid, stream, future))
        for uid, stream, future in futures:
            self._receipt(uid, future.result(timeout=30), stream)

    @rule(items=st.lists(streams, min_size=1, max_size=4))
    def append_async(self, items: list[tuple[str, str]]) -> None:
        batch = [(stream, *self._message(stream, CAP_DROP)) for stream in items]

        async def go() -> list[walspool.Receipt]:
            tasks = []
            for stream, _uid, message in batch:
                session_id, session_key = self._args(stream)
                tasks.append(self.spool.append_async(session_id, message, session_key=session_key))
            return await asyncio.gather(*tasks)

        # gather schedules the tasks in order, and each queues its row before it yields
        for stream, uid, message in batch:
            self._expect(uid, stream, CAP_DROP, message)
        for (stream, uid, _), receipt in zip(batch, asyncio.run(go()), strict=True):
            self._receipt(uid, receipt, stream)

    # -- importing upstream's JSON files -------------------------------------------

    @rule(
        files=st.lists(
            st.tuples(st.sampled_from(["cap_drop", "slot", "slot_by_id", "history"]), streams),
            min_size=1,
            max_size=5,
        )
    )
    def import_json(self, files: list[tuple[str, tuple[str, str]]]) -> None:
        written = []
        for kind, stream in files:
            uid = self.next_uid
            self.next_uid += 1
            ts = IMPORT_TS + uid  # strictly increasing, so the file order is the drop order
            if kind in ("cap_drop", "history") or (kind == "slot_by_id"):
                if stream[0] != "session_id":
                    stream = ID_STREAMS[uid % len(ID_STREAMS)]
            elif stream[0] != "session_key":
                stream = KEY_STREAMS[uid % len(KEY_STREAMS)]
            name = stream[1]
            if kind == "cap_drop":
                message: Any = {"uid": uid, "role": "user", "content": f"{name}-{uid}"}
                payload = {
                    "session_key": name,
                    "reason": CAP_DROP,
                    "ts": ts,
                    "seq": uid,
                    "data": {"session_id": name, "message": message},
                }
                reason = CAP_DROP
            elif kind == "history":
                payload = {
                    "reason": AGENT_HISTORY,
                    "session_id": name,
                    "count": 1,
                    "messages": [{"role": "user", "content": "h"}],
                    "uid": uid,
                }
                message, reason = payload, AGENT_HISTORY
            else:
                data: dict[str, Any] = {"text": f"{name}-{uid}", "data_uid": uid}
                key = name if stream[0] == "session_key" else "k1"
                if stream[0] == "session_id":
                    data["session_id"] = name
                payload = {
                    "session_key": key,
                    "reason": SHUTDOWN,
                    "ts": ts,
                    "seq": uid,
                    "data": data,
                }
                message, reason = {**data, "timestamp": ts}, SHUTDOWN
            # Named like upstream's pending-<uuid4 hex>.json, but reproducibly.
            name = f"pending-{uuid.UUID(int=(uid * 0x9E3779B97F4A7C15) % 2**128).hex}.json"
            fd = os.open(self.pending / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with open(fd, "w") as f:
                json.dump(payload, f, indent=2, ensure_ascii=False)
            # upstream's drop order (ts, seq, file name); a history file has neither
            key = (ts, uid, name) if kind != "history" else (0, -1, name)
            written.append((key, uid, stream, reason, message))
        report = walspool.import_json_spool(self.spool, self.pending)
        assert report.imported == len(written) and report.skipped == []
        assert os.listdir(self.pending) == []
        for _, uid, stream, reason, message in sorted(written, key=lambda w: w[0]):
            self._expect(uid, stream, reason, message)
        # imports hand out no receipts: learn their seqs from the spool
        for uid, rec, _ in self._spool_rows():
            self.seq_of.setdefault(uid, rec.seq)

    # -- replaying, failing and crashing ---------------------------------------------

    @rule(
        only=st.none() | st.sampled_from([s[1] for s in ID_STREAMS]),
        by_reason=st.none() | st.sampled_from([[CAP_DROP], [SHUTDOWN], [AGENT_HISTORY]]),
        limit=st.none() | st.integers(0, 5),
        batch_rows=st.integers(1, 4),
        failure=failures,
        reopen_after_crash=st.booleans(),
    )
    def replay(
        self,
        only: str | None,
        by_reason: list[str] | None,
        limit: int | None,
        batch_rows: int,
        failure: tuple[str, Any],
        reopen_after_crash: bool,
    ) -> None:
        self.sink.failure, self.sink.writes = failure, 0
        before = len(self.sink.rows)
        if by_reason is not None:
            self.chose_by_reason = True
        replayer = Replayer(self.spool, self.sink, resolver=self._resolver, batch_rows=batch_rows)
        try:
            report = replayer.replay(session_id=only, reasons=by_reason, limit=limit)
        except Crash:
            if reopen_after_crash:
                # The process died mid-batch: whatever it had out stays in flight, and
                # the next process opens the spool afresh.
                self.spool.close()
                self.spool = walspool.Spool(self.path, durability="normal")
            return
        finally:
            self.sink.failure = ("none", None)
        assert report.moved == len(self.sink.rows) - before
        if failure[0] in ("none", "crash_before", "crash_after") and report.errors:
            # only an unresolvable key stream may hold without an injected refusal
            assert set(report.errors) <= {"k2"}, report.errors

    @rule()
    def reopen(self) -> None:
        self.spool.close()
        self.spool = walspool.Spool(self.path, durability="normal")

    @rule()
    def toggle_k2(self) -> None:
        self.k2_resolves = not self.k2_resolves

    # -- the invariants ------------------------------------------------------------

    @invariant()
    def seqs_increase_and_are_never_reused(self) -> None:
        for stream, uids in self.order.items():
            seqs = [self.seq_of[u] for u in uids if u in self.seq_of]
            assert seqs == sorted(set(seqs)), (stream, seqs)
            assert len(seqs) == len(uids), f"{stream}: a message's seq was never seen"

    @invariant()
    def everything_exactly_once_in_order(self) -> None:
        spool_rows = self._spool_rows()
        in_spool = Counter(uid for uid, _, _ in spool_rows)
        assert max(in_spool.values(), default=1) == 1, "a row is in the spool twice"
        sink_uids = []
        for session_id, message in self.sink.rows:
            uid = message["uid"] if "uid" in message else message["data_uid"]
            stream, _, expected = self.appended[uid]
            assert message == expected
            target = stream[1] if stream[0] == "session_id" else KEY_TARGET[stream[1]]
            assert session_id == target, (uid, session_id, target)
            sink_uids.append(uid)
        in_sink = Counter(sink_uids)
        assert max(in_sink.values(), default=1) == 1, f"duplicated in the sink: {in_sink}"
        for uid, rec, inflight in spool_rows:
            stream, reason, expected = self.appended[uid]
            assert stream_of(rec.session_id, rec.session_key) == stream
            assert (rec.reason, rec.message, rec.seq) == (reason, expected, self.seq_of[uid])
            if uid in in_sink:
                assert inflight is not None, f"uid {uid} is in the sink and idle in the spool"
        assert set(in_spool) | set(in_sink) == set(self.appended), "a message was lost"
        for stream, uids in self.order.items():
            moved = [u for u in sink_uids if self.appended[u][0] == stream]
            for reason in REASONS:
                of_reason = [u for u in uids if self.appended[u][1] == reason]
                moved_of_reason = [u for u in moved if self.appended[u][1] == reason]
                assert moved_of_reason == of_reason[: len(moved_of_reason)], (stream, reason)
            if not self.chose_by_reason:
                replayable = [u for u in uids if self.appended[u][1] != AGENT_HISTORY]
                moved = [u for u in moved if self.appended[u][1] != AGENT_HISTORY]
                assert moved == replayable[: len(moved)], stream

    def teardown(self) -> None:
        try:
            self.k2_resolves = True
            self.sink.failure = ("none", None)
            replayer = Replayer(self.spool, self.sink, resolver=self._resolver)
            report = replayer.replay()
            assert report.held == 0, report.errors
            assert replayer.replay(reasons=[AGENT_HISTORY]).held == 0
            assert list(self.spool.records()) == []
            self.everything_exactly_once_in_order()
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                assert cli_main(["check", str(self.path)]) == 0, out.getvalue() + err.getvalue()
        finally:
            self.spool.close()
            shutil.rmtree(self.tmp, ignore_errors=True)


SpoolModel.TestCase.settings = settings(
    max_examples=int(os.environ.get("WALSPOOL_MODEL_EXAMPLES", "100")),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSpoolModel = SpoolModel.TestCase


def test_limit_caps_rows_written_from_an_earlier_replay_too(tmp_path):
    sink = ModelSink()
    with walspool.Spool(tmp_path / "spool.db", durability="normal") as spool:
        spool.append_many([("a", {"uid": i}) for i in range(3)])
        sink.failure = ("refuse_nth", 1)
        assert Replayer(spool, sink).replay().held == 3  # seq 1 stays in flight
        sink.failure = ("none", None)
        report = Replayer(spool, sink).replay(limit=0)
        assert report.moved == 0 and sink.rows == []
