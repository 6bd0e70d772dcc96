"""Replay: moving spooled rows into a sink (``state.db``) exactly once, the sinks that
write them, and the import of upstream's JSON-file spools."""
