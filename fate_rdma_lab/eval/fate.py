"""`fate-rdma eval fate`: FATE's own federation path beside fate-rdma, on the same WAN-testbed link.

Three sites, one party each: the arbiter in site a (198.18.1.2), the guest in site b (198.18.2.2), the
host in site c (198.18.3.2). Each party is its own process started with `ip netns exec`, builds its
FATE Context directly (standalone computing, FATE's OSX federation engine; fate_rdma_lab.eval.fate_party)
and runs the FedAvg secure-aggregation rounds of `fate-rdma bench fate` (fate_rdma_lab.bench.fate_job,
the same names and payloads as FATE's SecureAggregatorClient/Server): per round each client puts its
mixed float64 weights (16 bytes a parameter) to the arbiter and gets the float64 average back.

FATE's cross-site path is its OSX engine talking to the project's OSX-compatible queue
(fate_rdma_lab.bench.osx_queue: one process in site a beside the arbiter; NOT a real OSX/rollsite
deployment, which would have one OSX per site forwarding to the next). The clients' pushes and pops
cross their own links and the arbiter's; the arbiter reaches the queue inside site a. Methods, in
this order, the same payload on the same link in one run:
  fate        FATE's OSX engine: FATE's serializer, the payload as one message through the queue
              (max_message_size raised: FATE's slicing into a table fails on standalone computing)
  fedrdma-e   fate-rdma wrapping the same OSX federation: payloads party to party over the
  fedrdma     channel (soft provider = verbs emulated over TCP, not RDMA); with the job's secret,
              descriptors: channel (the default then): what each get waits for rides the channel too, and
              nothing of the job goes through the queue
Every link has the given rate, RTT/2 of one-way delay and loss; the two clients' uploads share the
arbiter's link. A fresh queue per method (its counters say what went through it). Before each job,
one untimed warm-up exchange (1 MiB each way between each client and the arbiter, every method
alike: fate-rdma's connections open there, as FATE's gRPC channel to the queue opens in the job's DH
exchange); link and queue counters are read after it, so they count the job only.

Per method: communication per round (from the job's records: the slower client, from a barrier until
it holds the unpickled average, less the arbiter's summing time; median over rounds), each party's
peak RSS, bytes that crossed the links (router counters: up and down per site), bytes through the
queue, and verified (the job's own checks: the average is what it must be, both clients hold the same
digest; and the payload took the path the method names). Ratio FATE / fate-rdma per mode.

Writes OUT/<UTC time>-fate/: results.jsonl, table.md, fate_path.png; parties/<method>/<role>.json.

`--job train` (Figure 7): the same sites, queue, warm-up and methods, but each party runs the real
GPT-2 LoRA FedAvg training of fate_rdma_lab.llm.gpt2_fedavg (FATE-LLM's Seq2SeqFedAVGClient/Server,
FATE's secure aggregation; `--model gpt2|tiny`, `--lora-rank`, `--rounds`, `--steps-per-round`; CPU).
Per method and round: compute (the slower client's local steps) and comm (the smaller of the two
clients' aggregation-call times) exactly as `fate-rdma sweep lora` defines them (sweep.round_rows),
the training loss, and per method a median row with each party's peak RSS, the link and queue bytes
and the verification (both clients on the same weights, every method on the weights FATE's own path
gave, the payload on the method's path). fate-rdma's threshold is the sweep's 16 KiB, so the tiny
model's payload takes the channel too. Writes OUT/<UTC time>-fate-train/: results.jsonl (rows
"round" and "median"), table.md, fate_train_rounds.png (stacked compute / comm bars per round).
"""
from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from fate_rdma_lab.testbed import bed as wan
from fate_rdma_lab.eval.common import SOFT, Rows, bars, header, link_line, machine, md_table, median
from fate_rdma_lab.testbed.run import SiteProcess

MiB = 1 << 20
METHODS = ("fate", "fedrdma-e", "fedrdma")
JOBS = ("payload", "train")
#: role -> site index; the queue runs in the arbiter's site
SITES = {"arbiter": 0, "guest": 1, "host": 2}
QUEUE_SITE = 0
ENDPOINT_PORT = 18700      # each site is its own namespace: a fixed port per method cannot collide
QUEUE = "the project's OSX-compatible queue (fate_rdma_lab.bench.osx_queue), not a real OSX/rollsite deployment"
PATHS = {"fate": "FATE OSX engine: FATE's serializer, payload as one message through the queue",
         "fedrdma-e": "fate-rdma fedrdma-e: every object party to party (soft provider), descriptors: channel",
         "fedrdma": "fate-rdma fedrdma: every object party to party (soft provider), descriptors: channel"}


@dataclass(frozen=True)
class Plan:
    rate_mbit: float = 100.0
    rtt_ms: float = 20.0
    loss_pct: float = 0.0
    lora_rank: int = 16        # 0: GPT-2's full weights (use a small --scale)
    scale: float = 1.0
    rounds: int = 3
    methods: Tuple[str, ...] = METHODS
    measure_s: float = 2.0
    job: str = "payload"       # payload: fate_job's rounds (no training); train: gpt2_fedavg's training
    model: str = "gpt2"        # train job: gpt2 (124M) or tiny
    steps_per_round: int = 2   # train job: local optimizer steps per round
    device: str = "cpu"        # train job: cpu, or cuda (every party's training; the sites share the GPU)

    def with_(self, **kw: Any) -> "Plan":
        p = replace(self, **{k: v for k, v in kw.items() if v is not None})
        if p.rate_mbit <= 0 or p.rtt_ms < 0 or not 0 <= p.loss_pct < 100:
            raise ValueError("--rate-mbit must be positive, --rtt-ms >= 0, --loss-pct within [0, 100)")
        if p.rounds < 1 or p.lora_rank < 0 or not 0 < p.scale <= 1:
            raise ValueError("--rounds must be >= 1, --lora-rank >= 0 (0: full weights), --scale within (0, 1]")
        bad = [m for m in p.methods if m not in METHODS]
        if bad or not p.methods or "fate" not in p.methods:
            raise ValueError(f"--methods: fate and any of fedrdma-e, fedrdma (got {', '.join(p.methods) or 'none'})")
        if p.job not in JOBS:
            raise ValueError(f"--job: payload or train, not {p.job!r}")
        if p.job == "train" and (p.lora_rank < 1 or p.scale != 1 or p.model not in ("gpt2", "tiny")
                                 or p.steps_per_round < 1 or p.device not in ("cpu", "cuda")):
            raise ValueError("--job train: --lora-rank >= 1 (LoRA on c_attn; no full fine-tune through the sites), "
                             "no --scale, --model gpt2 or tiny, --steps-per-round >= 1, --device cpu or cuda")
        if p.job != "train" and p.device != "cpu":
            raise ValueError("--device belongs to --job train (the payload job trains nothing)")
        # FATE's own path first: it is the reference of the ratios and of the trained weights
        return replace(p, methods=tuple(m for m in METHODS if m in p.methods))

    @property
    def payload(self) -> str:
        if self.job == "train":
            model = "GPT-2 124M" if self.model == "gpt2" else "tiny GPT-2 (2 layers)"
            return f"{model} LoRA r={self.lora_rank} (c_attn), trained"
        what = f"GPT-2 LoRA r={self.lora_rank} (c_attn)" if self.lora_rank else "GPT-2 full weights"
        return what + (f" x {self.scale:g}" if self.scale < 1 else "")

    def client_bytes(self) -> Tuple[int, int]:
        """(up, down) bytes per client per round: mixed float64 (16 B a parameter) up, the average down."""
        if self.job == "train":
            from fate_rdma_lab.llm.gpt2_fedavg import SECAGG_DOWN_BYTES_PER_PARAM, SECAGG_UP_BYTES_PER_PARAM
            from fate_rdma_lab.llm.sweep import lora_params

            n = lora_params(self.model, self.lora_rank)
            return SECAGG_UP_BYTES_PER_PARAM * n, SECAGG_DOWN_BYTES_PER_PARAM * n
        from fate_rdma_lab.bench.fate_job import scaled_shapes

        n = 0
        for s in scaled_shapes(self.scale, self.lora_rank):
            k = 1
            for d in s:
                k *= d
            n += k
        return 16 * n, 8 * n


FULL = Plan()
QUICK = Plan(rate_mbit=50.0, rtt_ms=10.0, lora_rank=4, rounds=1, measure_s=1.0)


def make_testbed(plan: Plan, prefix: str) -> wan.Testbed:
    link = wan.LinkSpec(rate_bps=int(plan.rate_mbit * 1e6), delay_ms=plan.rtt_ms / 2, loss_pct=plan.loss_pct)
    return wan.Testbed(links=(link, link, link), prefix=prefix)


def link_bytes(tb: wan.Testbed) -> Dict[str, Dict[str, int]]:
    """Per site: bytes its link carried up (router received) and down (router sent)."""
    out = {}
    for i, name in enumerate(wan.SITE_NAMES[:len(tb.links)]):
        p = subprocess.run(["ip", "-n", tb.router, "-j", "-s", "link", "show", "dev", f"s-{name}"],
                           capture_output=True, text=True, timeout=10)
        if p.returncode != 0:
            raise wan.WanError(f"cannot read the counters of link s-{name}: {p.stderr.strip()}")
        st = json.loads(p.stdout)[0]["stats64"]
        out[name] = {"up": int(st["rx"]["bytes"]), "down": int(st["tx"]["bytes"])}
    return out


def section(tb: wan.Testbed, mode: str, plan: Plan, secret: str, port: int, timeout_s: float) -> Dict[str, Any]:
    """The fate_rdma section of every party: endpoints in the sites, soft provider over the link."""
    up, _ = plan.client_bytes()
    eps = {f"{role}:{'9999' if role == 'guest' else '10000'}": f"{tb.site_addr(site)}:{port}"
           for role, site in SITES.items()}
    # same_host false: else the soft provider copies between these processes of one machine and no
    # payload byte crosses the link; a slot takes one client's upload (what the bench sets too)
    # the train job's tiny model puts less than 1 MiB a round: the sweep's 16 KiB threshold still sends every
    # model-sized payload over the channel (FATE's small control messages stay on its path)
    threshold = MiB
    if plan.job == "train":
        from fate_rdma_lab.llm.sweep import DEFAULT_SECTION

        threshold = DEFAULT_SECTION["threshold_bytes"]
    return {"enabled": True, "threshold_bytes": threshold, "fallback": "error", "endpoints": eps, "mode": mode,
            "provider": "soft", "same_host": False, "secret_file": secret, "shared_secret_only": True, "window": "auto",
            "link_rate_bps": plan.rate_mbit * 1e6, "slot_bytes": up + 16 * MiB, "too_large": "fedrdma",
            "pull_timeout_s": timeout_s, "get_timeout_s": timeout_s, "connect_timeout_s": 30.0}


def run_method(tb: wan.Testbed, method: str, plan: Plan, secret: str, folder: Path, timeout_s: float,
               n: int) -> Dict[str, Any]:
    """One three-party job; {"parties": {role: record}, "queue": counters, "link": before/after}."""
    out = folder / "parties" / method
    out.mkdir(parents=True, exist_ok=True)
    sec = None if method == "fate" else section(tb, method, plan, secret, ENDPOINT_PORT + n, timeout_s)
    data_dir = tempfile.mkdtemp(prefix="fate-rdma-eval-fate-")
    try:
        with SiteProcess(tb, QUEUE_SITE, ["--host", tb.site_addr(QUEUE_SITE), "--deadline-s", str(timeout_s + 120)],
                         module="fate_rdma_lab.bench.osx_queue") as queue:
            addr = queue.line(60)["address"]
            fed_id = f"evalfate_{method.replace('-', '')}_{os.getpid()}_{int(time.time())}"
            common = ["--fed-id", fed_id, "--data-dir", data_dir, "--osx", addr, "--section", json.dumps(sec),
                      "--out", str(out), "--rounds", str(plan.rounds), "--scale", str(plan.scale),
                      "--lora-rank", str(plan.lora_rank), "--deadline-s", str(timeout_s), "--job", plan.job,
                      "--model", plan.model, "--steps-per-round", str(plan.steps_per_round), "--device", plan.device]
            procs = {role: SiteProcess(tb, site, [role, *common], module="fate_rdma_lab.eval.fate_party")
                     for role, site in SITES.items()}
            deadline = time.monotonic() + timeout_s + 30
            try:
                next_lines(procs, deadline)  # all warm: the job's counters start here
                before, queued = link_bytes(tb), _queue_stats(queue)
                for p in procs.values():
                    tell(p, "go")
                done = next_lines(procs, deadline)
            finally:
                for p in procs.values():  # on a failure: the others are stopped now, not left waiting
                    p.close(timeout_s=5.0)
            after, counters = link_bytes(tb), _queue_stats(queue)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    crossed = {s: {k: after[s][k] - before[s][k] for k in ("up", "down")} for s in after}
    counters = {k: v - queued.get(k, 0) if k != "queued_messages" else v for k, v in counters.items()}
    parties = {role: json.loads((out / f"{role}.json").read_text()) for role in SITES}
    return {"parties": parties, "queue": counters, "link_bytes": crossed, "federation": done["guest"]["federation"]}


def next_lines(procs: Dict[str, SiteProcess], deadline: float) -> Dict[str, Dict[str, Any]]:
    """The next JSON line of every party, in the order they come: the first error (WanError) is raised
    at once, not after the parties before it in the list have timed out waiting for the failed one."""
    pending, got = dict(procs), {}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise wan.WanError(f"no answer from {', '.join(pending)} by the deadline")
        ready, _, _ = select.select([p.stdout for p in pending.values()], [], [], min(left, 1.0))
        for role, p in list(pending.items()):
            if p.stdout in ready:  # each party writes whole lines, one per phase
                got[role] = p.line(max(1.0, deadline - time.monotonic()))
                del pending[role]
    return got


def tell(proc: SiteProcess, line: str) -> None:
    proc.stdin.write(line.encode() + b"\n")
    proc.stdin.flush()


def _queue_stats(queue: SiteProcess) -> Dict[str, int]:
    tell(queue, "stats")
    return queue.line(30)


def link_bound(plan: Plan) -> float:
    """A lower bound of the round the link allows: both clients' uploads share the arbiter's link, then
    both downloads do (the average needs every upload), at the shaped rate (headers not counted)."""
    up, down = plan.client_bytes()
    return 2 * (up + down) * 8 / (plan.rate_mbit * 1e6)


def path_failures(method: str, got: Dict[str, Any], plan: Plan, crossed: int) -> List[str]:
    """Whether the payload took the method's path: every client's upload and download crossed the links;
    with FATE all of it went through the queue; with fate-rdma it took the channel (2 uploads and 2
    downloads a round and in the warm-up, none fell back to FATE) and only small objects went through the
    queue."""
    up, down = plan.client_bytes()
    payload_total = plan.rounds * 2 * (up + down)
    failures = []
    if crossed < payload_total:
        failures.append(f"only {crossed} B crossed the links for {payload_total} B of payload")
    if method == "fate":
        if got["queue"]["pushed_bytes"] < payload_total:
            failures.append(f"only {got['queue']['pushed_bytes']} B went through the queue for {payload_total} B")
        return failures
    rdma = [got["parties"][r].get("rdma") or {} for r in SITES]
    transfers = sum(s.get("rdma_transfers", 0) for s in rdma)
    fallbacks = sum(s.get("fate_fallbacks", 0) for s in rdma)
    want = 4 * (plan.rounds + 1)
    if transfers != want or fallbacks:
        failures.append(f"{transfers} channel transfers, {fallbacks} fell back to FATE (want {want}, 0)")
    if got["queue"]["pushed_bytes"] >= up:
        failures.append(f"{got['queue']['pushed_bytes']} B went through the queue: the payload did not take "
                        f"the channel")
    if "wrapped by fate-rdma" not in got["federation"]:
        failures.append(got["federation"])
    return failures


def make_row(method: str, got: Dict[str, Any], plan: Plan, measured: Dict[str, Any], tb: wan.Testbed) -> Dict[str, Any]:
    p = got["parties"]
    g, h = p["guest"], p["host"]
    per_round = [max(x, y) for x, y in zip(g["comm_seconds"], h["comm_seconds"])]  # the slower client
    up, down = plan.client_bytes()
    crossed = sum(v["up"] for v in got["link_bytes"].values())  # each packet between sites: once up
    rdma = {r: p[r].get("rdma") or {} for r in SITES}
    failures = [f"{r}: the job's check of the average failed" for r in ("guest", "host") if not p[r]["verified"]]
    failures += path_failures(method, got, plan, crossed)
    return {
        "study": "fate", "method": method, "path": PATHS[method], "machine": machine(),
        "provider": SOFT if method != "fate" else "FATE OSX engine through " + QUEUE,
        "emulated": bool(g.get("emulated")), "label": g.get("label"), "federation": got["federation"],
        "sites": {role: wan.SITE_NAMES[s] for role, s in SITES.items()}, "queue_site": wan.SITE_NAMES[QUEUE_SITE],
        "payload": plan.payload, "lora_rank": plan.lora_rank, "scale": plan.scale, "params": g["params"],
        "tensors": g["tensors"], "up_bytes": up, "down_bytes": down, "rounds": plan.rounds,
        "round_comm_seconds": median(per_round), "round_comm_seconds_all": per_round,
        "link_bound_seconds": link_bound(plan),
        "peak_rss_bytes": {r: p[r]["peak_rss_bytes"] for r in SITES},
        "aggregate_seconds": median(p["arbiter"]["aggregate_seconds"]),
        "link_bytes": got["link_bytes"], "link_bytes_total": crossed, "queue": got["queue"],
        # fate-rdma's counters cover the whole job, the warm-up exchange included
        "rdma": {r: {k: s.get(k) for k in ("rdma_transfers", "rdma_bytes", "fate_fallbacks")} for r, s in rdma.items()}
        if method != "fate" else None,
        "verified": not failures, "failures": failures, "measured": measured, "note": wan.testbed_note(tb, (1, 0)),
        "link": {"rate_mbit": plan.rate_mbit, "rtt_ms": plan.rtt_ms, "loss_pct": plan.loss_pct},
    }




def ratios(rows: Rows) -> None:
    fate = next((r for r in rows.rows if r["method"] == "fate"), None)
    for r in [r for r in rows.rows if r["method"] != "fate"]:
        if fate and r["round_comm_seconds"]:
            rows.add({"study": "fate", "row": "ratio", "method": r["method"], "payload": r["payload"],
                      "fate_over_fate_rdma": fate["round_comm_seconds"] / r["round_comm_seconds"],
                      "emulated": r["emulated"], "link": r["link"], "measured": r["measured"], "machine": r["machine"],
                      "verified": fate["verified"] and r["verified"], "failures": []})


def _mib(n: float) -> str:
    return f"{n / MiB:.1f}"


def _bytes(n: int) -> str:
    return f"{n / MiB:.1f} MiB" if n >= MiB else f"{n / 1024:.1f} KiB"


def setup_lines(plan: Plan, runs: Sequence[Dict[str, Any]]) -> List[str]:
    """The header lines both jobs' tables share: providers, sites, the link as shaped and as measured."""
    m = runs[0]["measured"] if runs else {}
    return [
        f"provider: fate-rdma over the {SOFT}; FATE: its OSX engine through {QUEUE}, running in site a",
        "sites: arbiter in a (198.18.1.2, beside the queue), guest in b (198.18.2.2), host in c (198.18.3.2); "
        "one process per party (`ip netns exec`), each building its own FATE Context (standalone computing)",
        f"link: every site {plan.rate_mbit:g} Mbit/s, {plan.rtt_ms:g} ms RTT between sites, loss {plan.loss_pct:g} %; "
        f"{link_line(m) if m else ''} (guest b -> arbiter a); {runs[0]['note'] if runs else ''}"]


def markdown(rows: Sequence[Dict[str, Any]], plan: Plan, command: str, failed: Sequence[str]) -> List[str]:
    runs = [r for r in rows if r.get("row") != "ratio"]
    up, down = plan.client_bytes()
    lines = header("fate-rdma eval fate: FATE's own federation path on the testbed", command, [
        *setup_lines(plan, runs), f"payload: {plan.payload}, {up / MiB:.1f} MiB up (mixed float64) / {down / MiB:.1f} MiB down per client per "
        f"round, FATE's secure aggregation (fate_rdma_lab.bench.fate_job); {plan.rounds} round(s); figures are medians",
        "per round: the slower client, from a barrier until it holds the unpickled average, less the arbiter's "
        "summing time; crossed links: sum over sites of the bytes each link carried up (router counters); "
        "before the job, one untimed 1 MiB warm-up exchange each way per client (not counted), so that fate-rdma's "
        "connections (connect, authentication, RTT probe) are open, as FATE's gRPC channel to the queue is",
        "verified: the job's own checks (the average is what it must be; both clients hold the same digest) and the "
        "payload took the method's path (through the queue, or the channel with at most descriptors in the queue)"])
    fate = next((r for r in runs if r["method"] == "fate"), None)
    cells = []
    for r in runs:
        rss = r["peak_rss_bytes"]
        ratio = (f"{fate['round_comm_seconds'] / r['round_comm_seconds']:.2f}" if fate and r is not fate else "1")
        cells.append([r["method"], r["path"], f"{r['round_comm_seconds']:.3f}",
                      " / ".join(f"{x:.3f}" for x in r["round_comm_seconds_all"]), ratio,
                      f"{_mib(rss['guest'])} / {_mib(rss['host'])} / {_mib(rss['arbiter'])}",
                      _mib(r["link_bytes_total"]), _bytes(r["queue"]["pushed_bytes"]),
                      "verified" if r["verified"] else "FAILED: " + "; ".join(r["failures"])])
    lines += md_table(["method", "path of the payload", "per round s (median)", "rounds s", "FATE / this",
                       "peak RSS MiB guest / host / arbiter", "MiB crossed links", "through the queue",
                       "verification"], cells)
    if runs and runs[0].get("link_bound_seconds"):
        lines.append(f"Link-bound round: {runs[0]['link_bound_seconds']:.3f} s (both clients' uploads, then both "
                     f"downloads, through the arbiter's link at the shaped {plan.rate_mbit:g} Mbit/s, headers not "
                     f"counted: no method can be faster).")
        lines.append("")
    lines += [f"FAILED: {f}" for f in failed]
    for r in rows:
        if r.get("row") == "ratio":
            lines.append(f"- FATE / fate-rdma {r['method']}: **{r['fate_over_fate_rdma']:.2f} x** less communication "
                         f"per round with fate-rdma ({plan.payload}, {plan.rate_mbit:g} Mbit/s, {plan.rtt_ms:g} ms; "
                         f"soft provider = emulation, not RDMA)")
    return lines + [""]


def write_plot(rows: Sequence[Dict[str, Any]], path: Path) -> Optional[Path]:
    runs = [r for r in rows if r.get("row") != "ratio"]
    if not runs:
        return None
    names = [r["method"] for r in runs]
    series = {"median": [r["round_comm_seconds"] for r in runs],
              "slowest round": [max(r["round_comm_seconds_all"]) for r in runs]}
    link = runs[0]["link"]
    title = (f"communication per FedAvg round, {runs[0]['payload']}, {link['rate_mbit']:g} Mbit/s x "
             f"{link['rtt_ms']:g} ms, {runs[0]['rounds']} round(s)")
    bound = runs[0].get("link_bound_seconds")
    return bars(path, [(title, names, series)], "seconds",
                "real packets, scaled rate; soft provider = emulation, not RDMA; FATE: OSX engine, test queue",
                hline=("link-bound round", bound) if bound else None)


# ---- --job train: gpt2_fedavg's training rounds (Figure 7) --------------------------------------------
