"""`fate-rdma eval link`: transports side by side on the same shaped link of the WAN testbed.

First slice of issue 14's evaluation: one plain TCP stream, a gRPC client stream, fedrdma and fedrdma-e
with window 1 (the paper's stop-and-wait) and the automatic window, each at several chunk sizes, over
one or more link settings, all between site a and site b of a testbed this command builds and removes.
Every transfer is verified by crc32c at the receiver; each figure is the median of --reps timed runs
after an untimed warm-up (connection, authentication, RTT probe). Not yet here: FATE's own federation
path, Mooncake, several QPs, Link-Enable, the LoRA sweep, system cost, fairness.

Writes into OUT/<UTC time>/: results.jsonl (one row per transport x chunk x link), table.md (machine,
provider, link as measured, payload, repetitions, medians, the command), link_throughput.png.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import wan
from .wan_run import SiteProcess

MiB = 1 << 20


@dataclass(frozen=True)
class Transport:
    name: str
    kind: str                      # "tcp", "grpc" or "channel"
    mode: str = ""
    window: str = ""


TRANSPORTS = (
    Transport("tcp stream", "tcp"),
    Transport("grpc stream", "grpc"),
    Transport("fedrdma w=1", "channel", "fedrdma", "1"),
    Transport("fedrdma auto", "channel", "fedrdma", "auto"),
    Transport("fedrdma-e w=1", "channel", "fedrdma-e", "1"),
    Transport("fedrdma-e auto", "channel", "fedrdma-e", "auto"),
)


@dataclass(frozen=True)
class Plan:
    links: Tuple[Tuple[float, float, float], ...]  # (rate Mbit/s, RTT ms, loss %)
    chunks: Tuple[int, ...]
    nbytes: int
    reps: int


# The paper's link, 10 Gbit/s x 20 ms, has a BDP of 25 MB; 100 Mbit/s x 20 ms has 250 KB. The rate is
# scaled, so the chunk must be too: what matters is chunk / BDP, printed beside every figure with the
# chunk it corresponds to on the paper's link (64 KiB here ~ 6.7 MB there; 1 MiB here ~ 105 MB there).
PAPER_BDP_BYTES = 10e9 * 0.020 / 8
# quick: one scaled link, two chunk sizes, 8 MiB, 2 reps (about a minute)
QUICK = Plan(links=((100.0, 20.0, 0.0),), chunks=(64 * 1024, 1 * MiB), nbytes=8 * MiB, reps=2)
FULL = Plan(links=((100.0, 20.0, 0.0), (200.0, 40.0, 0.0), (100.0, 20.0, 1.0)),
            chunks=(16 * 1024, 64 * 1024, 256 * 1024, 1 * MiB, 4 * MiB), nbytes=64 * MiB, reps=5)


def bdp_bytes(link: Tuple[float, float, float]) -> float:
    return link[0] * 1e6 * link[1] / 1e3 / 8


def _median_row(tb: wan.Testbed, t: Transport, chunk: Optional[int], runs: List[Dict[str, Any]],
                link: Tuple[float, float, float], measured: Dict[str, Any], nbytes: int) -> Dict[str, Any]:
    secs = [r["seconds"] for r in runs]
    med = statistics.median(secs)
    return {"transport": t.name, "kind": t.kind, "mode": t.mode or None, "window": t.window or None,
            "chunk_bytes": chunk, "bytes": nbytes, "reps": len(runs), "median_s": med,
            "median_bps": nbytes * 8 / med, "all_s": secs, "verified": all(r.get("ok", True) for r in runs),
            "window_used": [r.get("info", {}).get("window") for r in runs if isinstance(r.get("info"), dict)] or None,
            "link": {"rate_mbit": link[0], "rtt_ms": link[1], "loss_pct": link[2]},
            "measured": {"rtt_median_ms": measured.get("rtt", {}).get("median_ms"),
                         "tcp_bps": (measured.get("tcp") or {}).get("bps")},
            "provider": "soft (emulated verbs over TCP)" if t.kind == "channel" else "kernel TCP",
            "note": wan.testbed_note(tb, (0, 1))}


def _run_tcp(tb: wan.Testbed, nbytes: int, reps: int, timeout_s: float) -> List[Dict[str, Any]]:
    runs = []
    with SiteProcess(tb, 1, ["serve", "--host", tb.site_addr(1), "--deadline-s", str(timeout_s * (reps + 1))]) as srv:
        addr = srv.line(30)["address"]
        for _ in range(reps + 1):  # the first is the warm-up (ARP, route caches), dropped
            with SiteProcess(tb, 0, ["tcp-send", "--to", addr, "--bytes", str(nbytes), "--timeout-s", str(timeout_s)]) as tx:
                runs.append(tx.line(timeout_s + 30))
    return runs[1:]


def _run_grpc(tb: wan.Testbed, nbytes: int, chunk: int, reps: int, timeout_s: float) -> List[Dict[str, Any]]:
    with SiteProcess(tb, 1, ["grpc-serve", "--host", tb.site_addr(1), "--deadline-s", str(timeout_s * (reps + 1))]) as srv:
        addr = srv.line(60)["address"]
        with SiteProcess(tb, 0, ["grpc-send", "--to", addr, "--bytes", str(nbytes), "--chunk-bytes", str(chunk),
                                 "--reps", str(reps), "--timeout-s", str(timeout_s)]) as tx:
            return [tx.line(timeout_s + 60) for _ in range(reps)]


def _run_channel(tb: wan.Testbed, t: Transport, nbytes: int, chunk: int, reps: int, rate_mbit: float,
                 timeout_s: float, secret: str) -> List[Dict[str, Any]]:
    common = ["--secret", secret, "--mode", t.mode, "--window", t.window, "--chunk-bytes", str(chunk),
              "--slot-bytes", str(max(nbytes, chunk)), "--timeout-s", str(timeout_s),
              "--link-rate-mbit", str(rate_mbit)]
    with SiteProcess(tb, 1, ["channel-recv", "--host", tb.site_addr(1), "--count", str(reps + 1), *common]) as rx:
        addr = rx.line(60)["address"]
        with SiteProcess(tb, 0, ["channel-send", "--host", tb.site_addr(0), "--to", addr, "--bytes", str(nbytes),
                                 "--reps", str(reps), "--warmup", *common]) as tx:
            runs = [tx.line(timeout_s + 60) for _ in range(reps)]
        got = [rx.line(30) for _ in range(reps + 1)][1:]
    for r, g in zip(runs, got):
        r["ok"] = g["nbytes"] == nbytes and g["crc32c"] == r["crc32c"]
        if not r["ok"]:
            raise wan.WanError(f"{t.name}: received {g['nbytes']} B crc32c {g['crc32c']:#x}, sent {nbytes} B "
                               f"crc32c {r['crc32c']:#x}")
    return runs


def run_eval(plan: Plan, out_root: Path, prefix: str = "freval", timeout_s: float = 300.0,
             log: Callable[[str], None] = print, command: str = "") -> Path:
    """Run the plan; returns the results folder. The testbed is removed whatever happens."""
    out = out_root / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out.mkdir(parents=True, exist_ok=True)
    rows: List[Dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="fate-rdma-eval-") as tmp, open(out / "results.jsonl", "w") as jl:
            from .channel.auth import write_secret

            secret = str(Path(tmp) / "secret")
            write_secret(secret)
            for link in plan.links:
                spec = wan.LinkSpec(rate_bps=int(link[0] * 1e6), delay_ms=link[1] / 2, loss_pct=link[2])
                tb = wan.Testbed(links=(spec, spec), prefix=prefix)
                measured = wan.up(tb, measure_seconds=2.0)["measured"]
                log(f"link {link[0]:g} Mbit/s, rtt {link[1]:g} ms, loss {link[2]:g} %: measured rtt "
                    f"{measured['rtt'].get('median_ms', float('nan')):.2f} ms, tcp {wan.fmt_rate(measured['tcp']['bps'])}")
                for t in TRANSPORTS:
                    for chunk in ([None] if t.kind == "tcp" else plan.chunks):
                        if t.kind == "tcp":
                            runs = _run_tcp(tb, plan.nbytes, plan.reps, timeout_s)
                        elif t.kind == "grpc":
                            runs = _run_grpc(tb, plan.nbytes, chunk, plan.reps, timeout_s)  # type: ignore[arg-type]
                        else:
                            runs = _run_channel(tb, t, plan.nbytes, chunk, plan.reps, link[0], timeout_s,  # type: ignore[arg-type]
                                                secret)
                        row = _median_row(tb, t, chunk, runs, link, measured, plan.nbytes)
                        rows.append(row)
                        jl.write(json.dumps(row) + "\n")
                        jl.flush()
                        log(f"  {t.name:15s} chunk {_size(chunk):>7s}: {wan.fmt_rate(row['median_bps']):>13s} "
                            f"(median of {row['reps']}, verified)")
    finally:
        wan.down(prefix)
    (out / "table.md").write_text(markdown(rows, plan, command))
    plot = write_plot(rows, out / "link_throughput.png")
    if plot:
        log(f"plot: {plot}")
    log(f"results: {out}")
    return out


def _size(n: Optional[int]) -> str:
    if n is None:
        return "-"
    return f"{n // MiB} MiB" if n >= MiB and n % MiB == 0 else f"{n // 1024} KiB"


def machine() -> str:
    return (f"{platform.system()} {platform.release()} {platform.machine()}, {os.cpu_count()} cores (shared), "
            f"Python {platform.python_version()}")


def markdown(rows: Sequence[Dict[str, Any]], plan: Plan, command: str) -> str:
    lines = ["# fate-rdma eval link", "", f"- command: `{command}`" if command else "- command: (library call)",
             f"- machine: {machine()}",
             "- provider: fate-rdma over the soft provider (emulated verbs over TCP), not RDMA; tcp/grpc: kernel TCP",
             f"- payload: {plan.nbytes / MiB:g} MiB of seeded random bytes, crc32c verified at the receiver",
             f"- repetitions: {plan.reps} timed after one untimed warm-up; figures are medians",
             "- connections: tcp stream opens one per transfer (handshake and slow start included); grpc keeps one "
             "warm HTTP/2 connection, fedrdma/fedrdma-e one warm endpoint connection (TCP slow start after idle "
             "still applies to all)", ""]
    by_link: Dict[str, List[Dict[str, Any]]] = {}
    for r in rows:
        by_link.setdefault(json.dumps(r["link"]), []).append(r)
    for rs in by_link.values():
        l, m = rs[0]["link"], rs[0]["measured"]
        tcp_bps = next((r["median_bps"] for r in rs if r["kind"] == "tcp"), None)
        lines += [f"## {l['rate_mbit']:g} Mbit/s, {l['rtt_ms']:g} ms RTT, {l['loss_pct']:g} % loss", "",
                  f"Measured: rtt {m['rtt_median_ms']:.2f} ms (UDP echo median), one TCP stream "
                  f"{wan.fmt_rate(m['tcp_bps'])}. {rs[0]['note']}.", "",
                  f"BDP {bdp_bytes((l['rate_mbit'], l['rtt_ms'], 0)) / 1e3:.0f} KB; \"paper chunk\" is the chunk with "
                  f"the same chunk/BDP on 10 Gbit/s x 20 ms.", "",
                  "| transport | chunk | chunk/BDP | paper chunk | median s | median Mbit/s | vs tcp stream | window used |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in rs:
            ratio = f"{r['median_bps'] / tcp_bps:.2f}" if tcp_bps else "-"
            used = sorted({w for w in (r["window_used"] or []) if w is not None})
            c = r["chunk_bytes"]
            ratio_bdp = c / bdp_bytes((l["rate_mbit"], l["rtt_ms"], 0)) if c else None
            lines.append(f"| {r['transport']} | {_size(c)} | {f'{ratio_bdp:.2f}' if c else '-'} | "
                         f"{f'{ratio_bdp * PAPER_BDP_BYTES / 1e6:.1f} MB' if c else '-'} | {r['median_s']:.3f} | "
                         f"{r['median_bps'] / 1e6:.1f} | {ratio} | {', '.join(map(str, used)) or '-'} |")
        lines.append("")
    return "\n".join(lines)


def write_plot(rows: Sequence[Dict[str, Any]], path: Path) -> Optional[Path]:
    """Grouped bars: Mbit/s by transport, one bar per chunk size, one panel per link. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install 'fate-rdma[eval]')", file=sys.stderr)
        return None
    links = list(dict.fromkeys(json.dumps(r["link"]) for r in rows))
    fig, axes = plt.subplots(1, len(links), figsize=(7 * len(links), 4.5), squeeze=False)
    for ax, lk in zip(axes[0], links):
        rs = [r for r in rows if json.dumps(r["link"]) == lk]
        names = list(dict.fromkeys(r["transport"] for r in rs))
        chunks = list(dict.fromkeys(r["chunk_bytes"] for r in rs if r["chunk_bytes"] is not None))
        width = 0.8 / max(1, len(chunks))
        for j, c in enumerate(chunks):
            ys = [next((r["median_bps"] / 1e6 for r in rs if r["transport"] == n and r["chunk_bytes"] == c), 0) for n in names]
            ax.bar([i + j * width for i in range(len(names))], ys, width, label=f"chunk {_size(c)}")
        tcp = next((r["median_bps"] / 1e6 for r in rs if r["kind"] == "tcp"), None)
        if tcp:  # no chunk: one bar across its group, and a line to compare the others with
            i = names.index(next(r["transport"] for r in rs if r["kind"] == "tcp"))
            ax.bar([i + 0.4 - width / 2], [tcp], 0.8, color="grey")
            ax.axhline(tcp, color="grey", linestyle="--", label="tcp stream")
        l = json.loads(lk)
        ax.axhline(l["rate_mbit"], color="black", linewidth=0.8, label="link rate")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=20, fontsize=8)
        ax.set_ylabel("Mbit/s (median)")
        ax.set_title(f"{l['rate_mbit']:g} Mbit/s, {l['rtt_ms']:g} ms RTT, {l['loss_pct']:g} % loss\n"
                     "testbed: real packets, scaled rate (not 10 Gbit/s x 20 ms)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
