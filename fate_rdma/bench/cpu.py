"""CPU time of this process (user + system, every thread), for CPU seconds per GB moved.

A method that busy-polls burns CPU while it waits; one that blocks in the kernel does not. Wall time
on a shared machine hides the difference, so the transfer bench reports both, per side.
"""
from __future__ import annotations

import resource
from typing import Optional

GB = 1e9  # CPU seconds per GB: decimal gigabytes, as Gbit/s are decimal


def cpu_s() -> float:
    """User plus system CPU seconds of this process so far, all threads (getrusage(RUSAGE_SELF))."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def per_gb(cpu_seconds: Optional[float], nbytes: int) -> Optional[float]:
    """CPU seconds per GB moved, rounded for a table; None stays None (a side that was not measured)."""
    if cpu_seconds is None or nbytes <= 0:
        return None
    return round(max(0.0, cpu_seconds) / (nbytes / GB), 4)
