"""The gateway link: the per-session machine and its state, eviction, drains, shutdown
flushes, the disk budget and what an outage tells the operator. ``walspool.hermes``
maps hermes-agent 0.19.0's store and runner onto it; the 0.20/0.22 drop-in
(``walspool.shutdown_flush``) does not use it yet."""
