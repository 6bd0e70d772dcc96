"""Rates and ratios of the benchmarks, from a run or from its JSON file.

    python benchmarks/report.py /tmp/bench.json

prints, for each benchmark, messages per second (messages per round over the median
round time), then each walspool/baseline ratio against its target (DESIGN.md section 6),
with its spread round by round where the two designs ran interleaved, then each peer
library's rate against walspool's (``bench_peers.py``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

#: name -> {"group", "msgs_per_round", "median_s", "msgs_per_s", extra...}; filled
#: by the benchmarks as they run, printed by conftest at the end of the session.
RESULTS: dict[str, dict[str, Any]] = {}

#: (what, walspool benchmark, baseline benchmark, target ratio; None: a floor, shown only)
RATIOS = [
    ("1 producer: walspool / write+fsync", "test_walspool_1_producer", "test_write_fsync", 0.9),
    (
        "64 threads: walspool / jsonfile",
        "test_walspool_64_threads",
        "test_jsonfile_64_threads",
        10.0,
    ),
    (
        # The other bound for this case: within 1.5x of CPython's hand-off.
        "64 threads: walspool / hand-off floor (no I/O)",
        "test_walspool_64_threads",
        "test_handoff_floor_64_threads",
        1 / 1.5,
    ),
    (
        "64 threads: walspool / hand-off + bare SQL floor",
        "test_walspool_64_threads",
        "test_handoff_sql_floor_64_threads",
        None,
    ),
    (
        "64 asyncio tasks: walspool / jsonfile",
        "test_walspool_64_async",
        "test_jsonfile_64_async",
        25.0,
    ),
    (
        "batches of 1,000: walspool append_many / jsonfile",
        "test_walspool_append_many",
        "test_jsonfile_append_many",
        50.0,
    ),
    (
        "batches of 1,000: walspool append_many / bare SQL floor",
        "test_walspool_append_many",
        "test_sql_floor_append_many",
        None,
    ),
    (
        "64 asyncio tasks: walspool / hand-off + bare SQL floor",
        "test_walspool_64_async",
        "test_handoff_sql_floor_64_async",
        None,
    ),
    (
        "gateway outage: linked / released (drops)",
        "test_gateway_walspool",
        "test_gateway_released",
        0.5,
    ),
    (
        "gateway outage: linked / JSON-file spool",
        "test_gateway_walspool",
        "test_gateway_jsonfile",
        5.0,
    ),
    (
        "replay: walspool / append_message direct",
        "test_replay_into_sessiondb",
        "test_append_message_direct",
        0.8,
    ),
    (
        # The floor on a gateway without a batch write: append_message + landing ticket.
        "replay: walspool / sink write direct (with tickets)",
        "test_replay_into_sessiondb",
        "test_sink_write_direct",
        None,
    ),
    (
        "replay: sink write direct / append_message direct",
        "test_sink_write_direct",
        "test_append_message_direct",
        None,
    ),
    (
        # The floor where the gateway has a batch write (0.22): its own batch.
        "replay: walspool / the gateway's append_messages_batch",
        "test_replay_into_sessiondb",
        "test_append_messages_batch_direct",
        None,
    ),
]


def record(name: str, group: str, msgs_per_round: int, median_s: float, **extra: Any) -> float:
    """Keep one benchmark's result for the end-of-run summary; return its rate."""
    rate = msgs_per_round / median_s
    RESULTS[name] = {
        "group": group,
        "msgs_per_round": msgs_per_round,
        "median_s": median_s,
        "msgs_per_s": rate,
        **extra,
    }
    return rate


def from_json(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Results from a ``--benchmark-json`` file."""
    results = {}
    for bench in data["benchmarks"]:
        extra = bench.get("extra_info", {})
        # An interleaved benchmark times several designs per round: one result each.
        for name, design in extra.get("designs", {}).items():
            results[name] = {"group": bench["group"], **design}
        msgs = extra.get("msgs_per_round")
        if not msgs:
            continue
        median = bench["stats"]["median"]
        results[extra.get("result_name", bench["name"])] = {
            **extra,
            "group": bench["group"] or extra.get("group", ""),
            "msgs_per_round": msgs,
            "median_s": median,
            "msgs_per_s": msgs / median,
        }
    return results


def format_report(results: dict[str, dict[str, Any]]) -> str:
    """A table of rates by group, then the ratios and whether each meets its target."""
    lines = [
        f"{'group':<18} {'benchmark':<40} {'msgs/round':>10} {'median s':>9} "
        f"{'msgs/s':>9} {'msgs/commit':>11}"
    ]
    for name, r in sorted(results.items(), key=lambda kv: (kv[1]["group"], kv[0])):
        per_commit = r.get("msgs_per_commit")
        lines.append(
            f"{r['group']:<18} {name.removeprefix('test_'):<40} {r['msgs_per_round']:>10} "
            f"{r['median_s']:>9.3f} {r['msgs_per_s']:>9.0f} "
            f"{'' if per_commit is None else f'{per_commit:.1f}':>11}"
        )
    lines.append("")
    for what, ours, base, target in RATIOS:
        if ours in results and base in results:
            ratio = results[ours]["msgs_per_s"] / results[base]["msgs_per_s"]
            if target is None:  # a floor: how far from it, not a target
                lines.append(f"{what:<52} {ratio:7.2f}x  (a floor, no target)")
                continue
            verdict = "met" if ratio >= target else f"MISSED ({ratio / target:.0%} of target)"
            lines.append(f"{what:<52} {ratio:7.2f}x  target >= {target:.3g}x  {verdict}")
            if "round_ratio_min" in results[ours]:
                lines.append(spread_line(results[ours], target))
    lines.extend(peer_lines(results))
    return "\n".join(lines)


def spread_line(result: dict[str, Any], target: float) -> str:
    """The ratio round by round of an interleaved benchmark: lowest, median, highest."""
    low, mid, high = (result[f"round_ratio_{k}"] for k in ("min", "median", "max"))
    below = sum(r < target for r in result["round_ratios"])
    return (
        f"{'':<4}over {result['rounds']} interleaved rounds: min {low:.2f}x, "
        f"median {mid:.2f}x, max {high:.2f}x; {below} round(s) below {target:g}x"
    )


#: Groups of bench_peers.py: each peer's result has ``ratio_to``, walspool's result in
#: the same case (the two interleaved in the same rounds).
PEER_GROUP_PREFIX = "peers: "


def peer_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """Each peer library's rate against walspool's in the same case and rounds."""
    lines: list[str] = []
    for name, r in sorted(results.items(), key=lambda kv: (kv[1]["group"], kv[0])):
        ours = results.get(r.get("ratio_to", ""))
        if not r["group"].startswith(PEER_GROUP_PREFIX) or ours is None:
            continue
        if not lines:
            lines += [
                "",
                "peers beside walspool (same case, interleaved rounds; walspool leads below 1x):",
                f"{'case':<12} {'peer':<14} {'peer/s':>7} {'walspool/s':>10} {'peer/ws':>8} "
                f"{'rounds min-max':>15}  {'WAL pages/append':>16}",
            ]
        ratio = r["msgs_per_s"] / ours["msgs_per_s"]
        spread = f"{r['round_ratio_min']:.2f}-{r['round_ratio_max']:.2f}x"
        frames = [x.get("wal_frames_per_append") for x in (r, ours)]
        pages = "" if None in frames else f"{frames[0]:.2f} vs {frames[1]:.2f}"
        peer = name.removesuffix("]").rsplit("[", 1)[-1]
        lines.append(
            f"{r['group'].removeprefix(PEER_GROUP_PREFIX):<12} {peer:<14} "
            f"{r['msgs_per_s']:>7.0f} {ours['msgs_per_s']:>10.0f} {ratio:>7.2f}x "
            f"{spread:>15}  {pages:>16}  {'walspool leads' if ratio < 1 else 'PEER LEADS'}"
        )
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python benchmarks/report.py BENCH_JSON", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        print(format_report(from_json(json.load(f))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
