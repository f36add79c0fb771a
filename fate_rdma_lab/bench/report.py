"""Printing benchmark results: one JSON line per measurement, then an aligned table."""
from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Any, Dict, List, Optional, Sequence, TextIO


#: the label of every verdict line whose figures come from the soft provider (its table rows name the provider)
EMULATED_TAG = " [soft provider: emulated verbs, not an RDMA figure]"


def figure_tag(row: Dict[str, Any]) -> str:
    """A verdict line's label: the soft provider's figures are an emulation; Soft-RoCE (rxe) is real verbs but
    no RDMA hardware (so labelled); a device's own label otherwise."""
    if row.get("emulated"):
        return EMULATED_TAG
    label = str(row.get("label") or "")
    return " [rxe: kernel verbs without RDMA hardware]" if "rxe" in label else (f" [{label}]" if label else "")


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def loadavg() -> str:
    """The machine's load average (1, 5, 15 min): printed with every result, since on a shared machine
    the load beside a run moves its figures."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def emit(row: Dict[str, Any], out: Optional[TextIO] = None) -> None:
    """One JSON line (on stdout as it is at the call); it carries the 1-minute load average at the time it
    was measured."""
    out = out or sys.stdout
    row.setdefault("loadavg_1m", round(os.getloadavg()[0], 2))
    out.write(json.dumps(row, sort_keys=False) + "\n")
    out.flush()


def table(rows: List[Dict[str, Any]], columns: List[str], out: Optional[TextIO] = None) -> None:
    out = out or sys.stdout

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    out.write("  ".join(c.ljust(w) for c, w in zip(columns, widths)) + "\n")
    out.write("  ".join("-" * w for w in widths) + "\n")
    for row in cells:
        out.write("  ".join(v.ljust(w) for v, w in zip(row, widths)) + "\n")
    out.write(f"load average (1, 5, 15 min) now: {loadavg()}\n")
    out.flush()


def parse_size(text: str) -> int:
    """A byte count written as 4096, 64K, 1M, 4MiB or 1.5G; ValueError naming `text` if it is none or not
    positive."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        value = int(float(t[:-1] if mult > 1 else t) * mult)
    except (ValueError, OverflowError):
        raise ValueError(f"bad size {text!r} (try 4K, 1M, 64M)") from None
    if value <= 0:
        raise ValueError(f"a size must be positive, got {text!r}")
    return value


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
