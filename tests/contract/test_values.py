"""Any message is kept: a value a TEXT column cannot take as it is gets one verdict,
the same live as in a replay."""

from __future__ import annotations

import json
from pathlib import Path

import walspool
from walspool import QUARANTINED

from ._gateways import Gateway, configure, run_worker


def test_a_value_past_64_bits_lands_as_its_text_live_as_in_a_replay(
    gateway: Gateway, home: Path
) -> None:
    """A reply whose content is 2**70 (and one whose tool call holds it) on a healthy
    session: every row lands, in order, the integer as its decimal text, as a replay
    of the same row writes it (before: the 0.19.0 link quarantined it live, an
    OverflowError, while ``walspool replay`` landed it as text)."""
    configure(gateway, home, gateway.enable)
    result = run_worker(gateway, home, "values")
    assert [tuple(row) for row in result["landed"]] == [
        ("user", "how big?"),
        ("assistant", str(2**70)),
        ("assistant", "and a list"),
        ("user", "thanks"),
    ]


def test_a_message_no_serialiser_takes_is_set_aside_and_its_session_goes_on(
    gateway: Gateway, home: Path
) -> None:
    """A reply whose tool call is an SDK object (not JSON) on a healthy session, then the
    next turn: the next turn lands at once, and the reply is kept in the spool as a
    quarantined row an operator can read (one bad row never blocks its session)."""
    configure(gateway, home, gateway.enable)
    result = run_worker(gateway, home, "sdk-object")
    assert [tuple(row) for row in result["landed"]] == [
        ("user", "call a tool"),
        ("user", "next turn"),
    ]
    with walspool.Spool(home / "spool.db") as spool:
        (kept,) = list(spool.records(session_id="s1"))
    assert kept.status == QUARANTINED
    assert kept.message["content"] == "calling"
    assert "t1" in json.dumps(kept.message["tool_calls"])  # the object's fields, kept
