"""Peak resident memory of this process, from Linux's /proc (for the memory targets)."""

from __future__ import annotations


def reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark (``clear_refs`` 5); return the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def peak_rss() -> int:
    """The largest RSS since the last reset, in bytes."""
    return _status("VmHWM")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")
