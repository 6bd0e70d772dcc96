"""Sessions whose drain walspool skipped are tried again with no new message
(``walspool.link.deferred``): a round gives every deferred key to the retry once the
spool would let a drain run, first deferred first, and nothing before that."""

from __future__ import annotations

import threading

import pytest

from walspool.link.deferred import Deferred


class Recorder:
    """A retry that records its keys; raises for those in ``failing``."""

    def __init__(self, failing: frozenset[str] = frozenset()) -> None:
        self.keys: list[str] = []
        self.failing = failing

    def __call__(self, key: str) -> None:
        self.keys.append(key)
        if key in self.failing:
            raise RuntimeError(f"cannot retry {key}")


def deferred(retry: Recorder, ready: bool = True) -> Deferred[str]:
    """A ``Deferred`` whose thread never runs a round by itself within a test (the
    tests run rounds themselves)."""
    return Deferred(retry, lambda: ready, interval=3600.0)


@pytest.mark.parametrize(
    ("ready", "deferred_keys", "retried", "left"),
    [
        (True, ["s1", "s2", "s1", "s3"], ["s1", "s2", "s3"], []),  # once each, first first
        (False, ["s1", "s2"], [], ["s1", "s2"]),  # nothing while the spool would refuse
        (True, [], [], []),
    ],
)
def test_a_round_retries_each_deferred_session_once_when_the_spool_is_ready(
    ready: bool, deferred_keys: list[str], retried: list[str], left: list[str]
) -> None:
    retry = Recorder()
    retries = deferred(retry, ready)
    try:
        for key in deferred_keys:
            retries.defer(key)
        assert retries.retry_round() == len(retried)
        assert retry.keys == retried
        assert retries.waiting() == left
    finally:
        retries.close()


def test_a_session_whose_retry_fails_does_not_stop_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    retry = Recorder(failing=frozenset({"s1"}))
    retries = deferred(retry)
    try:
        retries.defer("s1")
        retries.defer("s2")
        assert retries.retry_round() == 2
        assert retry.keys == ["s1", "s2"]
        assert "could not try s1 again" in caplog.text
    finally:
        retries.close()


def test_a_retry_skipped_again_is_deferred_for_the_next_round() -> None:
    retries: Deferred[str]

    def skipped_again(key: str) -> None:
        retries.defer(key)  # as a drain that meets the reason again does

    retries = Deferred(skipped_again, lambda: True, interval=3600.0)
    try:
        retries.defer("s1")
        assert retries.retry_round() == 1
        assert retries.waiting() == ["s1"]
    finally:
        retries.close()


def test_the_thread_retries_a_deferred_session_after_the_interval_and_close_forgets() -> None:
    tried = threading.Event()
    retries = Deferred(lambda key: tried.set(), lambda: True, interval=0.0)
    retries.defer("s1")
    assert tried.wait(10.0)  # the thread's round, with no other call
    retries.close()
    assert retries.thread is not None and not retries.thread.is_alive()
    retries.defer("s2")
    assert retries.waiting() == []
    assert retries.retry_round() == 0


def test_no_thread_runs_until_a_session_is_deferred() -> None:
    retries = Deferred(Recorder(), lambda: True)
    assert retries.thread is None
    retries.close()
