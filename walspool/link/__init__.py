"""The gateway link: the per-session machine and its state, eviction, drains, shutdown
flushes, the disk budget and what an outage tells the operator, composed around one
shared core (``link.core``) and reading a gateway's store only as ``Transcripts``
(``link.transcripts``). ``walspool.hermes`` maps hermes-agent 0.19.0's store and runner
onto it. On 0.20/0.22 the plugin uses two of its parts: the queues at a stop
(``link.flush``) and the in-memory backlog's publisher (``link.memory``); the rest of
the drop-in (``walspool.shutdown_flush``) does not use it yet."""
