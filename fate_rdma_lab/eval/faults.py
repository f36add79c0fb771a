"""`fate-rdma eval faults`: links that drop and peers that stall, on the WAN testbed; nothing may be lost,
nothing delivered twice.

One two-site testbed (site a sends, site b receives, a shaped link between). Under each condition a sender
streams --count transfers of seeded random sizes up to --max-bytes (--mode: FedRDMA or FedRDMA-E, 4 queued at a
time) while, once a third of them has arrived, the fault strikes:
    none            the same transfers undisturbed: the baseline of the run
    drop N s        site b's nftables drops everything from site a for N s (a blackhole)
    reset N s       site b answers site a with TCP resets for N s: every connection breaks
    pause N s       the receiving process is stopped (SIGSTOP) for N s, then continued
    loss P % bursts three 2 s bursts of P % random loss on what site b receives, 1 s apart
Every payload is checked at the receiver against the one the sender made (its index and the seed), every
index must arrive exactly once, and the receiver must hold nothing afterwards. A row says how many transfers
were resumed, the bytes sent again, the seconds the resumed ones waited for a connection, and the run's
time beside the undisturbed baseline of the same run. A condition that lost, duplicated or corrupted anything
is a row that names it, and the command exits 1.

Writes OUT/<UTC time>-faults/: results.jsonl, table.md, faults.png.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from fate_rdma_lab.eval.common import SOFT, LinkPlan, MiB, Rows, bars, header, link_line, md_table, measured_link, \
    median, print_md, results_dir, secret_file, size, testbed
from fate_rdma_lab.testbed import bed as wan
from fate_rdma_lab.testbed.firewall import site_rule
from fate_rdma_lab.testbed.run import SiteProcess

SITE = "fate_rdma_lab.eval.faults_site"
PORT = 7300
TABLE = "frfault"


@dataclass(frozen=True)
class Fault:
    kind: str          # none, drop, reset, pause, loss
    seconds: float = 0.0
    pct: float = 0.0

    @property
    def name(self) -> str:
        if self.kind == "none":
            return "none (baseline)"
        if self.kind == "loss":
            return f"loss {self.pct:g} % bursts (3 x 2 s)"
        return f"{self.kind} {self.seconds:g} s"


@dataclass(frozen=True)
class Plan(LinkPlan):
    count: int = 100
    max_bytes: int = 256 * MiB
    drops: Tuple[float, ...] = (2.0, 10.0, 30.0)
    reset_s: float = 1.0
    pause_s: float = 20.0
    loss_pct: float = 5.0
    seed: int = 7
    mode: str = "fedrdma"

    def check(self) -> None:
        if self.count < 3 or self.max_bytes < 1 or any(d <= 0 for d in self.drops) or self.pause_s < 0 \
                or self.reset_s < 0 or not 0 <= self.loss_pct < 100 or self.mode not in ("fedrdma", "fedrdma-e"):
            raise ValueError("--count must be >= 3, --max-bytes >= 1, --drops > 0, --pause-s and --reset-s >= 0, "
                             "--loss-pct within [0, 100), --mode fedrdma or fedrdma-e")

    def faults(self) -> List[Fault]:
        out = [Fault("none")] + [Fault("drop", d) for d in self.drops]
        if self.reset_s:
            out.append(Fault("reset", self.reset_s))
        if self.pause_s:
            out.append(Fault("pause", self.pause_s))
        if self.loss_pct:
            out.append(Fault("loss", 6.0, self.loss_pct))
        return out


FULL = Plan(rate_mbit=1000.0, rtt_ms=10.0)
QUICK = Plan(rate_mbit=200.0, rtt_ms=10.0, count=20, max_bytes=16 * MiB, drops=(2.0, 5.0), pause_s=5.0,
             measure_s=1.0)


def _firewall(tb: wan.Testbed, rule: str) -> None:
    """Site b's input chain: `rule` for what comes from site a ("" removes the table)."""
    site_rule(tb.site_ns(1), TABLE, f"ip saddr {tb.site_addr(0)} {rule}" if rule else "")


def strike(tb: wan.Testbed, fault: Fault, receiver_pid: int) -> None:
    """Apply `fault` for its duration, then lift it (also if interrupted)."""
    try:
        if fault.kind == "drop":
            _firewall(tb, "drop")
            time.sleep(fault.seconds)
        elif fault.kind == "reset":
            _firewall(tb, "meta l4proto tcp reject with tcp reset")
            time.sleep(fault.seconds)
        elif fault.kind == "pause":
            os.kill(receiver_pid, signal.SIGSTOP)
            try:
                time.sleep(fault.seconds)
            finally:
                os.kill(receiver_pid, signal.SIGCONT)
        elif fault.kind == "loss":
            for burst in range(3):
                _firewall(tb, f"numgen random mod 1000 < {int(fault.pct * 10)} drop")
                time.sleep(2.0)
                _firewall(tb, "")
                if burst < 2:
                    time.sleep(1.0)
    finally:
        _firewall(tb, "")


class _Reader:
    """A site process's JSON lines, gathered on a thread until it exits."""

    def __init__(self, proc: SiteProcess, timeout_s: float) -> None:
        self.proc, self.error = proc, ""
        self.lines: List[Dict[str, Any]] = []
        self._t = threading.Thread(target=self._run, args=(timeout_s,), daemon=True)
        self._t.start()

    def _run(self, timeout_s: float) -> None:
        try:
            while True:
                line = self.proc.line(timeout_s)
                self.lines.append(line)
                if "end" in line or "sent" in line:
                    return
        except wan.WanError as exc:
            self.error = str(exc)

    def join(self, timeout_s: float) -> None:
        self._t.join(timeout_s)


def run_condition(tb: wan.Testbed, plan: Plan, fault: Fault, conf: Dict[str, Any], timeout_s: float) -> Dict[str, Any]:
    """One condition: its row (before the baseline's figures are set beside it)."""
    rx_addr, tx_addr = f"{tb.site_addr(1)}:{PORT}", f"{tb.site_addr(0)}:{PORT}"
    c = json.dumps(conf)
    with SiteProcess(tb, 1, ["receive", c, rx_addr, str(plan.count), str(timeout_s)], module=SITE) as rx:
        pid = int(rx.line(60)["pid"])
        rx_lines = _Reader(rx, timeout_s)
        started = time.monotonic()
        with SiteProcess(tb, 0, ["send", c, tx_addr, rx_addr, str(plan.count), str(plan.max_bytes),
                                 str(plan.seed)], module=SITE) as tx:
            tx_lines = _Reader(tx, timeout_s)
            deadline = started + timeout_s
            while sum(1 for r in rx_lines.lines if "i" in r) < plan.count // 3 and time.monotonic() < deadline \
                    and not rx_lines.error and not tx_lines.error:
                time.sleep(0.05)
            struck = time.monotonic() - started
            strike(tb, fault, pid)
            tx_lines.join(max(1.0, deadline - time.monotonic()))
            rx_lines.join(max(1.0, deadline - time.monotonic()))
    return _row(plan, fault, rx_lines, tx_lines, started, struck)


def _row(plan: Plan, fault: Fault, rx: _Reader, tx: _Reader, started: float, struck: float) -> Dict[str, Any]:
    got = [r for r in rx.lines if "i" in r]
    results = [r for r in tx.lines if "i" in r]
    indexes = [r["i"] for r in got]
    lost = sorted(set(range(plan.count)) - set(indexes))
    twice = sorted({i for i in indexes if indexes.count(i) > 1} | {r["i"] for r in got if r.get("extra")})
    corrupted = sorted(r["i"] for r in got if not r["ok"] and not r.get("extra"))
    errors = [r["error"] for r in results if "error" in r]
    end = next((r for r in rx.lines if "end" in r), {})
    resumed = [r for r in results if r.get("resumes")]
    times = [r["at"] for r in results if "at" in r]  # (the sites' monotonic clock is this host's)
    # what a resumed transfer sent again: at most the chunks in flight at the cut (its window) and one more
    over = [r["i"] for r in resumed if r["resent_bytes"] > _bound(r, plan)]
    failures = [f"sent again more than the chunks in flight and one: {over}" if over else "",
                f"{len(lost)} lost: {lost[:10]}" if lost else "", f"delivered twice: {twice}" if twice else "",
                f"corrupted: {corrupted}" if corrupted else "", f"{len(errors)} failed: {errors[:3]}" if errors else "",
                f"the receiver still held {end.get('held_bytes')} bytes" if end.get("held_bytes") else "",
                rx.error, tx.error]
    failures = [f for f in failures if f]
    return {"study": "faults", "mode": plan.mode, "condition": fault.name, "fault": dataclasses.asdict(fault),
            "transfers": plan.count,
            "delivered": len(set(indexes)), "lost": lost, "twice": twice, "corrupted": corrupted, "errors": errors,
            "bytes": sum(r.get("bytes", 0) for r in results if "error" not in r),
            "resumed_transfers": len(resumed), "resumes": sum(r["resumes"] for r in resumed),
            "resent_bytes": sum(r["resent_bytes"] for r in resumed),
            "resent_bound_bytes": sum(_bound(r, plan) for r in resumed),
            "resume_wait_s": [round(r["resume_wait_s"], 3) for r in resumed],
            "struck_after_s": struck, "elapsed_s": (max(times) - started) if times else None,
            "verified": not failures, "failures": failures}


def _bound(r: Dict[str, Any], plan: Plan) -> int:
    """The most a resumed transfer may send again: the chunks in flight at the cut (its window) and one. With Q
    queue pairs chunks complete out of order across them, and the receiver holds only what lies beyond the first
    one missing: up to the window on each queue pair. Its chunk: the largest any of its tries sent (the channel's
    choice: --chunk-bytes, or larger on FedRDMA-E's slot path); its window, the largest of its tries'."""
    chunk = max(plan.chunk_bytes, r.get("chunk_bytes") or 0)
    qps = max(1, r.get("qps") or 1)
    return (r["window"] * qps + 1) * chunk


def run_faults(plan: Plan, out_root: Path, prefix: str = "freval", timeout_s: float = 600.0,
               log: Callable[[str], None] = print, command: str = "") -> Path:
    """Run every condition; returns the results folder. WanError (after writing it) if anything failed."""
    out = results_dir(out_root, "faults")
    rows = Rows(out)
    spec = wan.LinkSpec(rate_bps=int(plan.rate_mbit * 1e6), delay_ms=plan.rtt_ms / 2)
    try:
        with secret_file() as secret, testbed(wan.Testbed(links=(spec, spec), prefix=prefix), plan.measure_s, log) as bed:
            measured = measured_link(bed.measured)
            conf = {"provider": "soft", "mode": plan.mode, "secret_file": secret, "shared_secret_only": True,
                    "chunk_bytes": plan.chunk_bytes, "resume_window_s": 60, "connect_timeout_s": 5}
            base: Optional[float] = None
            for fault in plan.faults():
                row = run_condition(bed.tb, plan, fault, conf, timeout_s)
                if fault.kind == "none":
                    base = row["elapsed_s"]
                row.update(measured=measured, baseline_s=base, note=wan.testbed_note(bed.tb, (0, 1)),
                           extra_s=(row["elapsed_s"] - base) if base is not None and row["elapsed_s"] else None)
                rows.add(row)
                log(f"  {fault.name:28s} {row['delivered']}/{row['transfers']} delivered once, "
                    f"{row['resumed_transfers']} resumed, {row['resent_bytes'] / MiB:.1f} MiB sent again, "
                    f"{row['elapsed_s'] or 0:.1f} s  {'verified' if row['verified'] else 'FAILED: ' + '; '.join(row['failures'])}")
    finally:
        lines = rows.save(out, markdown(rows.rows, plan, command), lambda: write_plot(rows.rows, out / "faults.png"))
    print_md(lines, log, out)
    bad = [r for r in rows.rows if not r["verified"]]
    if bad:
        raise wan.WanError(f"{len(bad)} of {len(rows.rows)} fault conditions lost, duplicated or corrupted data: " +
                           "; ".join(f"{r['condition']}: {'; '.join(r['failures'])}" for r in bad) +
                           f" (results in {out})")
    return out


def markdown(rows: Sequence[Dict[str, Any]], plan: Plan, command: str) -> List[str]:
    lines = header("fate-rdma eval faults", command, [
        f"provider: fate-rdma ({'FedRDMA-E' if plan.mode == 'fedrdma-e' else 'FedRDMA'}) over the {SOFT}; "
        "resume_window_s 60",
        f"link: {plan.rate_mbit:g} Mbit/s, {plan.rtt_ms:g} ms RTT; {rows[0]['note'] if rows else ''}; "
        f"{link_line(rows[0]['measured']) if rows else ''}",
        f"transfers: {plan.count} per condition, seeded random sizes up to {size(plan.max_bytes)}, 4 queued at a time; "
        f"chunk {size(plan.chunk_bytes)}; the fault strikes once a third of them has arrived",
        "verification: every payload against the sender's (its index and the seed), each index exactly once, "
        "nothing held by the receiver afterwards"])
    cells = []
    for r in rows:
        waits = r["resume_wait_s"]
        cells.append([r["condition"], f"{r['delivered']}/{r['transfers']}", len(r["twice"]), len(r["corrupted"]),
                      r["resumed_transfers"], f"{r['resent_bytes'] / MiB:.1f} (bound {r['resent_bound_bytes'] / MiB:.1f})",
                      f"{median(waits):.2f}" if waits else "-",
                      f"{r['elapsed_s']:.1f}" if r["elapsed_s"] else "-",
                      f"{r['extra_s']:+.1f}" if r.get("extra_s") is not None else "-",
                      "verified" if r["verified"] else "FAILED: " + "; ".join(r["failures"])])
    lines += md_table(["condition", "delivered once", "twice", "corrupted", "resumed",
                       "MiB sent again (bound: window x QPs + 1 chunks)",
                       "resume wait s (median)", "run s", "vs baseline s", "verification"], cells)
    bad = [r for r in rows if not r["verified"]]
    if rows and not bad:
        lines.append(f"**Nothing lost, nothing delivered twice**: all {sum(r['transfers'] for r in rows)} transfers "
                     f"of the {len(rows)} conditions arrived once, verified.")
    return lines + [""]


def write_plot(rows: Sequence[Dict[str, Any]], path: Path) -> Optional[Path]:
    labels = [r["condition"].split(" (")[0] for r in rows]
    panels = [("faults: run time beyond the undisturbed baseline (s)", labels,
               {"seconds": [r.get("extra_s") for r in rows]}),
              ("bytes sent again on resuming (MiB)", labels, {"MiB": [r["resent_bytes"] / MiB for r in rows]})]
    return bars(path, panels if rows else [], "", "testbed: real packets, scaled rate; soft provider = emulation")
