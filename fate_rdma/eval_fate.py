"""`fate-rdma eval fate`: FATE's own federation path beside fate-rdma, on the same WAN-testbed link.

Three sites, one party each: the arbiter in site a (198.18.1.2), the guest in site b (198.18.2.2), the
host in site c (198.18.3.2). Each party is its own process started with `ip netns exec`, builds its
FATE Context directly (standalone computing, FATE's OSX federation engine; fate_rdma.eval_fate_party)
and runs the FedAvg secure-aggregation rounds of `fate-rdma bench fate` (fate_rdma.bench.fate_job,
the same names and payloads as FATE's SecureAggregatorClient/Server): per round each client puts its
mixed float64 weights (16 bytes a parameter) to the arbiter and gets the float64 average back.

FATE's cross-site path is its OSX engine talking to the project's OSX-compatible queue
(fate_rdma.bench.osx_queue: one process in site a beside the arbiter; NOT a real OSX/rollsite
deployment, which would have one OSX per site forwarding to the next). The clients' pushes and pops
cross their own links and the arbiter's; the arbiter reaches the queue inside site a. Methods, in
this order, the same payload on the same link in one run:
  fate        FATE's OSX engine: FATE's serializer, the payload as one message through the queue
              (max_message_size raised: FATE's slicing into a table fails on standalone computing)
  fedrdma-e   fate-rdma wrapping the same OSX federation: payloads >= 1 MiB party to party over the
  fedrdma     channel (soft provider = verbs emulated over TCP, not RDMA), descriptors through the queue
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
GPT-2 LoRA FedAvg training of fate_rdma.llm.gpt2_fedavg (FATE-LLM's Seq2SeqFedAVGClient/Server,
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
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import wan
from .eval_common import SOFT, Rows, bars, header, link_line, machine, md_table, measured_link, median, print_md, \
    pyplot, results_dir, secret_file, testbed
from .wan_run import SiteProcess

MiB = 1 << 20
METHODS = ("fate", "fedrdma-e", "fedrdma")
JOBS = ("payload", "train")
#: role -> site index; the queue runs in the arbiter's site
SITES = {"arbiter": 0, "guest": 1, "host": 2}
QUEUE_SITE = 0
ENDPOINT_PORT = 18700      # each site is its own namespace: a fixed port per method cannot collide
QUEUE = "the project's OSX-compatible queue (fate_rdma.bench.osx_queue), not a real OSX/rollsite deployment"
PATHS = {"fate": "FATE OSX engine: FATE's serializer, payload as one message through the queue",
         "fedrdma-e": "fate-rdma fedrdma-e: payload party to party (soft provider), descriptor through the queue",
         "fedrdma": "fate-rdma fedrdma: payload party to party (soft provider), descriptor through the queue"}


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
                                 or p.steps_per_round < 1):
            raise ValueError("--job train: --lora-rank >= 1 (LoRA on c_attn; no full fine-tune through the sites), "
                             "no --scale, --model gpt2 or tiny, --steps-per-round >= 1")
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
            from .llm.gpt2_fedavg import SECAGG_DOWN_BYTES_PER_PARAM, SECAGG_UP_BYTES_PER_PARAM
            from .llm.sweep import lora_params

            n = lora_params(self.model, self.lora_rank)
            return SECAGG_UP_BYTES_PER_PARAM * n, SECAGG_DOWN_BYTES_PER_PARAM * n
        from .bench.fate_job import scaled_shapes

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
        from .llm.sweep import DEFAULT_SECTION

        threshold = DEFAULT_SECTION["threshold_bytes"]
    return {"enabled": True, "threshold_bytes": threshold, "fallback": "error", "endpoints": eps, "mode": mode,
            "provider": "soft", "same_host": False, "secret_file": secret, "window": "auto",
            "link_rate_bps": plan.rate_mbit * 1e6, "slot_bytes": up + 16 * MiB, "too_large": "fedrdma",
            "pull_timeout_s": timeout_s, "connect_timeout_s": 30.0}


def run_method(tb: wan.Testbed, method: str, plan: Plan, secret: str, folder: Path, timeout_s: float,
               n: int) -> Dict[str, Any]:
    """One three-party job; {"parties": {role: record}, "queue": counters, "link": before/after}."""
    out = folder / "parties" / method
    out.mkdir(parents=True, exist_ok=True)
    sec = None if method == "fate" else section(tb, method, plan, secret, ENDPOINT_PORT + n, timeout_s)
    data_dir = tempfile.mkdtemp(prefix="fate-rdma-eval-fate-")
    try:
        with SiteProcess(tb, QUEUE_SITE, ["--host", tb.site_addr(QUEUE_SITE), "--deadline-s", str(timeout_s + 120)],
                         module="fate_rdma.bench.osx_queue") as queue:
            addr = queue.line(60)["address"]
            fed_id = f"evalfate_{method.replace('-', '')}_{os.getpid()}_{int(time.time())}"
            common = ["--fed-id", fed_id, "--data-dir", data_dir, "--osx", addr, "--section", json.dumps(sec),
                      "--out", str(out), "--rounds", str(plan.rounds), "--scale", str(plan.scale),
                      "--lora-rank", str(plan.lora_rank), "--deadline-s", str(timeout_s), "--job", plan.job,
                      "--model", plan.model, "--steps-per-round", str(plan.steps_per_round)]
            procs = {role: SiteProcess(tb, site, [role, *common], module="fate_rdma.eval_fate_party")
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
        ready, _, _ = select.select([p.proc.stdout for p in pending.values()], [], [], min(left, 1.0))
        for role, p in list(pending.items()):
            if p.proc.stdout in ready:  # each party writes whole lines, one per phase
                got[role] = p.line(max(1.0, deadline - time.monotonic()))
                del pending[role]
    return got


def tell(proc: SiteProcess, line: str) -> None:
    proc.proc.stdin.write(line.encode() + b"\n")  # type: ignore[union-attr]
    proc.proc.stdin.flush()  # type: ignore[union-attr]


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


def run_fate(plan: Plan, out_root: Path, prefix: str = "freval", timeout_s: float = 600.0,
             log: Callable[[str], None] = print, command: str = "") -> Path:
    """Every method of the plan on one testbed; returns the results folder. WanError (after writing
    it) if a method failed or was not verified."""
    train = plan.job == "train"
    out = results_dir(out_root, "fate-train" if train else "fate")
    rows = Rows(out)
    failed: List[str] = []
    try:
        # measured guest (b) -> arbiter (a): a client's upload path
        with secret_file() as secret, testbed(make_testbed(plan, prefix), plan.measure_s, log, src=1, dst=0) as bed:
            measured = measured_link(bed.measured)
            for n, method in enumerate(plan.methods):
                log(f"  {method}: {plan.payload}, {plan.rounds} round(s) ...")
                t0 = time.monotonic()
                try:
                    got = run_method(bed.tb, method, plan, secret, out, timeout_s, n)
                except (wan.WanError, OSError, ValueError, KeyError) as exc:
                    failed.append(f"{method}: {exc}")
                    log(f"  {method}: FAILED: {exc}")
                    continue
                if train:
                    made = [rows.add(x) for x in train_rows(method, got, plan, measured, bed.tb, fate_weights(rows))]
                    r = made[-1]
                    log(f"  {method}: per round (median of {plan.rounds}) compute {_sec(r['compute_seconds'])} s, "
                        f"comm {_sec(r['comm_seconds'])} s; loss at round {plan.rounds} {_loss(r)} (guest / host), "
                        f"{r['link_bytes_total'] / MiB:.1f} MiB crossed the links, "
                        f"{'verified' if r['verified'] else 'NOT verified: ' + '; '.join(r['failures'])} "
                        f"({time.monotonic() - t0:.0f} s)")
                    continue
                r = rows.add(make_row(method, got, plan, measured, bed.tb))
                log(f"  {method}: {r['round_comm_seconds']:.3f} s per round (median of {plan.rounds}), "
                    f"{r['link_bytes_total'] / MiB:.1f} MiB crossed the links, "
                    f"{'verified' if r['verified'] else 'NOT verified: ' + '; '.join(r['failures'])} "
                    f"({time.monotonic() - t0:.0f} s)")
            if not train:
                ratios(rows)
    finally:
        if train:
            lines = rows.save(out, train_markdown(rows.rows, plan, command, failed),
                              lambda: write_train_plot(rows.rows, plan, out / TRAIN_PNG))
        else:
            lines = rows.save(out, markdown(rows.rows, plan, command, failed),
                              lambda: write_plot(rows.rows, out / "fate_path.png"))
    print_md(lines, log, out)
    # a payload job's rows, a training job's median rows: one a method, with its verification
    bad = failed + [f"{r['method']}: {'; '.join(r['failures'])}" for r in rows.rows
                    if r.get("row") in (None, "median") and not r["verified"]]
    if bad:
        raise wan.WanError("; ".join(bad) + f" (results in {out})")
    return out


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
        f"round, FATE's secure aggregation (fate_rdma.bench.fate_job); {plan.rounds} round(s); figures are medians",
        "per round: the slower client, from a barrier until it holds the unpickled average, less the arbiter's "
        "summing time; crossed links: sum over sites of the bytes each link carried up (router counters); "
        "before the job, one untimed 1 MiB warm-up exchange each way per client (not counted), so that fate-rdma's "
        "connections (connect, authentication, RTT probe) are open, as FATE's gRPC channel to the queue is",
        "verified: the job's own checks (the average is what it must be; both clients hold the same digest) and the "
        "payload took the method's path (through the queue, or the channel with only descriptors in the queue)"])
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
    from .llm.sweep import round_rows

    p = got["parties"]
    g, h = p["guest"], p["host"]
    up, down = plan.client_bytes()
    crossed = sum(v["up"] for v in got["link_bytes"].values())  # each packet between sites: once up
    common = {"study": "fate-train", "job": "train", "method": method, "path": PATHS[method], "machine": machine(),
              "payload": plan.payload, "model": plan.model, "lora_rank": plan.lora_rank, "rounds_asked": plan.rounds,
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
    from .llm.sweep import LOSS_KIND

    meds = [r for r in rows if r.get("row") == "median"]
    up, down = plan.client_bytes()
    model = "GPT-2 124M (GPT2Config(), random init)" if plan.model == "gpt2" else "tiny GPT-2 (2 layers, n_embd 128)"
    loads = sorted({r["loadavg_1m"] for r in meds})
    lines = header("fate-rdma eval fate --job train: FedAvg training rounds through the testbed (Figure 7)", command, [
        *setup_lines(plan, meds),
        f"job: {model} + peft LoRA r={plan.lora_rank} on c_attn, FedAvg with FATE-LLM (Seq2SeqFedAVGClient/Server, "
        f"FATE's secure aggregation; fate_rdma.llm.gpt2_fedavg), {plan.rounds} round(s) x {plan.steps_per_round} "
        f"local steps of 2 x 48 tokens, CPU, 1 torch thread per party; load average (1 min) after each method "
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
    ax.set_title(f"{plan.payload}; {plan.steps_per_round} local steps a round, CPU\n{plan.rate_mbit:g} Mbit/s x "
                 f"{plan.rtt_ms:g} ms RTT testbed: real packets, scaled rate\nsoft provider = emulation, not RDMA; "
                 "FATE: OSX engine through the project's test queue, not a real OSX", fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
