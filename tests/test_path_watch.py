"""The spool's path check (``walspool.store.path_watch``): whether the path still names
the file a Spool opened, asked with a ``poll`` while nothing could have changed it and a
``stat`` otherwise. Each way the path can come to name another file is made here for
real, through the watch and through a Spool's appends racing it."""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import walspool
from walspool.store.path_watch import PathWatch, file_identity, resolution

MSG = {"role": "user", "content": "x" * 100}

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="inotify is Linux's")


class Mounts:
    """Whether this mount namespace's mount table changed since it was made: another
    test's mount (the disk-full tests make one) ends every watch, so a test that checks
    a watch went on checks it only while no mount came."""

    def __init__(self) -> None:
        self._file = open("/proc/self/mounts", "rb")  # noqa: SIM115 - closed by close
        self._poll = select.poll()
        self._poll.register(self._file.fileno(), select.POLLPRI)
        self._poll.poll(0)
        self._changed = False

    def changed(self) -> bool:
        self._changed = self._changed or bool(self._poll.poll(0))
        return self._changed

    def close(self) -> None:
        self._file.close()


@pytest.fixture
def mounts() -> Iterator[Mounts]:
    table = Mounts()
    yield table
    table.close()


def watched(path: Path) -> PathWatch:
    watch = PathWatch(str(path), file_identity(path))
    assert watch.watching, "inotify should be available on the test machine"
    return watch


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A symlinked home: ``tmp/link`` leads to ``tmp/data/real``, where the file is."""
    real = tmp_path / "data" / "real"
    real.mkdir(parents=True)
    (real / "spool.db").write_bytes(b"a")
    (tmp_path / "link").symlink_to(real)
    return tmp_path


def test_resolution_walks_a_symlinked_home_as_the_kernel_does(home: Path) -> None:
    lookups = resolution(str(home / "link" / "spool.db"))
    assert lookups is not None
    assert lookups[str(home)] == {b"link", b"data"}  # the link, then its target's first name
    assert lookups[str(home / "data")] == {b"real"}
    assert lookups[str(home / "data" / "real")] == {b"spool.db"}
    assert all(not os.path.islink(directory) for directory in lookups)
    (home / "relative").symlink_to(Path("data") / ".." / "data" / "real")
    relative = resolution(str(home / "relative" / "spool.db"))
    assert relative is not None and relative[str(home / "data" / "real")] == {b"spool.db"}


def test_a_relative_path_or_a_loop_of_links_is_not_watched(home: Path, monkeypatch) -> None:
    monkeypatch.chdir(home / "data")
    assert resolution("real/spool.db") is None
    watch = PathWatch("real/spool.db", file_identity("real/spool.db"))
    assert not watch.watching and watch.names_it()  # a stat each time
    (home / "loop").symlink_to(home / "loop")
    assert resolution(str(home / "loop" / "spool.db")) is None


def _rename_file(home: Path) -> None:
    os.rename(home / "data" / "real" / "spool.db", home / "data" / "real" / "moved.db")


def _delete_file(home: Path) -> None:
    os.unlink(home / "data" / "real" / "spool.db")


def _rename_over(home: Path) -> None:
    other = home / "data" / "real" / "other.db"
    other.write_bytes(b"b")
    os.rename(other, home / "data" / "real" / "spool.db")


def _rename_parent(home: Path) -> None:
    os.rename(home / "data" / "real", home / "data" / "old")
    (home / "data" / "real").mkdir()
    (home / "data" / "real" / "spool.db").write_bytes(b"c")


def _rename_grandparent(home: Path) -> None:
    os.rename(home / "data", home / "data.old")


def _swap_the_link(home: Path) -> None:
    elsewhere = home / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "spool.db").write_bytes(b"d")
    (home / "new-link").symlink_to(elsewhere)
    os.rename(home / "new-link", home / "link")


CHANGES = [
    _rename_file,
    _delete_file,
    _rename_over,
    _rename_parent,
    _rename_grandparent,
    _swap_the_link,
]


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.strip("_"))
def test_every_way_the_path_comes_to_name_another_file_is_seen(
    home: Path, change, mounts: Mounts
) -> None:
    path = home / "link" / "spool.db"
    watch = watched(path)
    assert watch.names_it()
    assert watch.watching or mounts.changed()
    change(home)
    assert not watch.names_it()
    assert not watch.watching  # an event about its names ends the watch: a stat from now on
    assert not watch.names_it()
    watch.close()


def test_moved_away_and_back_the_answer_is_the_stat(home: Path) -> None:
    path = home / "data" / "real" / "spool.db"
    watch = watched(path)
    os.rename(path, path.with_name("away.db"))
    os.rename(path.with_name("away.db"), path)
    assert watch.names_it()  # the same file again
    assert not watch.watching
    watch.close()


def test_other_files_coming_and_going_beside_it_keep_the_watch(home: Path, mounts: Mounts) -> None:
    """A gateway's home sees state.db's journal and WAL come and go all the time: the
    watch reads those events and goes on answering with no stat."""
    path = home / "data" / "real" / "spool.db"
    watch = watched(path)
    for n in range(200):
        journal = path.with_name(f"state.db-journal{n % 3}")
        journal.write_bytes(b"j")
        os.rename(journal, path.with_name("state.db-wal"))
        (home / "data" / f"x{n}").mkdir()
        assert watch.names_it()
    assert watch.watching or mounts.changed()
    watch.close()


def test_events_lost_to_an_overflowing_queue_end_the_watch(home: Path) -> None:
    path = home / "data" / "real" / "spool.db"
    watch = watched(path)
    limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    for n in range(limit // 2 + 10):  # two events each: more than the queue holds
        other = path.with_name(f"o{n}")
        other.write_bytes(b"")
        other.unlink()
    assert watch.names_it()  # the stat's answer: still the same file
    assert not watch.watching
    _rename_file(home)
    assert not watch.names_it()
    watch.close()


@contextlib.contextmanager
def tmpfs_over(directory: Path, watch: PathWatch) -> Iterator[None]:
    """A tmpfs mounted over ``directory`` for the block (root only: the test skips, the
    watch closed, where mounting is refused)."""
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "tmpfs", str(directory)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        watch.close()
        pytest.skip(f"cannot mount here: {mounted.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def test_a_file_system_mounted_over_its_directory_is_seen(home: Path) -> None:
    path = home / "data" / "real" / "spool.db"
    watch = watched(path)
    with tmpfs_over(home / "data" / "real", watch):
        assert not watch.names_it()
        assert not watch.watching  # a mount ends the watch: every later check is a stat
        assert not watch.names_it()  # asked again (another thread's check came first)
    assert watch.names_it()  # the file is there again once the mount is gone
    watch.close()


def test_a_mount_elsewhere_ends_the_watch_and_the_answers_stay_right(home: Path) -> None:
    path = home / "data" / "real" / "spool.db"
    watch = watched(path)
    elsewhere = home / "elsewhere"
    elsewhere.mkdir()
    with tmpfs_over(elsewhere, watch):
        assert watch.names_it()
        assert not watch.watching
    _rename_file(home)
    assert not watch.names_it()
    watch.close()


def test_a_permission_change_on_the_path_ends_the_watch(home: Path) -> None:
    """``chmod`` of a directory on the path (or of the file) is an event about one of its
    names: the watch ends, and the stat answers from then on."""
    path = home / "data" / "real" / "spool.db"
    watch = watched(path)
    os.chmod(home / "data" / "real", 0o700)
    assert watch.names_it()
    assert not watch.watching
    watch.close()


def test_a_closed_watch_answers_with_a_stat(home: Path) -> None:
    path = home / "data" / "real" / "spool.db"
    watch = watched(path)
    watch.close()
    watch.close()
    assert not watch.watching and watch.names_it()
    _delete_file(home)
    assert not watch.names_it()


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.strip("_"))
def test_no_append_begun_after_the_path_changed_is_acknowledged(home: Path, change) -> None:
    """Appending threads race a change of what the path names: an append that began
    after the change returned is refused (``SpoolReplaced``), never acknowledged into a
    file the next start would not open; every acknowledged row is in the file."""
    real = home / "data" / "real"
    (real / "spool.db").unlink()
    path = home / "link" / "spool.db"
    spool = walspool.Spool(path)
    changed = threading.Event()
    acknowledged: list[walspool.Receipt] = []
    late: list[walspool.Receipt] = []
    refused = threading.Event()
    started = threading.Barrier(5)
    with spool:
        held = spool.stats()  # its reader holds the opened file for the count below

        def append(name: str) -> None:
            started.wait()
            tries_after = 0
            while not refused.is_set() and tries_after < 50:
                after = changed.is_set()
                tries_after += after
                try:
                    receipt = spool.append(name, MSG)
                except walspool.SpoolReplaced:
                    refused.set()
                    return
                (late if after else acknowledged).append(receipt)

        threads = [threading.Thread(target=append, args=(f"s{n}",)) for n in range(4)]
        for thread in threads:
            thread.start()
        started.wait()
        while len(acknowledged) < 20 and all(t.is_alive() for t in threads):
            os.sched_yield()
        change(home)
        changed.set()
        for thread in threads:
            thread.join(30)
        assert refused.is_set()
        assert late == []
        assert held.rows == 0
        assert spool.stats().rows == len(acknowledged)  # the opened file's own rows
