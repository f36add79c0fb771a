"""`fate-rdma sweep lora`'s report: the console summary, table.md and lora_sweep.png of a sweep folder
(its rows and settings come from sweep.py, which runs the jobs)."""
from __future__ import annotations

import os
import sys
from statistics import median
from typing import Any, Dict, List, Optional, Sequence

from fate_rdma_lab.llm.sweep_rows import EMULATION, LINK, LOSS_KIND, Settings, latest_runs, machine, read_meta, read_rows


def describe(rows: List[Dict[str, Any]]) -> str:
    r0 = rows[0]
    head = f"  rank {r0['rank']:>4} {r0['transport']:<9}"
    if r0["status"] != "ok":
        return f"{head} FAILED: {r0['error']}" + (f" (log: {r0['log']})" if r0["log"] else "")
    last = rows[-1]
    emu = f"  [{EMULATION}]" if r0["emulated"] else ""
    return (f"{head} loss {_f(last['loss_guest'])}/{_f(last['loss_host'])} (guest/host) at round {last['round']}, "
            f"comm {median(r['comm_seconds'] for r in rows):.3f} s/round, compute "
            f"{median(r['compute_seconds'] for r in rows):.3f} s/round, {_mb(r0['up_bytes'])} up / "
            f"{_mb(r0['down_bytes'])} down per client per round, job {r0['job_seconds']:.0f} s{emu}")


def _f(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.4f}"


def _mb(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 1e6:.2f} MB"


def summary(rows: Sequence[Dict[str, Any]], s: Settings) -> List[Dict[str, Any]]:
    """One line per (rank, transport) asked: its last job's medians, or its error."""
    runs = latest_runs(rows)
    out = []
    for rank in s.ranks:
        for t in s.transports():
            rs = runs.get((rank, t))
            if not rs:
                continue
            ok = sorted((r for r in rs if r["status"] == "ok"), key=lambda r: r["round"])
            if not ok:
                out.append({"rank": rank, "transport": t, "status": "failed", "error": rs[0]["error"]})
                continue
            last = ok[-1]
            rss = [r["peak_rss_bytes"] for r in ok]
            out.append({
                "rank": rank, "transport": t, "status": "ok", "params": last["trainable_params"],
                "up_bytes": last["up_bytes"], "down_bytes": last["down_bytes"], "rounds": len(ok),
                "loss_guest": last["loss_guest"], "loss_host": last["loss_host"], "loss": last["loss"],
                "comm_median_s": median(r["comm_seconds"] for r in ok),
                "compute_median_s": median(r["compute_seconds"] for r in ok),
                "client_rss": max(max(x["guest"], x["host"]) for x in rss), "arbiter_rss": max(x["arbiter"] for x in rss),
                "provider": last["provider"], "emulated": last["emulated"], "device": last["device"],
            })
    return out


def markdown(rows: Sequence[Dict[str, Any]], s: Settings, folder: str) -> str:
    lines_ = summary(rows, s)
    meta = read_meta(folder) or {}
    providers = sorted({x["provider"] for x in lines_ if x.get("provider") and x["transport"] == "fate-rdma"})
    emulated = any(x.get("emulated") for x in lines_)
    model = "GPT-2 124M (GPT2Config(), random init)" if s.model == "gpt2" else "tiny GPT-2 (2 layers, n_embd 128)"
    loads = sorted({r["loadavg_1m"] for r in rows if "loadavg_1m" in r})
    md = [
        "# LoRA rank sweep with training", "",
        f"- job: {model} + peft LoRA on c_attn (alpha = 2 x rank), FedAvg with FATE-LLM "
        "(Seq2SeqFedAVGClient/Server, FATE's secure aggregation), guest + host + arbiter",
        f"- rounds: {s.rounds} x {s.steps_per_round} local steps of {s.batch_size} x {s.seq_len} tokens; "
        f"device {s.device}; {s.threads} torch thread(s) per party",
        f"- machine: {meta.get('machine', machine())}; load average (1 min) at the jobs' starts "
        + (f"{loads[0]:.2f} - {loads[-1]:.2f}" if loads else "-"),
        f"- link: {LINK}",
        f"- provider: {', '.join(providers) or '-'}" + (f" **[{EMULATION}]**" if emulated else ""),
        f"- loss: {LOSS_KIND}; the table shows the last round's, guest / host",
        "- comm per round: time in FedAvg's aggregation call of the client that reached it last (upload, the "
        "arbiter's sum, download); compute per round: the slower client's local steps; medians over rounds",
        "- payload: per client per round, FATE's secure aggregation (the mixed float64 weights, 16 bytes a "
        "trainable parameter, up; the float64 average, 8 bytes, down)",
        "",
        "| rank | transport | trainable params | payload up / down | loss at last round (guest / host) "
        "| comm per round, median (s) | compute per round, median (s) | peak RSS client / arbiter |",
        "|---:|---|---:|---|---|---:|---:|---|",
    ]
    for x in lines_:
        if x["status"] != "ok":
            err = x["error"].replace("|", "/")[:160]
            md.append(f"| {x['rank']} | {x['transport']} | - | - | failed: {err} | - | - | - |")
            continue
        md.append(f"| {x['rank']} | {x['transport']} | {x['params']:,} | {_mb(x['up_bytes'])} / {_mb(x['down_bytes'])} "
                  f"| {_f(x['loss_guest'])} / {_f(x['loss_host'])} | {x['comm_median_s']:.3f} "
                  f"| {x['compute_median_s']:.3f} | {x['client_rss'] / 2**30:.2f} / {x['arbiter_rss'] / 2**30:.2f} GiB |")
    md += ["", "Command(s): " + "; ".join(f"`{c}`" for c in meta.get("commands", []) if c), ""]
    return "\n".join(md)


def write_outputs(folder: str, s: Settings) -> tuple:
    rows = read_rows(folder)
    table_path = os.path.join(folder, "table.md")
    with open(table_path, "w") as f:
        f.write(markdown(rows, s, folder))
    return table_path, write_plot(summary(rows, s), s, os.path.join(folder, "lora_sweep.png"))


def write_plot(lines_: Sequence[Dict[str, Any]], s: Settings, path: str) -> Optional[str]:
    """Loss reached (left) and communication per round (right) against the LoRA rank; None when nothing
    completed yet or matplotlib is missing."""
    ok = [x for x in lines_ if x["status"] == "ok"]
    if not ok:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("sweep lora: no plot (matplotlib is not installed: pip install matplotlib)", file=sys.stderr)
        return None
    fig, (ax_loss, ax_comm) = plt.subplots(1, 2, figsize=(10, 5))
    has_rdma = any(x["transport"] == "fate-rdma" for x in ok)
    for t, marker, color in (("fate-rdma", "o", "tab:blue"), ("fate", "s", "tab:green")):
        xs = [x for x in ok if x["transport"] == t]
        if not xs:
            continue
        ranks = [x["rank"] for x in xs]
        if t == "fate-rdma" or not has_rdma:  # the same weights either way: one loss curve
            ax_loss.plot(ranks, [x["loss_guest"] for x in xs], marker="o", label="guest")
            ax_loss.plot(ranks, [x["loss_host"] for x in xs], marker="o", linestyle="--", label="host")
        label = ("fate-rdma" + (" (soft: emulated)" if any(x["emulated"] for x in xs) else "")
                 if t == "fate-rdma" else "FATE's own federation")
        ax_comm.plot(ranks, [x["comm_median_s"] for x in xs], marker=marker, color=color,
                     label=f"communication, {label}")
        ax_comm.plot(ranks, [x["compute_median_s"] for x in xs], marker=marker, color=color, linestyle=":",
                     alpha=0.5, label=f"computation, {t} job")
        if t == "fate-rdma" or not has_rdma:  # what each point moved: the upload per client and round
            for x in xs:
                ax_comm.annotate(_mb(x["up_bytes"]) + " up", (x["rank"], x["comm_median_s"]), fontsize=7,
                                 textcoords="offset points", xytext=(5, -11))
    all_ranks = sorted({x["rank"] for x in ok})
    for ax in (ax_loss, ax_comm):
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_ranks, [str(r) for r in all_ranks])
        ax.minorticks_off()
        ax.set_xlabel("LoRA rank")
        ax.grid(True, alpha=0.3)
    ax_loss.legend(fontsize=8)
    ax_comm.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
    ax_loss.set_ylabel(f"training loss at round {s.rounds}")
    ax_comm.set_yscale("log")
    ax_comm.set_ylabel("seconds per round (median)")
    model = "GPT-2 124M" if s.model == "gpt2" else "tiny GPT-2"
    emu = any(x["emulated"] for x in ok)
    fig.suptitle(f"{model} LoRA FedAvg (FATE-LLM), {s.rounds} rounds x {s.steps_per_round} steps, {s.device}; "
                 f"one host, loopback" + (f"\n{EMULATION}" if emu else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
