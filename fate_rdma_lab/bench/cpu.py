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
    cores busy (CPU-bound, as on loopback with two cores), two bounds on the method's throughput ratio to
    raw TCP that its CPU per GB sets: at the CPU use raw TCP had (raw's CPU per GB / the method's), and
    with every core busy (that times cores / busy): the most it could reach here. None when a side's CPU
    was not measured."""
    try:
        raw_cpu = raw["cpu_send_s_per_gb"] + raw["cpu_recv_s_per_gb"]
        cpu = row["cpu_send_s_per_gb"] + row["cpu_recv_s_per_gb"]
        busy = raw_cpu * (nbytes / GB) / raw["seconds"]
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    if not raw_cpu or not cpu or busy <= 0:
        return None
    head = (f"CPU per GB, both sides: raw TCP {raw_cpu:.3f} s ({busy:.1f} of {cores} cores busy while it ran), "
            f"{row['method']} {cpu:.3f} s ({cpu / raw_cpu:.2f} x)")
    if busy < 0.6 * cores:
        return head + ": raw TCP did not keep the cores busy, CPU is not what bounds the ratio here"
    same, full = raw_cpu / cpu, raw_cpu / cpu * cores / busy
    return (head + f": raw TCP is CPU-bound on this machine, so {row['method']}'s CPU per GB allows about "
            f"{same:.2f} x its throughput at the same CPU use and at most {full:.2f} x with all {cores} cores busy")
