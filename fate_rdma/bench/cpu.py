"""CPU time of this process (user + system, every thread), for CPU seconds per GB moved.

A method that busy-polls burns CPU while it waits; one that blocks in the kernel does not. Wall time
on a shared machine hides the difference, so the transfer bench reports both, per side.
"""
from __future__ import annotations

import os
import resource
from typing import Any, Dict, Optional

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


def usable_cores() -> int:
    """The cores this process may run on (its affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def ceiling(row: Dict[str, Any], raw: Dict[str, Any], nbytes: int, cores: int) -> Optional[str]:
    """Where CPU bounds a method against raw TCP on this machine: raw TCP's CPU seconds per GB (both sides)
    and how many of the `cores` it kept busy, the method's CPU per GB, and, when raw TCP kept most of the
    cores busy (it is CPU-bound here, as on loopback with two cores), the throughput ratio the method can
    reach at most with its CPU per GB (raw's / the method's: each GB costs it that much more of the same
    cores). None when a side's CPU was not measured."""
    try:
        raw_cpu = raw["cpu_send_s_per_gb"] + raw["cpu_recv_s_per_gb"]
        cpu = row["cpu_send_s_per_gb"] + row["cpu_recv_s_per_gb"]
        busy = raw_cpu * (nbytes / GB) / raw["seconds"]
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    if not raw_cpu or not cpu:
        return None
    head = (f"CPU per GB, both sides: raw TCP {raw_cpu:.3f} s ({busy:.1f} of {cores} cores busy while it ran), "
            f"{row['method']} {cpu:.3f} s ({cpu / raw_cpu:.2f} x)")
    if busy < 0.6 * cores:
        return head + ": raw TCP did not keep the cores busy, CPU is not what bounds the ratio here"
    return (head + f": raw TCP is CPU-bound on this machine, so {row['method']} can reach at most about "
            f"{raw_cpu / cpu:.2f} x its throughput here (a machine with idle cores would not bind it so)")
