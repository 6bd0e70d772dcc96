"""``walspool metrics``: a spool's state in OpenMetrics text, for alerting."""

from __future__ import annotations

import argparse
import http.server
import socket
import sys
import time
from pathlib import Path
from typing import NamedTuple

from ..errors import WalspoolError
from ..store.paging import readable
from ._holders import holders
from ._interrupt import interruptible
from ._output import EXIT_OK, dump
from ._reading import reading
from .stats import read_stats

#: The media type Prometheus asks for and gets (OpenMetrics 1.0).
CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def run(args: argparse.Namespace) -> int:
    """Print the spool's metrics in OpenMetrics text; --listen serves them instead.

    Gauges, each labelled with the spool's path: walspool_rows and
    walspool_payload_bytes (by reason), walspool_set_aside_payload_bytes (by status:
    quarantined, superseded), walspool_sessions, walspool_file_bytes (file="db", "wal"),
    walspool_oldest_row_age_seconds (0 for an empty spool), walspool_failing_rows (a
    write of theirs failed) and walspool_failing_sessions (with such a row),
    walspool_in_flight_rows, walspool_quarantined_rows,
    walspool_superseded_rows, walspool_last_error_age_seconds (only while rows with an
    error are there), walspool_open_processes (processes that have the spool open: 0
    means no gateway drains it; left out where the system cannot tell), and, per
    gateway process that published one (labels pid and alive: "true", "false" once it
    is gone, "unknown" on another host; left out while none did), its in-memory backlog:
    walspool_memory_messages, walspool_memory_bytes and
    walspool_memory_oldest_age_seconds. Counters:
    walspool_rows_drained_total (rows a replay or a gateway's drain moved into
    state.db), walspool_rows_quarantined_total (rows set aside for what state.db or
    the spool refused in them) and walspool_memory_lost_messages_total (messages
    gateway processes held in memory when they ended without a clean stop, counted at
    the next start of a gateway on their host), kept in the spool across restarts. Written to a
    file, node_exporter's textfile collector exports them; --listen HOST:PORT serves
    them at /metrics, read afresh at each scrape, until SIGINT or SIGTERM (the first
    line on stdout names the address, port 0 taking a free one). --json prints the
    same reading as {"spool", "metrics": [{"name", "help", "samples": [[labels,
    value]]}]}.
    """
    if args.listen is not None:
        return _serve(args.spool, args.listen)
    if args.json:
        print(
            dump(
                {
                    "spool": str(args.spool),
                    "metrics": [f._asdict() for f in read_families(args.spool)],
                }
            )
        )
    else:
        sys.stdout.write(exposition(args.spool))
    return EXIT_OK


def _alive_label(alive: bool | None) -> str:
    return "unknown" if alive is None else str(alive).lower()


class Family(NamedTuple):
    """One metric: its name, help, samples as (labels, value), and its type (a
    counter's samples are named ``<name>_total``)."""

    name: str
    help: str
    samples: list[tuple[dict[str, str], float]]
    type: str = "gauge"


def exposition(spool: Path) -> str:
    """The spool's metrics, one reading, as OpenMetrics text ending in ``# EOF``."""
    where = {"spool": str(spool)}
    out: list[str] = []
    for name, help, samples, kind in read_families(spool):
        unit = next((u for u in ("seconds", "bytes") if name.endswith(f"_{u}")), None)
        out.append(f"# TYPE {name} {kind}")
        if unit is not None:
            out.append(f"# UNIT {name} {unit}")
        out.append(f"# HELP {name} {help}")
        sample = f"{name}_total" if kind == "counter" else name
        for labels, value in samples:
            text = ",".join(f'{k}="{_escaped(v)}"' for k, v in {**where, **labels}.items())
            out.append(f"{sample}{{{text}}} {_number(value)}")
    out.append("# EOF")
    return "\n".join(out) + "\n"


def read_families(spool: Path) -> list[Family]:
    """The spool's metrics, one reading (``stats``'s)."""
    with reading(spool, walk=True) as reader:
        stats = reader.read(lambda conn: read_stats(conn, spool, time.time()))
    found = holders(spool)
    out: list[Family] = []

    def family(
        name: str, help: str, samples: list[tuple[dict[str, str], float]], kind: str = "gauge"
    ) -> None:
        out.append(Family(name, help, samples, kind))

    family(
        "walspool_rows",
        "Rows in the spool, by the reason they were spooled.",
        [({"reason": reason}, n) for reason, n in stats["by_reason"].items()],
    )
    family("walspool_sessions", "Sessions with rows in the spool.", [({}, stats["sessions"])])
    family(
        "walspool_payload_bytes",
        "Payload bytes of the rows, by the reason they were spooled.",
        [({"reason": reason}, n) for reason, n in stats["bytes_by_reason"].items()],
    )
    family(
        "walspool_set_aside_payload_bytes",
        "Payload bytes of the rows set aside, by status: quarantined, superseded.",
        [({"status": s}, stats[f"{s}_bytes"]) for s in ("quarantined", "superseded")],
    )
    family(
        "walspool_file_bytes",
        "Bytes of the spool's database file and of its write-ahead log.",
        [({"file": "db"}, stats["db_bytes"]), ({"file": "wal"}, stats["wal_bytes"])],
    )
    family(
        "walspool_oldest_row_age_seconds",
        "Age of the oldest row; 0 when the spool is empty.",
        [({}, stats["oldest_age"] or 0.0)],
    )
    for name, key, help in (
        ("walspool_failing_rows", "failing", "Rows whose last write failed, with its error."),
        ("walspool_failing_sessions", "failing_sessions", "Sessions with a failing row."),
        ("walspool_in_flight_rows", "inflight", "Rows out with a replay or a gateway's drain."),
        ("walspool_quarantined_rows", "quarantined", "Rows state.db refused: never replayed."),
        ("walspool_superseded_rows", "superseded", "Rows a transcript rewrite replaced."),
    ):
        family(name, help, [({}, stats[key])])
    family(
        "walspool_rows_drained",
        "Rows a replay or a gateway's drain moved into state.db, since the spool was made.",
        [({}, stats["drained_total"])],
        "counter",
    )
    family(
        "walspool_rows_quarantined",
        "Rows quarantined for what state.db or the spool refused in them, since the spool "
        "was made.",
        [({}, stats["quarantined_total"])],
        "counter",
    )
    family(
        "walspool_memory_lost_messages",
        "Messages gateway processes held in memory when they ended without a clean stop "
        "(counted at the next start of a gateway on their host), since the spool was made.",
        [({}, stats["memory_lost_total"])],
        "counter",
    )
    if stats["memory"]:  # left out while no gateway process published any
        by_process = [
            (o, {"pid": str(o["pid"]), "alive": _alive_label(o["alive"])}) for o in stats["memory"]
        ]
        family(
            "walspool_memory_messages",
            "Transcript messages a linked gateway process holds in memory, not spooled "
            "yet: lost if it is killed. alive=false: the process is gone, and they were lost.",
            [(labels, o["messages"]) for o, labels in by_process],
        )
        family(
            "walspool_memory_bytes",
            "Bytes (as JSON) of the messages a gateway process holds in memory.",
            [(labels, o["bytes"]) for o, labels in by_process],
        )
        family(
            "walspool_memory_oldest_age_seconds",
            "Age of the oldest message a gateway process holds in memory.",
            [(labels, o["oldest_age"] or 0.0) for o, labels in by_process],
        )
    if stats["last_errors"]:
        family(
            "walspool_last_error_age_seconds",
            "Seconds since the latest failed write of a row still in the spool.",
            [({}, min(error["age"] for error in stats["last_errors"]))],
        )
    if found is not None:
        family(
            "walspool_open_processes",
            "Processes that have the spool open (a gateway writing or draining it).",
            [({}, len(found))],
        )
    return out


def _escaped(value: str) -> str:
    """A label value as OpenMetrics spells it: UTF-8 (a byte of a reason that is not
    UTF-8 as U+FFFD), backslash, quote and newline escaped."""
    text = readable(value) or ""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _serve(spool: Path, listen: tuple[str, int]) -> int:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404, "only /metrics is served")
                return
            try:
                body = exposition(spool).encode()
            except WalspoolError as exc:  # unreadable now: the scrape fails, saying why
                self.send_error(503, str(exc))
                return
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass  # a scrape every few seconds is not news

    class Server(http.server.ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in listen[0] else socket.AF_INET

    try:
        server = Server(listen, Handler)
    except OSError as exc:
        raise WalspoolError(f"cannot listen on {listen[0]}:{listen[1]}: {exc.strerror}") from exc
    host, port = server.server_address[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"serving http://{shown}:{port}/metrics", flush=True)
    try:
        with interruptible():
            server.serve_forever()
    finally:
        server.server_close()
    return EXIT_OK


def address(text: str) -> tuple[str, int]:
    """A --listen argument: HOST:PORT, an IPv6 host in brackets (PORT 0: any free
    port)."""
    host, colon, port = text.rpartition(":")
    if not colon or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (such as 127.0.0.1:9464)")
    return host.strip("[]") or "0.0.0.0", int(port)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--listen",
        type=address,
        metavar="HOST:PORT",
        help="serve the metrics at http://HOST:PORT/metrics until stopped",
    )
