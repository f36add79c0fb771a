"""`fate-rdma eval cost`: the system cost of a 1 GB transfer (the paper's Table 4), here on loopback.

Time, extra memory beyond the payload, and CPU seconds of the sending and of the receiving process,
for one TCP stream, a gRPC client stream (4 MiB messages), fedrdma and fedrdma-e (automatic window)
and Mooncake Transfer Engine's TCP transport (one sync write). The receiver is a second process on
this machine; there is no WAN testbed (its delay helper would spend the same 2 cores and its rate
cap would hide the cost): the link is loopback. fate-rdma runs over the soft provider: verbs
emulated over TCP, not RDMA; path "tcp" is loopback TCP as between hosts, "same-host" the soft
provider's process_vm_readv copy between two processes of one machine.

Reuses `fate-rdma bench transfer`'s machinery (fate_rdma_lab.bench.transfer: its receiver process, raw
TCP / gRPC baselines and fedrdma runs; fate_rdma_lab.bench.cpu, .memory) and Mooncake's bench peer
(fate_rdma_lab.bench.mooncake_peer). Extra memory is the receiver's peak RSS above its level before the
transfer (fate-rdma: before its endpoint existed), less what the method must hold: the payload where
it allocates one, fedrdma-e's registered receive slots; for Mooncake, above its registered, touched
destination buffer. CPU seconds: user + system of every thread of each process over the transfer.

What is verified: fedrdma/fedrdma-e check the channel's own end-to-end checksum (its default, named in
each row: xxh3 since 2026-11-26, crc32c before); Mooncake: crc32c of
the receiver's buffer against the payload (Mooncake checks nothing); raw TCP and gRPC: byte counts.

The paper's own Table 4 (a real 10 Gbit/s RDMA NIC, 20 ms RTT) is printed beside, labelled as the
paper's. Writes OUT/<UTC time>-cost/: results.jsonl, table.md, cost.png.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from fate_rdma_lab.eval.common import PAPER_TABLE4, SOFT, MiB, Rows, header, loadavg, md_table, median, print_md, pyplot, \
    results_dir

PATHS = ("tcp", "same-host")


@dataclass(frozen=True)
class Plan:
    nbytes: int = 1024 * MiB
    reps: int = 3
    paths: Tuple[str, ...] = PATHS

    def with_(self, **kw: Any) -> "Plan":
        p = dataclasses.replace(self, **{k: v for k, v in kw.items() if v is not None})
        if p.nbytes <= 0 or p.reps <= 0:
            raise ValueError("--payload-mib and --reps must be positive")
        if not p.paths or any(x not in PATHS for x in p.paths):
            raise ValueError(f"--paths: one or more of {', '.join(PATHS)}")
        return p


FULL = Plan()
QUICK = Plan(nbytes=64 * MiB, reps=1, paths=("tcp",))


def _proc_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _mooncake(nbytes: int, seed: int, crc: int, reps: int) -> Dict[str, Any]:
    """Mooncake TE sync write between two bench peers; the receiver's extra peak RSS read from /proc."""
    from fate_rdma_lab.bench import mooncake
    from fate_rdma_lab.bench.driver import PeerProcess

    why = mooncake.missing()
    if why:
        return {"skipped": why}
    with PeerProcess(module="fate_rdma_lab.bench.mooncake_peer") as recv, \
            PeerProcess(module="fate_rdma_lab.bench.mooncake_peer") as send:
        try:
            dst = recv.cmd({"cmd": "open", "role": "recv", "host": recv.host, "nbytes": nbytes})
            send.cmd({"cmd": "open", "role": "send", "host": send.host, "nbytes": nbytes, "seed": seed})
            write = {"cmd": "write", "target": dst["session"], "dst_addr": dst["addr"], "nbytes": nbytes, "chunk_bytes": 0}
            send.cmd(write)  # warm-up: the segment, its connections, the pages
            times, cpu_send, cpu_recv, extra = [], [], [], []
            pid = recv.proc.pid
            for _ in range(reps):
                recv.cmd({"cmd": "fill", "value": 1})
                with open(f"/proc/{pid}/clear_refs", "w") as f:  # VmHWM := VmRSS (the buffer is touched)
                    f.write("5")
                base = _proc_kib(pid, "VmRSS")
                c0 = recv.cmd({"cmd": "cpu"})["cpu_s"]
                r = send.cmd(write)
                c1 = recv.cmd({"cmd": "cpu"})["cpu_s"]
                extra.append(max(0, _proc_kib(pid, "VmHWM") - base) * 1024)
                got = recv.cmd({"cmd": "crc", "nbytes": nbytes})["crc32c"]
                if got != crc:
                    return {"error": f"received crc32c {got:#010x}, payload {crc:#010x}"}
                times.append(r["seconds"])
                cpu_send.append(r["cpu_s"])
                cpu_recv.append(c1 - c0)
        except (RuntimeError, OSError) as exc:
            return {"error": f"Mooncake: {exc}"}
        return {"times": times, "cpu_send": cpu_send, "cpu_recv": cpu_recv, "rss": extra, "label": dst["version"]}


def run_cost(plan: Plan, out_root: Path, log: Callable[[str], None] = print, command: str = "") -> Path:
    import crc32c
    import numpy as np

    from fate_rdma_lab.bench import baselines, transfer
    from fate_rdma_lab.bench.driver import PeerProcess
    from fate_rdma.config import ChannelConfig

    out = results_dir(out_root, "cost")
    rows = Rows(out)
    data = np.frombuffer(np.random.default_rng(baselines.PAYLOAD_SEED).bytes(plan.nbytes), dtype=np.uint8)
    common = {"study": "cost", "bytes": plan.nbytes, "reps": plan.reps, "link": "loopback",
              "measured": {"rtt_median_ms": None, "tcp_bps": None, "tcp_cc": None}}

    def add(method: str, path: str, provider: str, res: Dict[str, Any], verified: str) -> None:
        t = median(res.get("times", []))
        row = rows.add({**common, "method": method, "path": path, "provider": provider, "label": res.get("label"),
                        "median_s": t, "gbps": plan.nbytes * 8 / t / 1e9 if t else None,
                        "extra_rss_bytes": median(res["rss"]) if res.get("rss") else None,
                        "cpu_send_s": median(res.get("cpu_send", [])), "cpu_recv_s": median(res.get("cpu_recv", [])),
                        "window": res.get("window"), "verified": verified if t else None, "loadavg": loadavg(),
                        "skipped": res.get("skipped"), "error": res.get("error")})
        log(f"  {method:16s} {path:10s} " + (f"{t:.3f} s, extra {_mb(row['extra_rss_bytes'])}, CPU send "
                                             f"{row['cpu_send_s']:.2f} s / recv {row['cpu_recv_s']:.2f} s"
                                             if t else f"not measured: {res.get('skipped') or res.get('error')}"))

    try:
        log(f"eval cost: {plan.nbytes / MiB:g} MiB on loopback, {plan.reps} reps, load average {loadavg()}")
        with PeerProcess(module="fate_rdma_lab.bench.transfer_peer") as peer:
            base: Dict[str, Dict[str, Any]] = {}

            def collect(row: Dict[str, Any], cpu_send: Optional[List[float]] = None,
                        cpu_recv: Optional[List[float]] = None) -> None:
                base[row["method"]] = {"times": [row["seconds"]], "rss": [row["extra_rss_bytes"]],
                                       "cpu_send": cpu_send or [], "cpu_recv": cpu_recv or []}

            raw = baselines.run_baselines(peer, "loopback", ["raw_tcp", "grpc_stream"], data, plan.reps, collect)
            if raw is not None:
                raw.close()
            add("tcp stream", "tcp", "kernel TCP", base["raw_tcp"], "byte count")
            add("grpc stream", "tcp", "gRPC over kernel TCP", base["grpc_stream"], "byte count")
            for path in plan.paths:
                for mode in ("fedrdma", "fedrdma-e"):
                    cfg = ChannelConfig(mode=mode, window="auto", slot_bytes=plan.nbytes, provider="soft",
                                        transfer_timeout_s=3600, no_progress_timeout_s=120, same_host=path == "same-host")
                    res = transfer._channel(peer, data, cfg, plan.reps)
                    # the path the transfers took (EASYPYVERBS_SOFT_SAME_HOST=off or an unusable same-host path: tcp)
                    took = "same-host" if str(res["path"]).startswith("same-host") else str(res["path"])
                    add(mode, took, "soft (emulated verbs, not RDMA)", res, f"{cfg.checksum} end to end")
        add("mooncake sync", "tcp", "Mooncake TE TCP transport",
            _mooncake(plan.nbytes, baselines.PAYLOAD_SEED, crc32c.crc32c(data.data), plan.reps), "crc32c of the buffer")
    finally:
        lines = rows.save(out, markdown(rows.rows, plan, command), lambda: write_plot(rows.rows, out / "cost.png"))
    print_md(lines, log, out)
    return out


def _mb(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 1e6:.3g} MB"


def markdown(rows: Sequence[Dict[str, Any]], plan: Plan, command: str) -> List[str]:
    gib = plan.nbytes / (1 << 30)
    lines = header("fate-rdma eval cost", command, [
        "link: loopback (no testbed); sender and receiver are two processes of this machine",
        f"provider: fate-rdma over the {SOFT}; Mooncake: its TCP transport; tcp/grpc: kernel TCP",
        f"payload: {plan.nbytes / MiB:g} MiB ({gib:.3g} GiB) of seeded random bytes; {plan.reps} timed transfers after "
        "one warm-up; figures are medians; extra memory = the receiver's peak RSS beyond what the method must hold"])
    cells = [[r["method"], r["path"], r["provider"], f"{r['median_s']:.3f}" if r["median_s"] else "-",
              f"{r['gbps']:.2f}" if r["gbps"] else "-", _mb(r["extra_rss_bytes"]),
              f"{r['cpu_send_s']:.2f}" if r["cpu_send_s"] is not None else "-",
              f"{r['cpu_recv_s']:.2f}" if r["cpu_recv_s"] is not None else "-",
              r["verified"] or f"not measured: {r['skipped'] or r['error']}"] for r in rows]
    lines += ["## ours (this machine, loopback)", ""]
    lines += md_table(["method", "path", "provider", "median s", "Gbit/s", "extra memory", "CPU s send",
                       "CPU s receive", "verified by"], cells)
    lines += ["## the paper's Table 4 (FedRDMA paper: 1 GB, real 10 Gbit/s RDMA NIC, 20 ms RTT) - not measured here",
              ""]
    lines += md_table(["system (paper)", "extra memory", "time"], [[n, f"{m:g} MB", f"{t:g} s"] for n, m, t in PAPER_TABLE4])
    lines += ["The paper's times are bound by its 20 ms RTT link (FedRDMA-E's 6.0 s is stop-and-wait: 256 chunks x "
              "23.4 ms); ours are loopback on 2 shared cores, where the cost is CPU and copies: compare memory and CPU "
              "across rows, not our seconds with the paper's.", ""]
    return lines


def write_plot(rows: Sequence[Dict[str, Any]], path: Path) -> Optional[Path]:
    plt = pyplot()
    ok = [r for r in rows if r["median_s"]]
    if plt is None or not ok:
        return None
    names = [f"{r['method']}\n({r['path']})" for r in ok]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (("median seconds", [r["median_s"] for r in ok]),
              ("extra memory at the receiver, MB", [(r["extra_rss_bytes"] or 0) / 1e6 for r in ok]),
              ("CPU seconds, send | receive", None))
    for ax, (title, ys) in zip(axes, panels):
        xs = list(range(len(ok)))
        if ys is None:
            ax.bar([x - 0.2 for x in xs], [r["cpu_send_s"] or 0 for r in ok], 0.4, label="send")
            ax.bar([x + 0.2 for x in xs], [r["cpu_recv_s"] or 0 for r in ok], 0.4, label="receive")
            ax.legend(fontsize=7)
        else:
            ax.bar(xs, ys)
        ax.set_xticks(xs, names, rotation=30, fontsize=7)
        ax.set_title(f"{title}\nloopback, {rows[0]['bytes'] / MiB:g} MiB; soft provider = emulation", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
