"""`fate-rdma eval fate --job train`: the rows, table and plot of real GPT-2 LoRA FedAvg training rounds
through the testbed (the paper's Figure 7: computation against communication per round), for
eval.fate_run.run_fate, which runs the parties."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from fate_rdma_lab.testbed import bed as wan
from fate_rdma_lab.eval.common import SOFT, Rows, header, machine, md_table, median, pyplot
from fate_rdma_lab.eval.fate import (METHODS, PATHS, QUEUE, QUEUE_SITE, SITES, Plan, _bytes, _mib, link_bound, path_failures,
                        setup_lines)


TRAIN_PNG = "fate_train_rounds.png"
#: the channel's counters cover the whole job, the untimed warm-up exchange included: not per-round figures
_WHOLE_JOB = ("channel_up_bytes", "channel_down_bytes", "rdma_timers")


def fate_weights(rows: Rows) -> Optional[str]:
    """The clients' final weights (sha256) after FATE's own path, once it ran (it runs first)."""
    return next((r["sha256"] for r in rows.rows if r.get("row") == "median" and r["method"] == "fate"), None)


def train_rows(method: str, got: Dict[str, Any], plan: Plan, measured: Dict[str, Any], tb: wan.Testbed,
               reference: Optional[str]) -> List[Dict[str, Any]]:
    """One row per round (compute, comm and loss as `fate-rdma sweep lora` defines them: sweep.round_rows),
    then the method's median row with its peak RSS, link and queue counters and its verification."""
    from fate_rdma_lab.llm.sweep import round_rows

    p = got["parties"]
    g, h = p["guest"], p["host"]
    up, down = plan.client_bytes()
    crossed = sum(v["up"] for v in got["link_bytes"].values())  # each packet between sites: once up
    common = {"study": "fate-train", "job": "train", "method": method, "path": PATHS[method], "machine": machine(),
              "payload": plan.payload, "model": plan.model, "device": plan.device, "lora_rank": plan.lora_rank,
              "rounds_asked": plan.rounds,
              "sites": {role: wan.SITE_NAMES[s] for role, s in SITES.items()},
              "queue_site": wan.SITE_NAMES[QUEUE_SITE], "measured": measured, "note": wan.testbed_note(tb, (1, 0)),
              "link": {"rate_mbit": plan.rate_mbit, "rtt_ms": plan.rtt_ms, "loss_pct": plan.loss_pct},
              "loadavg_1m": round(os.getloadavg()[0], 2)}
    failures = path_failures(method, got, plan, crossed)
    try:
        rounds = round_rows(p, common)
    except (KeyError, IndexError, TypeError) as exc:
        rounds, failures = [], failures + [f"the parties' records are incomplete: {type(exc).__name__}: {exc}"]
    if len(rounds) != plan.rounds:
        failures.append(f"{len(rounds)} round(s) recorded, {plan.rounds} asked")
    if g.get("sha256") != h.get("sha256"):
        failures.append("guest and host ended on different weights after FedAvg")
    if (g.get("up_bytes"), g.get("down_bytes")) != (up, down):
        failures.append(f"the job put {g.get('up_bytes')} / {g.get('down_bytes')} B a round, {up} / {down} expected")
    if reference is not None and g.get("sha256") != reference:
        failures.append("the clients' final weights differ from those after FATE's own path")
    provider = SOFT if method != "fate" else "FATE OSX engine through " + QUEUE
    rdma = {r: p[r].get("rdma") or {} for r in SITES}
    for r in rounds:
        for k in _WHOLE_JOB:
            r.pop(k, None)
        # round_rows names the provider by the job's label; the row names the path too
        r.update(row="round", label=r["provider"], provider=provider, federation=got["federation"],
                 verified=not failures)
    med = {
        **common, "row": "median", "rounds": len(rounds), "label": g.get("label"), "provider": provider,
        "emulated": "emulated" in (g.get("label") or ""), "federation": got["federation"],
        "trainable_params": g.get("trainable_params"), "up_bytes": up, "down_bytes": down,
        "compute_seconds": median([r["compute_seconds"] for r in rounds]),
        "comm_seconds": median([r["comm_seconds"] for r in rounds]),
        "round_seconds": median([r["round_seconds"] for r in rounds if r["round_seconds"] is not None]),
        "loss_guest": rounds[-1]["loss_guest"] if rounds else None,
        "loss_host": rounds[-1]["loss_host"] if rounds else None,
        "peak_rss_bytes": {r: p[r]["peak_rss_bytes"] for r in SITES}, "sha256": g.get("sha256"),
        "same_weights_as_fate": None if reference is None else g.get("sha256") == reference,
        "link_bound_seconds": link_bound(plan), "link_bound_alone_seconds": (up + down) * 8 / (plan.rate_mbit * 1e6),
        "link_bytes": got["link_bytes"], "link_bytes_total": crossed, "queue": got["queue"],
        "rdma": {r: {k: s.get(k) for k in ("rdma_transfers", "rdma_bytes", "fate_fallbacks")} for r, s in rdma.items()}
        if method != "fate" else None,
        "verified": not failures, "failures": failures,
    }
    return rounds + [med]


def _sec(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3f}"


def _loss(r: Dict[str, Any]) -> str:
    return " / ".join("-" if x is None else f"{x:.4f}" for x in (r.get("loss_guest"), r.get("loss_host")))


def train_markdown(rows: Sequence[Dict[str, Any]], plan: Plan, command: str, failed: Sequence[str]) -> List[str]:
    from fate_rdma_lab.llm.sweep import LOSS_KIND

    meds = [r for r in rows if r.get("row") == "median"]
    up, down = plan.client_bytes()
    model = "GPT-2 124M (GPT2Config(), random init)" if plan.model == "gpt2" else "tiny GPT-2 (2 layers, n_embd 128)"
    loads = sorted({r["loadavg_1m"] for r in meds})
    lines = header("fate-rdma eval fate --job train: FedAvg training rounds through the testbed (Figure 7)", command, [
        *setup_lines(plan, meds),
        f"job: {model} + peft LoRA r={plan.lora_rank} on c_attn, FedAvg with FATE-LLM (Seq2SeqFedAVGClient/Server, "
        f"FATE's secure aggregation; fate_rdma_lab.llm.gpt2_fedavg), {plan.rounds} round(s) x {plan.steps_per_round} "
        f"local steps of 2 x 48 tokens, {plan.device.upper()}, 1 torch thread per party; load average (1 min) after each method "
        + (f"{loads[0]:.2f} - {loads[-1]:.2f}" if loads else "-"),
        f"payload per client per round: {_bytes(up)} up (mixed float64, 16 B a trainable parameter) / "
        f"{_bytes(down)} down (the float64 average); before the job, one untimed 1 MiB warm-up exchange each way "
        "per client (fate-rdma's connections open there, as FATE's gRPC channel to the queue opens in the job)",
        "compute per round: the slower client's local steps (from the round's start to its aggregation call); "
        "comm per round: time in FedAvg's aggregation call of the client that reached it last (the smaller of the "
        "two: upload, the arbiter's unmasking sum, download; the other also waits there for this one's steps); "
        "as `fate-rdma sweep lora` defines them (sweep.round_rows); median row: medians over the rounds, loss "
        "of the last round",
        f"loss: {LOSS_KIND}, guest / host",
        "verified: both clients end on the same weights (sha256), every method on the same weights as FATE's own "
        "path, the rounds asked were recorded, the payload crossed the links and took the method's path (through "
        "the queue, or the channel with only small objects in the queue)"])
    fate = next((r for r in meds if r["method"] == "fate"), None)
    cells = []
    for r in [r for r in rows if r.get("row") in ("round", "median")]:
        total = (r["compute_seconds"] or 0) + (r["comm_seconds"] or 0)
        share = f"{100 * r['comm_seconds'] / total:.0f} %" if total else "-"
        if r["row"] == "round":
            cells.append([r["method"], r["round"], f"{r['compute_seconds']:.3f}", f"{r['comm_seconds']:.3f}", share,
                          _loss(r), "", "", "", ""])
            continue
        rss = r["peak_rss_bytes"]
        ratio = (f"{fate['comm_seconds'] / r['comm_seconds']:.2f}"
                 if fate and r is not fate and r["comm_seconds"] else "1" if r is fate else "-")
        cells.append([f"**{r['method']}**", "**median**", f"**{_sec(r['compute_seconds'])}**",
                      f"**{_sec(r['comm_seconds'])}**", share, _loss(r),
                      f"{_mib(rss['guest'])} / {_mib(rss['host'])} / {_mib(rss['arbiter'])}",
                      f"{_mib(r['link_bytes_total'])} / {_bytes(r['queue']['pushed_bytes'])}", ratio,
                      "verified" if r["verified"] else "FAILED: " + "; ".join(r["failures"])])
    lines += md_table(["method", "round", "compute s", "comm s", "comm share", "loss guest / host",
                       "peak RSS MiB guest / host / arbiter", "MiB crossed links / through the queue",
                       "FATE comm / this", "verification"], cells)
    if meds:
        lines.append(f"Link-bound comm per round, at the shaped {plan.rate_mbit:g} Mbit/s, headers and RTT not counted: "
                     f"{meds[0]['link_bound_alone_seconds']:.3f} s when the other client's upload is already done (the "
                     f"last client's own upload and download), {meds[0]['link_bound_seconds']:.3f} s when both clients "
                     f"reach the aggregation together (both uploads, then both downloads, share the arbiter's link): "
                     f"comm depends on how far apart the clients finish their steps. Peak RSS and link / queue bytes: "
                     f"the whole job of each method.")
        lines.append("")
    lines += [f"FAILED: {f}" for f in failed]
    return lines + [""]


def write_train_plot(rows: Sequence[Dict[str, Any]], plan: Plan, path: Path) -> Optional[Path]:
    """Figure 7's shape: per method and round, a bar of compute with the round's communication on top."""
    plt = pyplot()
    rounds = [r for r in rows if r.get("row") == "round"]
    if plt is None or not rounds:
        return None
    palette = {"fate": "tab:green", "fedrdma-e": "tab:blue", "fedrdma": "tab:purple"}
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    ticks: List[Tuple[float, str]] = []
    x = 0.0
    for m in [m for m in METHODS if any(r["method"] == m for r in rounds)]:
        mine = [r for r in rounds if r["method"] == m]
        xs = [x + i for i in range(len(mine))]
        compute = [r["compute_seconds"] for r in mine]
        comm = [r["comm_seconds"] for r in mine]
        ax.bar(xs, compute, 0.7, color="lightgrey", edgecolor="grey",
               label="computation (slower client's local steps)" if not ticks else None)
        ax.bar(xs, comm, 0.7, bottom=compute, color=palette[m], label=f"communication, {m}")
        for xi, c, k in zip(xs, compute, comm):
            ax.annotate(f"{k:.2f}", (xi, c + k), ha="center", fontsize=7, textcoords="offset points", xytext=(0, 2))
        ticks += [(xi, f"{m}\nround {r['round']}") for xi, r in zip(xs, mine)]
        x += len(mine) + 0.6  # a gap between methods
    ax.set_xticks([t[0] for t in ticks], [t[1] for t in ticks], fontsize=7)
    ax.set_ylabel("seconds per round")
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title(f"{plan.payload}; {plan.steps_per_round} local steps a round, {plan.device.upper()}\n{plan.rate_mbit:g} Mbit/s x "
                 f"{plan.rtt_ms:g} ms RTT testbed: real packets, scaled rate\nsoft provider = emulation, not RDMA; "
                 "FATE: OSX engine through the project's test queue, not a real OSX", fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
