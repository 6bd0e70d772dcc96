"""The gateway link's bounds and tunables, in one place: every wait a gateway thread
can meet because of walspool is bounded by one of these (docs/gateway.md lists them).
The link's modules read them at each use (``bounds.NAME``), so there is one value."""

#: Failures in a row until the retry delay reaches ``retry_interval``.
RETRY_STEPS = 4
#: Shortest delay between two background retries of one session, whatever the interval.
MIN_RETRY_SECONDS = 0.01
#: Spooled rows one drain step moves; the writer re-reads its session's state between
#: steps, so a rewrite, a shutdown or a waiting gateway thread is seen this often.
DRAIN_CHUNK_ROWS = 128
#: Spooled rows a gateway thread drains in one ``append_to_transcript`` before it leaves
#: the rest to the background thread (about 0.6 s of writes on the reference machine).
GATEWAY_DRAIN_ROWS = 1024
#: Evictions the spool writer's report of a group settles per take of the store's lock
#: (a group may hold thousands): a gateway thread waits for the lock behind this many.
SETTLE_CHUNK = 64
#: Seconds a gateway thread waits for its session's evictions to commit before a drain.
CONFIRM_WAIT = 0.25
#: How often that wait looks whether the spool's write lock is held elsewhere.
BUSY_LOOK_SECONDS = 0.01
#: Seconds a gateway thread waits to take its session over from the background thread.
HANDOFF_WAIT = 2.0
#: Seconds ``flush_queues`` waits for the spool at shutdown.
FLUSH_TIMEOUT = 10.0
#: Longest the background thread sleeps before it looks for work again (it is woken
#: whenever there is some; this only bounds the life of a forgotten link's thread).
IDLE_WAKE_SECONDS = 60.0
#: Seconds: the cap of a failing session's retry delay (``retry_interval``'s default;
#: see docs/gateway.md), and the least wait before a fresh spool is tried again.
RETRY_INTERVAL = 1.0
