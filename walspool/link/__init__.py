"""The gateway link: the per-session machine and its state, eviction, drains, shutdown
flushes, the disk budget and what an outage tells the operator, composed around one
shared core (``link.core``) and reading a gateway's store only as ``Transcripts``
(``link.transcripts``). ``walspool.hermes`` maps hermes-agent 0.19.0's store and runner
onto it. On 0.20/0.22 the plugin and the drop-in (``walspool.shutdown_flush``) use its
gateway-neutral parts: the queues at a stop (``link.flush``), the in-memory backlog's
publisher (``link.memory``), the account of hand-offs to the spool's writer
(``link.handoffs``), supersede on rewrite (``link.rewrites``), the retries of deferred
drains (``link.deferred``) and the machine's decision whether a drain runs now
(``link.machine.next_step``)."""
