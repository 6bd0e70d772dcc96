"""The in-memory backlog's publisher (``walspool.link.memory``) on a real 0.19.0
``SessionStore``'s queues, and what the spool keeps of it (``walspool.store.memory``).
On all three gateways through the plugin: ``tests/contract/test_memory.py``."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import subprocess
import sys

import apsw
from _lock_holder import write_lock_held

import walspool
from walspool.cli import main
from walspool.gateways.session_store import StoreTranscripts
from walspool.link.memory import HEARTBEAT_SECONDS, MemoryPublisher
from walspool.store import memory


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def queue(store, session_id: str, *contents: str) -> None:
    """Messages waiting in the store's queue, as a failed write leaves them."""
    with store._transcript_retry_lock:
        pending = store._dirty_transcripts.setdefault(session_id, [])
        pending += [{"role": "user", "content": c} for c in contents]


def test_a_process_that_holds_nothing_writes_nothing(store, spool):
    publisher = MemoryPublisher(lambda: spool, lambda: [StoreTranscripts(store)])
    assert publisher.publish() is None
    assert spool.memory() == []


def test_what_the_queues_hold_is_published_with_the_age_of_the_oldest(store, spool):
    clock = Clock()
    publisher = MemoryPublisher(lambda: spool, lambda: [StoreTranscripts(store)], clock=clock)
    queue(store, "a", "one", "two")
    publisher.publish().result()  # queued, and committed
    clock.now += 30
    queue(store, "b", "three")
    publisher.publish().result()
    (entry,) = spool.memory()
    held = entry.held
    assert (entry.alive, held.pid, held.sessions, held.messages) == (True, os.getpid(), 2, 3)
    assert held.oldest_at == 1_000.0  # first seen then, whatever happened since
    assert [(s.session_id, s.messages, s.oldest_at) for s in held.top] == [
        ("a", 2, 1_000.0),
        ("b", 1, 1_030.0),
    ]
    assert held.bytes == sum(
        len(json.dumps(m, separators=(",", ":")))
        for q in store._dirty_transcripts.values()
        for m in q
    )


def test_past_the_top_sessions_the_largest_are_named_ties_oldest_first(store, spool):
    """Totals count every session; ``top`` names the TOP_SESSIONS holding the most,
    the one first seen earlier first among those holding as many."""
    clock = Clock()
    publisher = MemoryPublisher(lambda: spool, lambda: [StoreTranscripts(store)], clock=clock)
    extra = 7
    for n in range(memory.TOP_SESSIONS + extra):
        clock.now = 1_000.0 + (n % 3)  # first seen at one of three times
        queue(store, f"s{n}", *["m"] * (1 + n % 4))
        publisher.look()  # each message's first sight recorded now
    held = publisher.look()
    sent = {f"s{n}": 1 + n % 4 for n in range(memory.TOP_SESSIONS + extra)}
    seen = {f"s{n}": 1_000.0 + (n % 3) for n in range(len(sent))}
    assert (held.sessions, held.messages) == (len(sent), sum(sent.values()))
    assert held.oldest_at == 1_000.0
    expected = sorted(sent, key=lambda sid: (-sent[sid], seen[sid]))[: memory.TOP_SESSIONS]
    assert [(s.session_id, s.messages, s.oldest_at) for s in held.top] == [
        (sid, sent[sid], seen[sid]) for sid in expected
    ]


def test_an_unchanged_backlog_is_published_again_only_when_due(store, spool):
    clock = Clock()
    publisher = MemoryPublisher(lambda: spool, lambda: [StoreTranscripts(store)], clock=clock)
    queue(store, "a", "one")
    publisher.publish().result()
    clock.now += HEARTBEAT_SECONDS - 1
    assert publisher.publish() is None
    clock.now += 1
    assert publisher.publish() is not None


def test_an_emptied_queue_removes_the_entry(store, spool):
    publisher = MemoryPublisher(lambda: spool, lambda: [StoreTranscripts(store)])
    queue(store, "a", "one")
    publisher.publish().result()
    with store._transcript_retry_lock:
        store._dirty_transcripts.clear()
    publisher.publish().result()
    assert spool.memory() == []


def test_nothing_more_is_queued_while_a_publication_waits_for_a_lock_held_elsewhere(store, spool):
    """Another process holds the spool's write lock: the first entry waits in the
    writer, later looks queue nothing, and once the lock goes the newest is published."""
    publisher = MemoryPublisher(lambda: spool, lambda: [StoreTranscripts(store)])
    with write_lock_held(spool.path):
        queue(store, "a", "one")
        first = publisher.publish()
        assert first is not None
        queue(store, "a", "two")
        assert publisher.publish() is None  # the first is not committed yet
    try:
        first.result(timeout=30)
    except Exception:  # noqa: BLE001 - the first may have given up on the lock
        pass
    publisher.publish().result(timeout=30)
    (entry,) = spool.memory()
    assert entry.held.messages == 2


def test_an_entry_of_a_gone_process_says_it_was_lost(spool, capsys):
    """A process that published and then died (SIGKILL): every reader names its
    messages as lost; an entry an operator garbled is skipped."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = memory.this_host()
    held = memory.Held(
        pid=dead.pid,
        host=host,
        started=None,
        at=1_000.0,
        sessions=1,
        messages=7,
        bytes=70,
        oldest_at=990.0,
        top=[memory.HeldSession("a", 7, 70, 990.0)],
    )
    spool.publish_memory(dead.pid, host, held).result()
    spool.transact(
        lambda conn: conn.execute("INSERT INTO spool_meta VALUES ('memory:1@x', 'not json')")
    )
    (entry,) = spool.memory()
    assert (entry.alive, entry.held.messages) == (False, 7)
    assert main(["stats", str(spool.path)]) == 0
    out = capsys.readouterr().out
    assert "in memory   LOST: 7 messages in 1 session, oldest " in out
    assert f"in the memory of pid {dead.pid}, which is gone" in out
    assert main(["ls", str(spool.path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("in memory: LOST: 7 messages")


def test_a_session_held_only_in_memory_is_named_so_by_the_commands_that_take_a_session(
    spool, capsys
):
    """`show s1` on a session whose messages are all in a gateway's queues said "no rows
    for session": each command that takes a session says what a live process holds of
    it (lost if killed), or what a gone one lost, and still exits 1 (nothing to show)."""
    spool.append("other", {"role": "user", "content": "spooled"})
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = memory.this_host()
    for pid, messages in ((os.getpid(), 30), (dead.pid, 4)):
        held = memory.Held(pid, host, memory.started(pid), 1_000.0, 1, messages, 10, 990.0,
                           [memory.HeldSession("s1", messages, 10, 990.0)])  # fmt: skip
        spool.publish_memory(pid, host, held).result()
    live = (
        f"; 30 messages of it are in the memory of pid {os.getpid()}, not spooled yet "
        "(lost if the process is killed)"
    )
    gone = f"; 4 messages of it were lost with pid {dead.pid}, which is gone"
    path = str(spool.path)
    for argv in (
        ["show", path, "s1"],
        ["export", path, "--session", "s1"],
        ["requeue", path, "--session", "s1"],
        ["drop", path, "--session", "s1"],
    ):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert err == f"walspool {argv[0]}: no rows for session 's1' in {path}{live}{gone}\n"
    assert main(["show", path, "s2"]) == 1
    assert "memory" not in capsys.readouterr().err  # nobody holds s2


def test_a_publisher_starting_takes_in_what_gone_processes_of_its_host_lost(
    store, spool, capsys, caplog
):
    """The next gateway on the host says in its log what each gone process lost, counts
    it in the total ``memory_lost`` (stats, metrics) and removes its entry; a live
    process's entry and another host's (whose processes it cannot see) stay."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = memory.this_host()
    top = [memory.HeldSession("a", 5, 50, 990.0), memory.HeldSession("b", 2, 20, 995.0)]
    lost = memory.Held(dead.pid, host, None, 1_000.0, 2, 7, 70, 990.0, top)
    alive = memory.Held(os.getpid(), host, None, 1_000.0, 1, 3, 30, 990.0, [])
    elsewhere = memory.Held(dead.pid, "another-host", None, 1_000.0, 1, 4, 40, 990.0, [])
    for held in (lost, alive, elsewhere):
        spool.publish_memory(held.pid, held.host, held).result()
    publisher = MemoryPublisher(lambda: spool, lambda: [StoreTranscripts(store)])
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        assert publisher.take_lost() == [lost]
        # Taken once: another Spool on the file (a second gateway's) finds it gone.
        with walspool.Spool(spool.path) as beside:
            assert beside.take_lost_memory() == []
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(
        f"A gateway process on this host (pid {dead.pid}) ended without a clean stop while "
        "it held 7 transcript message(s) of 2 session(s) in memory (70 bytes, published "
    )
    assert line.endswith("they were lost. Largest: a (5), b (2)")
    assert sorted((e.held.host, e.held.messages) for e in spool.memory()) == [
        ("another-host", 4),
        (host, 3),
    ]
    assert main(["stats", str(spool.path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_lost_total"] == 7
    assert main(["metrics", str(spool.path)]) == 0
    assert f'walspool_memory_lost_messages_total{{spool="{spool.path}"}} 7' in (
        capsys.readouterr().out
    )


def test_a_process_given_the_pid_of_a_gone_one_is_not_taken_for_it(spool):
    """The pid is alive (this process) but started at another time: gone."""
    host = memory.this_host()
    started = memory.started(os.getpid())
    assert started is not None
    held = memory.Held(os.getpid(), host, started + 1, 1.0, 1, 1, 1, 1.0, [])
    spool.publish_memory(os.getpid(), host, held).result()
    (entry,) = spool.memory()
    assert entry.alive is False


def test_the_entries_are_spool_meta_rows_an_operator_can_read_and_delete(spool):
    host = memory.this_host()
    held = memory.Held(os.getpid(), host, None, 1.0, 1, 2, 3, 1.0, [])
    spool.publish_memory(os.getpid(), host, held).result()
    spool.close()
    conn = apsw.Connection(str(spool.path))
    ((name, value),) = conn.execute("SELECT name, value FROM spool_meta WHERE name LIKE 'memory:%'")
    assert name == f"memory:{os.getpid()}@{host}"
    assert json.loads(value)["messages"] == 2
    conn.execute("DELETE FROM spool_meta WHERE name LIKE 'memory:%'")
    conn.close()


class Commits:
    """A spool's ``publish_memory`` whose commits the test settles by hand."""

    def __init__(self) -> None:
        self.queued: list[tuple[memory.Held | None, concurrent.futures.Future[None]]] = []

    def publish_memory(self, pid, host, held):
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.queued.append((held, done))
        return done


def test_a_publication_whose_commit_failed_is_made_again(store):
    """The writer gave up on it (a lock held elsewhere past its bound): the next look
    publishes the same backlog again rather than taking it as published."""
    commits = Commits()
    publisher = MemoryPublisher(lambda: commits, lambda: [StoreTranscripts(store)])
    queue(store, "a", "one")
    publisher.publish()
    commits.queued[-1][1].set_exception(RuntimeError("database is locked"))
    publisher.publish()
    assert [held.messages for held, _ in commits.queued] == [1, 1]
    commits.queued[-1][1].set_result(None)
    assert publisher.publish() is None  # committed and unchanged: nothing to do
