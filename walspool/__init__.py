"""walspool: a durable WAL SQLite spool for the hermes-agent gateway's transcripts.

Messages the gateway would drop (at its pending-queue cap, or at shutdown) are
appended to a separate, FTS-free SQLite spool, and replayed into ``state.db`` in drop
order once it works again.
"""

from .errors import (
    DiskFull,
    InvalidArgument,
    NotAMessage,
    NotASpool,
    PayloadTooLarge,
    ReplayBusy,
    SchemaTooNew,
    SessionMissing,
    SpoolClosed,
    SpoolCorrupt,
    SpoolFull,
    SpoolIOError,
    SpoolReplaced,
    SymlinkRefused,
    UnsupportedGateway,
    UntrustedSpool,
    WalspoolError,
)
from .replay.jsonspool import ImportReport, import_json_spool
from .replay.replayer import Replayer, ReplayReport, StreamReport
from .replay.sinks import ForgetsTickets, SessionDBSink, Sink, WritesMany
from .store.records import (
    AGENT_HISTORY,
    CAP_DROP,
    QUARANTINED,
    SHUTDOWN,
    SUPERSEDED,
    Receipt,
    Record,
    Stats,
)
from .store.spool import Spool

__all__ = [
    "AGENT_HISTORY",
    "CAP_DROP",
    "QUARANTINED",
    "SHUTDOWN",
    "SUPERSEDED",
    "DiskFull",
    "ForgetsTickets",
    "ImportReport",
    "InvalidArgument",
    "NotAMessage",
    "NotASpool",
    "PayloadTooLarge",
    "Receipt",
    "Record",
    "ReplayReport",
    "ReplayBusy",
    "Replayer",
    "SchemaTooNew",
    "SessionDBSink",
    "SessionMissing",
    "Sink",
    "Spool",
    "SpoolClosed",
    "SpoolCorrupt",
    "SpoolFull",
    "SpoolIOError",
    "SpoolReplaced",
    "Stats",
    "StreamReport",
    "SymlinkRefused",
    "UnsupportedGateway",
    "UntrustedSpool",
    "WalspoolError",
    "WritesMany",
    "import_json_spool",
]
