"""Any message is kept: a value a TEXT column cannot take as it is gets one verdict,
the same live as in a replay."""

from __future__ import annotations

from pathlib import Path

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
