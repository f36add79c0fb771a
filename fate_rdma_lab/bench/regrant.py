"""What a FedRDMA-E slot's re-grant costs per provider: a new key on the kept registration against a new registration.

Each time the application releases a received message, its slot is given to the sender again under a new
rkey (the old one was revoked when the message arrived). Two ways, timed here in this process on one touched
buffer per size: `register`, deregister the slot's MR and register the memory again (what a provider without
revocable MRs does: on a NIC, pinning and mapping every page again), and `rekey`, `revoke_remote` then `rekey`
on an MR registered with `revocable=True` (soft provider: the key swapped in its table; pyverbs: a type 1
memory window deallocated and a fresh one bound, easypyverbs pyverbs_windows). Medians of the repetitions and
their ratio, per size; JSON lines plus a table. The soft provider is an emulation and Soft-RoCE (rxe) is not
RDMA hardware: each line carries the provider's label. Where a pyverbs device has no memory windows (or
EASYPYVERBS_MEMORY_WINDOWS=off) its `rekey` row says so and is skipped.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Dict, List

import numpy as np

import easypyverbs as ev

from fate_rdma_lab.bench.report import emit, human_bytes, parse_size, table
from fate_rdma_lab.bench.verbs import providers

ACCESS = ev.Access.LOCAL_WRITE | ev.Access.REMOTE_WRITE


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="1M,64M,256M", help="slot sizes (default 1M,64M,256M)")
    p.add_argument("--reps", type=int, default=7, help="re-grants timed per size and way (default 7)")
    p.add_argument("--providers", default="auto-all", help="comma list of soft,pyverbs (default: every available one)")


def _timed(fn: Any, reps: int) -> List[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def measure(prov: str, sizes: List[int], reps: int) -> List[Dict[str, Any]]:
    """The rows for one provider (see the module)."""
    rows: List[Dict[str, Any]] = []
    with ev.open_device(provider=prov) as ctx:
        pd = ctx.alloc_pd()
        base = {"bench": "regrant", "provider": prov, "emulated": ctx.emulated, "label": ctx.label}
        for size in sizes:
            buf = np.ones(size, dtype=np.uint8)  # touched: the registration's cost, not the first faults
            mr = [pd.reg_mr(buf, ACCESS)]

            def register() -> None:
                mr[0].close()
                mr[0] = pd.reg_mr(buf, ACCESS)

            got = {"register": _timed(register, reps)}
            mr[0].close()
            kept, why = pd.reg_mr(buf, ACCESS, revocable=True), ""
            try:
                if kept.revoke_remote():
                    kept.rekey()
                    got["rekey"] = _timed(lambda: (kept.revoke_remote(), kept.rekey()), reps)
                else:
                    why = ("this MR cannot take a new key (pyverbs memory windows off: none on the device, "
                           "EASYPYVERBS_MEMORY_WINDOWS=off, or a bind that failed, logged): it is registered anew at "
                           "each grant")
            except ev.EasyVerbsError as exc:
                why = f"a new key failed: {exc}"
            finally:
                kept.close()
            for way, times in got.items():
                row = dict(base, way=way, slot_bytes=size, median_ms=round(statistics.median(times) * 1e3, 4),
                           min_ms=round(min(times) * 1e3, 4), max_ms=round(max(times) * 1e3, 4), reps=len(times),
                           loadavg_1m=round(os.getloadavg()[0], 2))
                rows.append(row)
                emit(row)
            if "rekey" in got:
                ratio = statistics.median(got["register"]) / statistics.median(got["rekey"])
                row = dict(base, way="ratio", slot_bytes=size, register_over_rekey=round(ratio, 2))
            else:
                row = dict(base, way="rekey", slot_bytes=size, skipped=why)
            rows.append(row)
            emit(row)
    return rows


def run(args: argparse.Namespace) -> int:
    try:
        sizes = [parse_size(x) for x in args.sizes.split(",")]
    except ValueError as exc:
        raise SystemExit(f"fate-rdma bench regrant: {exc}") from None
    if args.reps < 1:
        raise SystemExit("fate-rdma bench regrant: --reps must be at least 1")
    print(f"fate-rdma bench regrant: sizes {','.join(human_bytes(z) for z in sizes)}, {args.reps} repetitions, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    rows = [r for prov in providers(args.providers) for r in measure(prov, sizes, args.reps)]
    print()
    table([dict(r, slot=human_bytes(r["slot_bytes"])) for r in rows if r["way"] != "ratio" and "skipped" not in r],
          ["provider", "way", "slot", "median_ms", "min_ms", "max_ms", "reps", "label"])
    print()
    for r in rows:
        if r["way"] == "ratio":
            print(f"{r['label']}: a {human_bytes(r['slot_bytes'])} slot's re-grant, a new registration "
                  f"over a new key: {r['register_over_rekey']:.2f} x")
        elif "skipped" in r:
            print(f"{r['label']}, {human_bytes(r['slot_bytes'])}: rekey skipped: {r['skipped']}")
    return 0
