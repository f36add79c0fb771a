"""`fate-rdma eval stress`: FedComm's stresses on the WAN testbed; nothing may be lost or corrupted.

One two-site testbed (site a sends, site b receives), reshaped in place for each condition: random
loss of 0, 0.1, 1 and 5 % of the packets leaving each site (nftables, per MTU frame, both directions:
data and ACKs), then no loss with a concurrent CPU stress (busy-looping processes in the sending
site, one per core by default: they compete with the sender, and on this 2-core machine with the
testbed's delay helper too, which every transport shares). Under each, the same payload goes by one
TCP stream, fedrdma and fedrdma-e (automatic window), --reps timed transfers after a warm-up.

Every transfer is verified at the receiver: its byte count and crc32c must equal the sender's, and
at least the payload must have crossed the shaped link. A transfer that times out, fails or arrives
different is a row that names it, not a crash; the table says "nothing lost or corrupted" only when
every transfer of the run passed, else lists what failed, and the command exits 1. The packets the
link dropped (nft counters) are printed beside, so "nothing lost" is a statement about a lossy link.

Writes OUT/<UTC time>-stress/: results.jsonl, table.md, stress.png.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from fate_rdma_lab.testbed import bed as wan
from fate_rdma_lab.eval.common import SOFT, LinkPlan, MiB, Rows, bars, header, link_line, loadavg, md_table, measured_link, median, \
    print_md, results_dir, secret_file, size, testbed
from fate_rdma_lab.eval.runners import Transport, run
from fate_rdma_lab.testbed.run import SiteProcess

TRANSPORTS = (Transport("tcp stream", "tcp"), Transport("fedrdma auto", "channel", "fedrdma", "auto"),
              Transport("fedrdma-e auto", "channel", "fedrdma-e", "auto"))


@dataclass(frozen=True)
class Plan(LinkPlan):
    losses: Tuple[float, ...] = (0.0, 0.1, 1.0, 5.0)
    burners: Optional[int] = None      # busy processes of the CPU condition; None: one per core

    def check(self) -> None:
        if any(not 0 <= x < 100 for x in self.losses) or (self.burners is not None and self.burners < 0):
            raise ValueError("--losses must be within [0, 100) and --cpu-burners >= 0")

    @property
    def cpu_burners(self) -> int:
        return (os.cpu_count() or 1) if self.burners is None else self.burners


FULL = Plan()
QUICK = Plan(rate_mbit=50.0, rtt_ms=10.0, nbytes=4 * MiB, reps=1, measure_s=1.0)


def conditions(plan: Plan) -> List[Tuple[str, float, int]]:
    out = [(f"loss {x:g} %", x, 0) for x in plan.losses]
    if plan.cpu_burners:
        n = plan.cpu_burners
        out.append((f"loss 0 % + CPU stress ({n} busy process{'es' if n != 1 else ''} in site a)", 0.0, n))
    return out


def drops(tb: wan.Testbed) -> Dict[str, int]:
    """Packets the link's nft rules have dropped so far, per site the packets left (0 without loss rules)."""
    text = wan.status(tb.prefix)["namespaces"].get(tb.router, {}).get("nft", "")
    out = {}
    for i, x in enumerate(wan.SITE_NAMES[:len(tb.links)]):
        m = re.search(rf"saddr 198\.18\.{i + 1}\.0/24 .*?packets (\d+) bytes \d+ drop", text)
        out[x] = int(m.group(1)) if m else 0
    return out


def run_stress(plan: Plan, out_root: Path, prefix: str = "freval", timeout_s: float = 300.0,
               log: Callable[[str], None] = print, command: str = "") -> Path:
    """Run every condition; returns the results folder. WanError (after writing it) if anything failed."""
    out = results_dir(out_root, "stress")
    rows = Rows(out)
    spec = wan.LinkSpec(rate_bps=int(plan.rate_mbit * 1e6), delay_ms=plan.rtt_ms / 2)
    try:
        with secret_file() as secret, testbed(wan.Testbed(links=(spec, spec), prefix=prefix), plan.measure_s, log) as bed:
            for i, (name, loss, burners) in enumerate(conditions(plan)):
                s = dataclasses.replace(spec, loss_pct=loss)
                measured = bed.shape(wan.Testbed(links=(s, s), prefix=prefix)) if i else measured_link(bed.measured)
                burn = [SiteProcess(bed.tb, 0, ["burn", "--deadline-s", str(timeout_s * 10)]) for _ in range(burners)]
                try:
                    for b in burn:
                        b.line(30)
                    for t in TRANSPORTS:
                        d0 = drops(bed.tb)
                        res = run(bed.tb, t, plan.nbytes, plan.chunk_bytes, plan.reps, timeout_s, secret,
                                  rate_mbit=plan.rate_mbit)
                        d1 = drops(bed.tb)
                        row = rows.add(_row(name, loss, burners, res, measured, bed.tb, {k: d1[k] - d0[k] for k in d1}))
                        log(f"  {name:55s} {t.name:15s} {_cell_rate(row):>14s}  {_verdict(row)}; link dropped "
                            f"{row['dropped_packets']['a']} data / {row['dropped_packets']['b']} return packets")
                finally:
                    for b in burn:
                        b.close()
    finally:
        lines = rows.save(out, markdown(rows.rows, plan, command), lambda: write_plot(rows.rows, out / "stress.png"))
    print_md(lines, log, out)
    bad = [r for r in rows.rows if not r["verified"]]
    if bad:
        raise wan.WanError(f"{len(bad)} of {len(rows.rows)} stress rows lost or corrupted data: " +
                           "; ".join(f"{r['condition']} {r['transport']}: {'; '.join(r['failures'])}" for r in bad) +
                           f" (results in {out})")
    return out


def _row(condition: str, loss: float, burners: int, res: Any, measured: Dict[str, Any], tb: wan.Testbed,
         dropped: Dict[str, int]) -> Dict[str, Any]:
    t = res.transport
    med = median([r["seconds"] for r in res.runs])
    return {"study": "stress", "condition": condition, "loss_pct": loss, "cpu_burners": burners, "transport": t.name,
            "kind": t.kind, "mode": t.mode or None, "provider": t.provider, "bytes": res.nbytes,
            "transfers": len(res.runs), "transfers_ok": sum(1 for r in res.runs if r["ok"]),
            "received_bytes": sum(r.get("received_bytes") or 0 for r in res.runs),
            "median_s": med, "median_bps": res.nbytes * 8 / med if med else None,
            "all_s": [r["seconds"] for r in res.runs], "verified": res.verified, "failures": res.failures,
            "link_bytes": res.link_bytes, "dropped_packets": dropped, "loadavg": loadavg(),
            "window_used": sorted({r["window"] for r in res.runs if r.get("window")}) or None,
            "link": {"rate_mbit": tb.links[0].rate_bps / 1e6 if tb.links[0].rate_bps else None,
                     "rtt_ms": tb.links[0].delay_ms * 2, "loss_pct": loss},
            "measured": measured, "note": wan.testbed_note(tb, (0, 1))}


def _cell_rate(r: Dict[str, Any]) -> str:
    return wan.fmt_rate(r["median_bps"]) if r["median_bps"] else "-"


def _verdict(r: Dict[str, Any]) -> str:
    if r["verified"]:
        return f"{r['transfers_ok']}/{r['transfers']} verified"
    return f"FAILED: {'; '.join(r['failures'])}"


def markdown(rows: Sequence[Dict[str, Any]], plan: Plan, command: str) -> List[str]:
    lines = header("fate-rdma eval stress", command, [
        f"provider: fate-rdma over the {SOFT}; tcp stream: kernel TCP",
        f"link: {plan.rate_mbit:g} Mbit/s, {plan.rtt_ms:g} ms RTT, loss per condition on the packets leaving each "
        f"site (data and return path); {rows[0]['note'] if rows else ''}",
        f"payload: {size(plan.nbytes)} of seeded random bytes per transfer; chunk {size(plan.chunk_bytes)}; "
        f"{plan.reps} timed transfers per figure after one untimed warm-up; figures are medians",
        "verification: every transfer's byte count and crc32c at the receiver against the sender's; at least the "
        "payload crossed the shaped link"])
    cells = []
    for r in rows:
        d = r["dropped_packets"]
        cells.append([r["condition"], r["transport"], r["provider"], link_line(r["measured"]),
                      f"{r['median_s']:.3f}" if r["median_s"] else "-",
                      f"{r['median_bps'] / 1e6:.1f}" if r["median_bps"] else "-",
                      f"{r['transfers_ok']}/{r['transfers']}", f"{r['received_bytes'] / MiB:g} MiB",
                      f"{d['a']} / {d['b']}", ", ".join(map(str, r["window_used"] or [])) or "-",
                      "verified" if r["verified"] else "FAILED: " + "; ".join(r["failures"])])
    lines += md_table(["condition", "transport", "provider", "link (measured before the runs, without CPU stress)",
                       "median s", "median Mbit/s", "transfers ok", "received", "dropped pkts data / return", "window",
                       "verification"], cells)
    bad = [r for r in rows if not r["verified"]]
    total = sum(r["transfers"] for r in rows)
    dropped = sum(r["dropped_packets"]["a"] + r["dropped_packets"]["b"] for r in rows)
    if rows and not bad:
        lines.append(f"**Nothing lost or corrupted**: all {total} timed transfers (and their warm-ups) arrived whole, "
                     f"byte count and crc32c equal to the sender's, while the link dropped {dropped} packets.")
    elif bad:
        lines.append("**Lost or corrupted**: " + "; ".join(f"{r['condition']} / {r['transport']}: "
                                                           f"{'; '.join(r['failures'])}" for r in bad))
    return lines + [""]


def write_plot(rows: Sequence[Dict[str, Any]], path: Path) -> Optional[Path]:
    conds = list(dict.fromkeys(r["condition"] for r in rows))
    labels = [c.replace(" + CPU stress", "\n+ CPU").split(" (")[0] for c in conds]
    series = {t.name: [next(((r["median_bps"] or 0) / 1e6 for r in rows if r["condition"] == c and r["transport"] == t.name),
                            None) for c in conds] for t in TRANSPORTS}
    title = "stress: median Mbit/s per condition (0 = failed)"
    return bars(path, [(title, labels, series)] if rows else [], "Mbit/s (median)",
                "testbed: real packets, scaled rate; soft provider = emulation")
