"""A full disk under the gateway's home: state.db and the spool both refuse to grow.

The released gateways keep at least the newest 200 messages of each session in memory
and write them once there is room (0.22 keeps whatever its spool refuses; 0.19.0 and
0.20 drop what is evicted at the cap). With the plugin, nothing is lost that the
released gateway would have kept, nothing lands twice, and order holds.
"""

from __future__ import annotations

from pathlib import Path

from ._gateways import Gateway, configure, run_worker

#: Messages sent to each of three sessions while the disk is full: past the 200 cap.
BURST = 260
#: The home's own disk: room for the gateway's files, then filled to the last byte.
DISK_MIB = 32


def test_a_full_disk_loses_nothing_the_released_gateway_would_keep(
    gateway: Gateway, home: Path
) -> None:
    configure(gateway, home, gateway.enable)
    result = run_worker(gateway, home, "full", str(BURST), disk_mib=DISK_MIB)

    for session, sent in result["sent"].items():
        landed = result["landed"][session]
        assert result["during"][session] < len(sent) - 1, "the disk was not full"
        sent = [tuple(m) for m in sent]
        landed = [tuple(m) for m in landed]
        # Each once, in order: what landed is the newest of what was sent...
        assert landed == sent[len(sent) - len(landed) :], session
        # ...and at least what the released gateway keeps: the newest 200, then the last.
        assert len(landed) >= 201, (session, len(landed))
    # What walspool says it dropped is at most what was evicted past the cap (what the
    # released gateways drop when their own spool fails), never what 0.22 keeps.
    dropped = [line for line in result["log"] if "dropped" in line and "WARNING" in line]
    assert len(dropped) <= len(result["sent"]) * (BURST - 200), dropped[:3]
    # A session that lost messages is told why, in the same words on every gateway, and
    # in a few lines (the first in full, then counts), not one per message.
    for session, sent in result["sent"].items():
        head = f"WARNING Session DB transcript pending queue full for {session} "
        said = [line for line in result["log"] if line.startswith(head) and "dropp" in line]
        if len(result["landed"][session]) < len(sent):
            assert any(
                "dropping oldest message to make room (on-disk spool unavailable: " in line
                and "no room to write" in line
                for line in said
            ), said
        assert len(said) <= 3, said
