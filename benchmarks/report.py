"""Rates and ratios of the benchmarks, from a run or from its JSON files.

    python benchmarks/report.py BENCH_JSON [BENCH_JSON ...]
    python benchmarks/report.py --markdown BENCH_JSON [BENCH_JSON ...]

The first prints, for each benchmark, messages per second (messages per round over the
median round time), then each case's ratio to its floor or baseline against its target
(``CASES``), with its spread round by round where the two designs ran interleaved, then
each peer library's rate against walspool's (``bench_peers.py``). The same text ends a
``pytest benchmarks`` run.

``--markdown`` prints benchmarks/README.md's table: a line with the run's date, commits
and machine, then each case beside its floor (or the baseline its target is set
against), the ratio and the target. Give it the JSON files of one run; a replay file
that has the gateway's own batch write (``.venv-upstream``, 0.22) fills the 0.22 rows.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from datetime import datetime
from typing import Any

#: name -> {"group", "msgs_per_round", "median_s", "msgs_per_s", extra...}; filled
#: by the benchmarks as they run, printed by conftest at the end of the session.
RESULTS: dict[str, dict[str, Any]] = {}

#: Prefix of the replay results of a gateway with a batch write (0.22): bench_replay.py
#: names its results alike in both environments.
BATCHED = "batched:"
BATCH_DIRECT = "test_append_messages_batch_direct"


@dataclass(frozen=True)
class Case:
    """walspool's rate in one case over its floor's (or its baseline's)."""

    what: str
    ours: str
    base: str
    #: At least this ratio; None: no target of its own (``note`` says what the row is).
    target: float | None
    note: str = ""


CONTEXT = "context"
#: The append cases and their targets. Floors are measured in the same run: a bare
#: write+fsync per message; the same hand-off to one thread that commits with a bare apsw
#: ``executemany`` at ``synchronous=FULL``; bare ``executemany`` for batches. The peer
#: libraries' cases (``peer_cases``) follow them in the table.
APPEND_CASES = [
    Case("1 producer: `append` / write+fsync", "test_walspool_1_producer", "test_write_fsync", 1.0),
    Case(
        "64 threads / hand-off + bare SQL",
        "test_walspool_64_threads",
        "test_handoff_sql_floor_64_threads",
        0.9,
    ),
    Case(
        "64 asyncio tasks / hand-off + bare SQL",
        "test_walspool_64_async",
        "test_handoff_sql_floor_64_async",
        0.9,
    ),
    Case(
        "`append_many` 1,000 / bare SQL",
        "test_walspool_append_many",
        "test_sql_floor_append_many",
        0.9,
    ),
    Case(
        "1 producer / JSON files",
        "test_walspool_1_producer",
        "test_jsonfile_1_producer",
        None,
        CONTEXT,
    ),
    Case(
        "64 threads / JSON files",
        "test_walspool_64_threads",
        "test_jsonfile_64_threads",
        None,
        CONTEXT,
    ),
    Case(
        "64 asyncio tasks / JSON files",
        "test_walspool_64_async",
        "test_jsonfile_64_async",
        None,
        CONTEXT,
    ),
    Case(
        "`append_many` 1,000 / JSON files",
        "test_walspool_append_many",
        "test_jsonfile_append_many",
        None,
        CONTEXT,
    ),
]
#: The gateway link's and the replay's cases.
OTHER_CASES = [
    Case(
        "gateway outage: linked / released store (drops)",
        "test_gateway_walspool",
        "test_gateway_released",
        0.5,
    ),
    Case(
        "gateway outage: linked / JSON-file spool",
        "test_gateway_walspool",
        "test_gateway_jsonfile",
        5.0,
    ),
    Case(
        "replay row by row (0.19.0) / `append_message`",
        "test_replay_into_sessiondb",
        "test_append_message_direct",
        0.8,
    ),
    Case(
        "replay row by row (0.19.0) / the sink's write alone",
        "test_replay_into_sessiondb",
        "test_sink_write_direct",
        None,
        "its floor: `append_message` + ticket",
    ),
    Case(
        "replay in batches (0.22) / `append_message`",
        BATCHED + "test_replay_into_sessiondb",
        BATCHED + "test_append_message_direct",
        0.8,
    ),
    Case(
        "replay in batches (0.22) / `append_messages_batch`",
        BATCHED + "test_replay_into_sessiondb",
        BATCHED + BATCH_DIRECT,
        None,
        "its floor: the gateway's batch write",
    ),
]
CASES = APPEND_CASES + OTHER_CASES


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
    named = by_gateway(results)
    for case in CASES:
        if case.ours in named and case.base in named:
            ours = named[case.ours]
            ratio = ours["msgs_per_s"] / named[case.base]["msgs_per_s"]
            what = case.what.replace("`", "")
            if case.target is None:
                note = case.note.replace("`", "")
                lines.append(f"{what:<52} {ratio:7.2f}x  ({note}; no target)")
                continue
            verdict = (
                "met" if ratio >= case.target else f"MISSED ({ratio / case.target:.0%} of target)"
            )
            lines.append(f"{what:<52} {ratio:7.2f}x  target >= {case.target:.3g}x  {verdict}")
    for case in CASES:
        ours = named.get(case.ours, {})
        if "round_ratio_min" in ours and ours["ratio_to"] == case.base:
            lines.append(f"{case.what.replace('`', '')}:")
            lines.append(spread_line(ours))
    lines.extend(peer_lines(results))
    costs = cost_table(results)
    if costs:
        lines += ["", "what each guarantee costs (bench_costs.py), us a message:", *costs]
    return "\n".join(lines)


#: bench_costs.py's designs, in its table's order: the guarantees, then the machinery.
COSTS = ["path check", "data_version", "checks and encoding", "statistics index", "all off"]


def cost_table(results: dict[str, dict[str, Any]]) -> list[str]:
    """bench_costs.py's figures as a markdown table: per case, the whole path's time a
    message, each guarantee's cost (the whole path less that guarantee switched off, round
    by round), and all of them off less the floor (walspool's own machinery)."""
    by_group: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results.values():
        if "costs_of" in r:
            by_group.setdefault(r["group"], {})[r["costs_of"]] = r
    if not by_group:
        return []
    lines = [
        "| case | whole path | " + " | ".join(COSTS[:-1]) + " | machinery (all off - floor) |",
        "|---|" + "---:|" * (len(COSTS) + 1),
    ]
    for group, designs in by_group.items():
        whole = 1e6 / designs["whole"]["msgs_per_s"]
        floor = 1e6 / designs["floor"]["msgs_per_s"]
        cells = [f"{designs[name]['us_per_msg_over']:.2f}" for name in COSTS if name in designs]
        lines.append(
            f"| {group.removeprefix('costs: ')} | {whole:.1f} (floor {floor:.1f}) | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def spread_line(result: dict[str, Any]) -> str:
    """The ratio round by round of an interleaved benchmark: lowest, median, highest."""
    low, mid, high = (result[f"round_ratio_{k}"] for k in ("min", "median", "max"))
    return (
        f"{'':<4}over {result['rounds']} interleaved rounds: min {low:.2f}x, "
        f"median {mid:.2f}x, max {high:.2f}x"
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
        lines.append(
            f"{r['group'].removeprefix(PEER_GROUP_PREFIX):<12} {peer_name(name):<14} "
            f"{r['msgs_per_s']:>7.0f} {ours['msgs_per_s']:>10.0f} {ratio:>7.2f}x "
            f"{spread:>15}  {pages:>16}  {'walspool leads' if ratio < 1 else 'PEER LEADS'}"
        )
    return lines


def peer_name(name: str) -> str:
    """The peer library of a ``bench_peers.py`` result: ``test_peer_1_producer[litequeue]``."""
    return name.removesuffix("]").rsplit("[", 1)[-1]


def peer_cases(results: dict[str, dict[str, Any]]) -> list[Case]:
    """walspool over each peer library in the same case and rounds: walspool leads."""
    return [
        Case(
            f"{r['group'].removeprefix(PEER_GROUP_PREFIX)} / {peer_name(name)}",
            r["ratio_to"],
            name,
            1.0,
        )
        for name, r in sorted(results.items(), key=lambda kv: (kv[1]["group"], kv[0]))
        if r["group"].startswith(PEER_GROUP_PREFIX) and r.get("ratio_to") in results
    ]


def by_gateway(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``results``, its replay results renamed with ``BATCHED`` where they come from a
    gateway with a batch write (the run has ``test_append_messages_batch_direct``)."""
    if BATCH_DIRECT not in results:
        return results
    return {BATCHED + name if r["group"] == "replay" else name: r for name, r in results.items()}


def load(paths: list[str]) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """The results of several ``--benchmark-json`` files of one run, and the files."""
    results: dict[str, dict[str, Any]] = {}
    runs = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        runs.append(data)
        results.update(by_gateway(from_json(data)))
    return results, runs


#: The scale figures (``bench_scale.py``): what, benchmark, its figure from the JSON
#: entry, the unit, the bound the benchmark asserts.
SCALE = [
    (
        "peak RSS growth over 1,000,000 appends",
        "test_peak_rss_over_a_million_appends",
        lambda b: b["extra_info"]["peak_rss_growth_mib"],
        "MiB",
        32,
    ),
    (
        "opening a 1,000,000-row spool",
        "test_open_a_million_row_spool",
        lambda b: b["stats"]["median"],
        "s",
        0.2,
    ),
    (
        "`stats()` on 1,000,000 rows",
        "test_stats_on_a_million_rows",
        lambda b: b["stats"]["median"],
        "s",
        1.0,
    ),
    (
        "largest `-wal` while a reader pages, 200,000 appends",
        "test_wal_bounded_while_a_reader_pages",
        lambda b: b["extra_info"]["largest_wal_mib"],
        "MiB",
        96,
    ),
]


def _quantity(value: float, unit: str) -> str:
    if unit == "s" and value < 0.1:
        return f"{value * 1000:.3g} ms"
    return f"{value:.3g} {unit}" if value < 100 else f"{value:,.0f} {unit}"


def run_line(runs: list[dict[str, Any]]) -> str:
    """When (UTC), at which commits and on what machine the files' runs were made."""
    times = sorted(datetime.fromisoformat(run["datetime"]) for run in runs)
    first, last = times[0], times[-1]
    when = first.strftime("%Y-%m-%d %H:%M")
    if last.date() != first.date():
        when += last.strftime(" - %Y-%m-%d %H:%M")
    elif last != first:
        when += last.strftime("-%H:%M")
    commits = []
    machines = []
    for run in runs:
        commit = run.get("commit_info", {})
        cid = str(commit.get("id") or "unknown")
        name = (cid[:7] if len(cid) == 40 else cid) + ("+dirty" if commit.get("dirty") else "")
        if name not in commits:
            commits.append(name)
        info = run.get("machine_info", {})
        cpu = info.get("cpu", {})
        brand = f" ({cpu['brand_raw']})" if cpu.get("brand_raw") else ""
        machine = (
            f"{info.get('system', '?')} {info.get('machine', '?')}, "
            f"{cpu.get('count', '?')} CPUs{brand}, Python {info.get('python_version', '?')}"
        )
        if machine not in machines:
            machines.append(machine)
    return f"Run of {when} UTC at {', '.join(commits)}, on {'; '.join(machines)}."


def markdown_table(results: dict[str, dict[str, Any]], runs: list[dict[str, Any]]) -> str:
    """benchmarks/README.md's table: each case beside its floor, the ratio, the target."""
    lines = [
        run_line(runs),
        "",
        "| case | walspool | its floor | ratio | target |",
        "|---|---:|---:|---:|---|",
    ]
    cases = APPEND_CASES + peer_cases(results) + OTHER_CASES
    for case in cases:
        if case.ours not in results or case.base not in results:
            continue
        ours, base = results[case.ours]["msgs_per_s"], results[case.base]["msgs_per_s"]
        ratio = ours / base
        if case.target is None:
            target = case.note
        else:
            target = f">= {case.target:.1f}x: {'met' if ratio >= case.target else 'missed'}"
        lines.append(f"| {case.what} | {ours:,.0f}/s | {base:,.0f}/s | {ratio:.2f}x | {target} |")
    entries = {b["name"]: b for run in runs for b in run["benchmarks"]}
    for what, name, figure, unit, bound in SCALE:
        if name in entries:
            value = figure(entries[name])
            verdict = "met" if value < bound else "missed"
            lines.append(
                f"| {what} | {_quantity(value, unit)} | | | < {bound:g} {unit}: {verdict} |"
            )
    costs = cost_table(results)
    if costs:
        lines += ["", *costs]
    return "\n".join(lines)


USAGE = "usage: python benchmarks/report.py [--markdown] BENCH_JSON [BENCH_JSON ...]"


def main(argv: list[str]) -> int:
    markdown = argv[:1] == ["--markdown"]
    paths = argv[1:] if markdown else argv
    if not paths or any(p.startswith("-") for p in paths):
        print(USAGE, file=sys.stderr)
        return 2
    results, runs = load(paths)
    print(markdown_table(results, runs) if markdown else format_report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
