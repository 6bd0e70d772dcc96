"""``walspool metrics``: OpenMetrics text as Prometheus' own parser reads it, from a file
(node_exporter's textfile collector) and served at /metrics."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import apsw
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

import walspool
from walspool.cli import main

MSG = {"role": "user", "content": "hello"}


@pytest.fixture
def spool(tmp_path: Path) -> Path:
    """4 rows in s1 (seq 1 failed and was tried twice, seq 2 quarantined, seq 3 in
    flight), 1 in s2 spooled at shutdown, 1 agent history by key."""
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as s:
        s.append_many([("s1", MSG)] * 4)
        s.append("s2", MSG, reason=walspool.SHUTDOWN)
        s.append(None, MSG, session_key="agent:main:k", reason=walspool.AGENT_HISTORY)
    conn = apsw.Connection(str(path))
    conn.execute(
        "UPDATE records SET attempts = 2, last_error = 'locked', last_attempt_at = "
        "unixepoch('now') - 30 WHERE session_id = 's1' AND seq = 1;"
        "UPDATE records SET status = 'quarantined', last_error = 'refused', attempts = 1, "
        "last_attempt_at = unixepoch('now') - 90 WHERE session_id = 's1' AND seq = 2;"
        "UPDATE records SET inflight = 7 WHERE session_id = 's1' AND seq = 3;"
        "UPDATE records SET created_at = created_at - 3600 WHERE id = 1"
    )
    conn.close()
    return path


#: The counters; every other family is a gauge.
COUNTERS = {"walspool_rows_drained", "walspool_rows_quarantined", "walspool_memory_lost_messages"}


def values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample as ``(name, labels but spool) -> value``, parsed by
    prometheus_client's OpenMetrics parser (which refuses text that is not OpenMetrics,
    a counter's sample not named ``_total`` included)."""
    out = {}
    for family in text_string_to_metric_families(text):
        assert family.type == ("counter" if family.name in COUNTERS else "gauge"), family.name
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "spool"))
            out[sample.name, labels] = sample.value
    return out


def test_the_metrics_say_what_stats_says_and_parse_as_openmetrics(spool, capsys):
    assert main(["metrics", str(spool)]) == 0
    text = capsys.readouterr().out
    got = values(text)
    assert got[("walspool_rows", (("reason", walspool.CAP_DROP),))] == 4
    assert got[("walspool_rows", (("reason", walspool.SHUTDOWN),))] == 1
    assert got[("walspool_rows", (("reason", walspool.AGENT_HISTORY),))] == 1
    assert got[("walspool_sessions", ())] == 3
    assert (got[("walspool_failing_rows", ())], got[("walspool_quarantined_rows", ())]) == (2, 1)
    # Bytes by reason add up to the payload bytes stats counts; by status, the set-aside
    # rows' own; failing sessions, the streams with a failing row.
    assert main(["stats", str(spool), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    by_reason = {
        labels[0][1]: v for (name, labels), v in got.items() if name == "walspool_payload_bytes"
    }
    assert by_reason == stats["bytes_by_reason"] and sum(by_reason.values()) == stats["bytes"]
    with walspool.Spool(spool) as s:
        (set_aside,) = s.query(
            "SELECT coalesce(sum(size), 0) FROM records WHERE status = 'quarantined'", ()
        )
        (failing,) = s.query(
            "SELECT count(DISTINCT coalesce(session_id, 'key:' || session_key)) FROM records "
            "WHERE last_error IS NOT NULL",
            (),
        )
    quarantined = (("status", "quarantined"),)
    assert got[("walspool_set_aside_payload_bytes", quarantined)] == set_aside[0] > 0
    assert got[("walspool_set_aside_payload_bytes", (("status", "superseded"),))] == 0
    assert got[("walspool_failing_sessions", ())] == failing[0] == stats["failing_sessions"]
    assert (got[("walspool_in_flight_rows", ())], got[("walspool_superseded_rows", ())]) == (1, 0)
    assert 3600 <= got[("walspool_oldest_row_age_seconds", ())] < 3600 + 600
    assert 30 <= got[("walspool_last_error_age_seconds", ())] < 90
    assert got[("walspool_open_processes", ())] == 0  # no gateway has it open
    assert got[("walspool_file_bytes", (("file", "db"),))] == spool.stat().st_size
    assert f'spool="{spool}"' in text and text.endswith("# EOF\n")
    # Units in names, as Prometheus names them; no counter without _total.
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("walspool_"), family.name
    assert "# UNIT walspool_oldest_row_age_seconds seconds" in text

    assert main(["metrics", str(spool), "--json"]) == 0
    as_json = json.loads(capsys.readouterr().out)
    by_name = {m["name"]: m["samples"] for m in as_json["metrics"]}
    assert by_name["walspool_quarantined_rows"] == [[{}, 1]]


def test_the_drained_and_quarantined_totals_count_what_replays_did_and_never_go_back(
    tmp_path, capsys
):
    """A replay moves two rows and quarantines one (its payload was edited into
    something that is not JSON); requeued and refused again, it counts again. The totals
    outlive the rows: the spool emptied by ``drop`` and vacuumed still says 2 drained and
    2 quarantined, while the gauges fall to 0. ``stats --json`` says the same."""
    hermes_state = pytest.importorskip("hermes_state")
    from _gateway import state_db

    path = tmp_path / "spool.db"
    with walspool.Spool(path) as s:
        s.append_many([("s1", MSG), ("s1", MSG)])
        bad = s.append("s1", MSG)
    with apsw.Connection(str(path)) as conn:
        conn.execute("UPDATE records SET payload = '{not json' WHERE id = ?", (bad.id,))
    state = state_db(tmp_path / "state.db", "s1")

    def totals() -> tuple[float, float, float]:
        capsys.readouterr()
        assert main(["metrics", str(path)]) == 0
        got = values(capsys.readouterr().out)
        return (
            got[("walspool_rows_drained_total", ())],
            got[("walspool_rows_quarantined_total", ())],
            got[("walspool_quarantined_rows", ())],
        )

    assert totals() == (0, 0, 0)
    assert main(["replay", str(path), "--into", str(state)]) == 5
    assert totals() == (2, 1, 1)
    assert main(["requeue", str(path), "--id", str(bad.id)]) == 0
    assert main(["replay", str(path), "--into", str(state)]) == 5
    assert totals() == (2, 2, 1)
    assert main(["drop", str(path), "--quarantined", "--yes"]) == 0
    assert main(["vacuum", str(path)]) == 0
    assert totals() == (2, 2, 0)
    assert main(["stats", str(path), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats["drained_total"], stats["quarantined_total"], stats["rows"]) == (2, 2, 0)
    db = hermes_state.SessionDB(db_path=state)
    try:
        assert len(db.get_messages("s1")) == 2
    finally:
        db.close()


def test_an_empty_spool_and_odd_reasons_still_parse(tmp_path, capsys):
    """No rows: ages 0, no error age; a reason with quotes, a backslash and a newline
    is escaped so that the text still parses, and reads back as written."""
    path = tmp_path / "spool.db"
    walspool.Spool(path).close()
    assert main(["metrics", str(path)]) == 0
    got = values(capsys.readouterr().out)
    assert got[("walspool_oldest_row_age_seconds", ())] == 0
    assert not any(name == "walspool_last_error_age_seconds" for name, _ in got)
    odd = 'say "hi"\\\nnext'
    with walspool.Spool(path) as s:
        s.append("s", MSG, reason=odd)
    assert main(["metrics", str(path)]) == 0
    assert values(capsys.readouterr().out)[("walspool_rows", (("reason", odd),))] == 1


def test_listen_serves_them_at_metrics_until_stopped(spool):
    proc = subprocess.Popen(
        [sys.executable, "-m", "walspool", "metrics", str(spool), "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("serving http://127.0.0.1:") and first.endswith("/metrics\n")
        url = first.split()[1]
        with urllib.request.urlopen(url, timeout=30) as response:
            assert response.headers["Content-Type"].startswith("application/openmetrics-text")
            text = response.read().decode()
        assert values(text)[("walspool_quarantined_rows", ())] == 1
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(url.replace("/metrics", "/other"), timeout=30)
        assert missing.value.code == 404
        spool.rename(spool.with_name("moved.db"))  # unreadable now: the scrape says why
        with pytest.raises(urllib.error.HTTPError) as gone:
            urllib.request.urlopen(url, timeout=30)
        assert gone.value.code == 503
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err


def test_listen_refuses_what_is_not_host_and_port(spool, capsys):
    for bad in ("9464", "host:port", "127.0.0.1:70000"):
        with pytest.raises(SystemExit) as usage:
            main(["metrics", str(spool), "--listen", bad])
        assert usage.value.code == 2
    capsys.readouterr()
    # An address this host does not have: one line saying so, exit 1.
    assert main(["metrics", str(spool), "--listen", "192.0.2.1:0"]) == 1
    assert capsys.readouterr().err.startswith("walspool metrics: cannot listen on 192.0.2.1:0: ")


def test_what_gateway_processes_hold_in_memory_parses_per_process(tmp_path, capsys):
    """One live process (this one) and one gone publish their in-memory backlog: a
    sample of each family per process, labelled with its pid and whether it is alive,
    in text Prometheus' own parser takes."""
    import os
    import subprocess
    import sys

    from walspool.store import memory

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = memory.this_host()
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as s:
        for pid, messages in ((os.getpid(), 7), (gone.pid, 3)):
            held = memory.Held(pid, host, None, 1.0, 1, messages, 10 * messages, 1.0, [])
            s.publish_memory(pid, host, held).result()
    assert main(["metrics", str(path)]) == 0
    got = values(capsys.readouterr().out)
    alive = (("alive", "true"), ("pid", str(os.getpid())))
    lost = (("alive", "false"), ("pid", str(gone.pid)))
    assert (got[("walspool_memory_messages", alive)], got[("walspool_memory_messages", lost)]) == (
        7,
        3,
    )
    assert got[("walspool_memory_bytes", lost)] == 30
    assert got[("walspool_memory_oldest_age_seconds", alive)] > 0
