"""``walspool demo``: the gateway outage demo."""

from __future__ import annotations

import argparse
import sys


def run(args: argparse.Namespace) -> int:
    """Run the demo: a gateway outage with and without walspool.

    Spools messages during a simulated outage of a real hermes-agent 0.19.0 gateway
    and replays them into state.db, side by side with the released gateway.
    """
    from ..demo import run_demo

    return run_demo(sys.stdout)
