"""`fate-rdma sweep lora`: GPT-2 LoRA FedAvg with training at each LoRA rank (gpt2_fedavg.py, one job a
rank), through fate-rdma and optionally through FATE's own federation; rows, a table and a plot, and
a results folder that a later run can resume. See fate_rdma_lab/cli/sweep.py for the user's view.

Figures per round, from the parties' records (gpt2_fedavg.py):
- loss: each client's training loss, the mean over the round's local steps before the average.
- compute: from the round's start to the client's aggregation call (its local steps); the round's
  compute is the slower client's.
- comm: time in FedAvg's aggregation call. The client that reaches it first also waits there for the
  other's steps, so the round's communication is the other one's: the smaller of the two, which is
  upload, the arbiter's sum and download with no one left to wait for.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict
from typing import AbstractSet, Any, Dict, List, Optional

from fate_rdma_lab.bench.local import PARTIES, local_endpoints, stop_group
from fate_rdma.errors import ConfigError
# the settings and rows (sweep_rows) and the report (sweep_report) live in their own modules; re-exported
# here for the callers that know them as sweep.*
from fate_rdma_lab.llm.sweep_report import describe, markdown, summary, write_outputs, write_plot  # noqa: F401
from fate_rdma_lab.llm.sweep_rows import (DEFAULT_RANKS, DEFAULT_SECTION, EMULATION, FIXED, LINK, LOSS_KIND,  # noqa: F401
                                          ROLES, Settings, append_rows, complete, latest_runs, machine, read_meta,
                                          read_rows, utc_stamp)

#: the fate-rdma wrapper's timers (fate_rdma/federation/wrapper.py), in the order a round meets them
RDMA_TIMERS = ("frame_seconds", "send_seconds", "descriptor_push_seconds", "descriptor_wait_seconds",
               "payload_wait_seconds")
JOB_SCRIPT = "from fate_rdma_lab.llm.gpt2_fedavg import main\n\nif __name__ == '__main__':\n    main()\n"
LOG_TAIL_CHARS = 1500


class SweepError(ConfigError):
    """The sweep cannot start as asked (bad options, a folder that does not fit): the caller's fault."""






def parse_ranks(text: str) -> List[int]:
    try:
        ranks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SweepError(f"--ranks wants a comma list of integers, got {text!r}") from None
    if not ranks or min(ranks) < 1:
        raise SweepError(f"--ranks wants positive LoRA ranks, got {text!r}")
    return ranks






# ---- the results folder ------------------------------------------------------------------------------









# ---- one job ----------------------------------------------------------------------------------------

#: (layers, width) of the two models; peft LoRA on c_attn adds lora_A (r x d) and lora_B (3d x r) a layer
MODEL_SHAPES = {"gpt2": (12, 768), "tiny": (2, 128)}
#: peak RSS of one party before its payloads, measured here with rank 4 (the client trains GPT-2 124M)
BASE_RSS_BYTES = {"gpt2": int(1.7 * 2**30), "tiny": int(0.9 * 2**30)}


def lora_params(model: str, rank: int) -> int:
    layers, d = MODEL_SHAPES[model]
    return layers * 4 * d * rank


def fate_path_fits(model: str, rank: int) -> Optional[str]:
    """None, or why FATE's own path would not fit in this machine's free memory: it peaks near
    FATE_MEM_PER_UPLOAD_BYTE per byte of one client's upload across the three parties (bench fate)."""
    from fate_rdma_lab.bench.fate_federation import FATE_MEM_PER_UPLOAD_BYTE, _available_bytes

    need = FATE_MEM_PER_UPLOAD_BYTE * 16 * lora_params(model, rank) + 3 * BASE_RSS_BYTES[model]
    have = _available_bytes() * 0.85  # leave room for whatever else runs here
    if need <= have:
        return None
    return (f"not run: FATE's own path needs about {need / 2**30:.1f} GiB for this rank, "
            f"{have / 2**30:.1f} GiB is free here (85 % of MemAvailable)")


def job_command(s: Settings, rank: int, transport: str, job_dir: str, script: str, fail: bool) -> List[str]:
    cmd = [sys.executable]
    if transport == "fate-rdma":
        conf = os.path.join(job_dir, "fate_rdma.json")
        with open(conf, "w") as f:
            json.dump({"fate_rdma": {**s.section, "provider": s.provider, "endpoints": local_endpoints()}}, f, indent=1)
        cmd += ["-m", "fate_rdma.cli", "launch", "--conf", conf]
    cmd += [script, "--parties", *PARTIES, "--log_level", "WARNING", "--model", s.model, "--lora_rank", str(rank),
            "--rounds", "x" if fail else str(s.rounds), "--steps_per_round", str(s.steps_per_round),
            "--batch_size", str(s.batch_size), "--seq_len", str(s.seq_len), "--threads", str(s.threads),
            "--device", s.device, "--out", job_dir]
    return cmd


def run_job(cmd: List[str], cwd: str, log_path: str, timeout_s: float) -> Dict[str, Any]:
    """Run one launcher job in its own process group, output to `log_path`; the whole group is killed
    when it overruns or the sweep is interrupted (the launcher's parties would outlive it otherwise)."""
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        # FATE_RDMA_CONF would switch fate-rdma on in a job meant for FATE's own federation; launch sets it
        env = {k: v for k, v in os.environ.items() if k != "FATE_RDMA_CONF"}
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True)
        timed_out = False
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        except BaseException:
            stop_group(p)
            raise
        if timed_out:
            stop_group(p)
    return {"returncode": p.returncode, "timed_out": timed_out, "seconds": time.monotonic() - t0}


def log_tail(path: str, chars: int = LOG_TAIL_CHARS) -> tuple:
    """(the log line that most likely says what went wrong, the log's last `chars` characters)."""
    try:
        with open(path, errors="replace") as f:
            raw = f.read().splitlines()[1:]  # not the command line
    except OSError:
        return "", ""
    lines, skip = [], False
    for line in raw:
        if skip and line.startswith(" "):  # the source line Python's warnings print under a warning
            continue
        skip = bool(re.search(r"\w+Warning: ", line))
        if skip or line.startswith("{'"):  # warnings, and the Trainer's loss logs
            continue
        line = line.strip(" │╭╰╮╯─")  # rich's traceback panels lose their frames
        if line:
            lines.append(line)
    said = [line for line in lines if "Error" in line or "error:" in line or "Exception" in line]
    return (said or lines or [""])[-1][:300], "\n".join(lines)[-chars:]


def round_rows(res: Dict[str, Dict[str, Any]], common: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One row per round from the three parties' records."""
    g, h, a = res["guest"], res["host"], res["arbiter"]
    rounds = len(g["comm_seconds"])
    rdma = g.get("rdma")
    rows = []
    for i in range(rounds):
        comm = (g["comm_seconds"][i], h["comm_seconds"][i])
        compute = (g["compute_seconds"][i], h["compute_seconds"][i])
        loss = (g["train_loss"][i] if i < len(g["train_loss"]) else None,
                h["train_loss"][i] if i < len(h["train_loss"]) else None)
        rows.append({
            **common, "status": "ok", "round": i + 1, "rounds": rounds,
            "trainable_params": g["trainable_params"], "up_bytes": g["up_bytes"], "down_bytes": g["down_bytes"],
            # bytes that crossed the channel, per client and round (pickled, so a little over up_bytes)
            "channel_up_bytes": round(rdma["rdma_bytes"] / rounds) if rdma else None,
            "channel_down_bytes": round(a["rdma"]["rdma_bytes"] / rounds / 2) if a.get("rdma") else None,
            "loss_guest": loss[0], "loss_host": loss[1],
            "loss": (loss[0] + loss[1]) / 2 if loss[0] is not None and loss[1] is not None else None,
            "comm_seconds_guest": comm[0], "comm_seconds_host": comm[1], "comm_seconds": min(comm),
            "compute_seconds_guest": compute[0], "compute_seconds_host": compute[1], "compute_seconds": max(compute),
            "round_seconds": max(g["round_seconds"][i], h["round_seconds"][i]) if i < len(g["round_seconds"]) else None,
            "peak_rss_bytes": {r: res[r]["peak_rss_bytes"] for r in ROLES},
            # where fate-rdma's puts and gets went, per party (the job's totals / rounds; waits include the others)
            "rdma_timers": ({r: {k: res[r]["rdma"].get(k, 0.0) / rounds for k in RDMA_TIMERS} for r in ROLES}
                            if rdma else None),
            "provider": g["label"], "emulated": "emulated" in g["label"], "device": g["device"],
            "device_name": g.get("device_name"), "clients_same_weights": g["sha256"] == h["sha256"],
        })
    return rows


def run_rank(s: Settings, folder: str, rank: int, transport: str, timeout_s: float, fail: bool) -> List[Dict[str, Any]]:
    folder = os.path.abspath(folder)  # the job runs in its own folder
    job_dir = os.path.join(folder, f"rank-{rank:04d}", transport)
    os.makedirs(job_dir, exist_ok=True)
    for role in ROLES:  # a retried rank must not read the failed try's records
        try:
            os.remove(os.path.join(job_dir, f"{role}.json"))
        except FileNotFoundError:
            pass
    common = {"sweep": "lora", "rank": rank, "transport": transport, "run_id": utc_stamp(micro=True), "model": s.model,
              "steps_per_round": s.steps_per_round, "batch_size": s.batch_size, "seq_len": s.seq_len,
              "threads": s.threads, "machine": machine(), "link": LINK, "loss_kind": LOSS_KIND,
              "mode": s.section.get("mode") if transport == "fate-rdma" else "fate standalone federation",
              "loadavg_1m": round(os.getloadavg()[0], 2)}
    log_path = os.path.join(job_dir, "job.log")
    too_big = fate_path_fits(s.model, rank) if transport == "fate" else None
    if too_big:
        return [{**common, "status": "failed", "round": None, "error": too_big, "log": None, "provider": None}]
    cmd = job_command(s, rank, transport, job_dir, os.path.join(folder, "job.py"), fail)
    outcome = run_job(cmd, job_dir, log_path, timeout_s)
    common["job_seconds"] = round(outcome["seconds"], 1)
    res = {}
    for role in ROLES:
        path = os.path.join(job_dir, f"{role}.json")
        if os.path.exists(path):
            with open(path) as f:
                res[role] = json.load(f)
    error = None
    if outcome["timed_out"]:
        error = f"the job overran --timeout-s {timeout_s:g} and was stopped"
    elif outcome["returncode"] != 0:
        error = f"the job exited with status {outcome['returncode']} after {outcome['seconds']:.0f} s"
    elif len(res) != len(ROLES):
        error = f"the job ended without the records of {', '.join(r for r in ROLES if r not in res)}"
    else:
        try:
            rows = round_rows(res, common)
        except (KeyError, IndexError, TypeError) as exc:
            error = f"the parties' records are incomplete: {type(exc).__name__}: {exc}"
        else:
            if len(rows) != s.rounds or not rows[0]["clients_same_weights"]:
                error = (f"{len(rows)} rounds recorded, {s.rounds} asked" if len(rows) != s.rounds
                         else "guest and host ended on different weights after FedAvg")
            else:
                return rows
    said, tail = log_tail(log_path)
    if said and not outcome["timed_out"]:  # a job stopped midway logs no cause
        error += f": {said}"
    return [{**common, "status": "failed", "round": None, "error": error,
             "log": os.path.relpath(log_path, folder), "log_tail": tail, "provider": None}]


# ---- the sweep --------------------------------------------------------------------------------------

def sweep(s: Settings, folder: str, timeout_s: float, fail: AbstractSet[int] = frozenset(), command: str = "") -> int:
    """Run the (rank, transport) jobs of `s` that `folder` does not hold complete; 1 if one failed."""
    saved_meta = read_meta(folder) or {}
    # the folder's table covers every rank ever asked of it; this run runs the ranks of `s`
    asked = set(s.ranks) | set(saved_meta.get("settings", {}).get("ranks", []))
    table = Settings(**{**asdict(s), "ranks": sorted(asked)})
    with open(os.path.join(folder, "sweep.json"), "w") as f:
        json.dump({"settings": asdict(table), "machine": saved_meta.get("machine", machine()), "link": LINK,
                   "commands": saved_meta.get("commands", []) + [command]}, f, indent=1)
    with open(os.path.join(folder, "job.py"), "w") as f:
        f.write(JOB_SCRIPT)
    done = complete(read_rows(folder), s.rounds)
    todo = [(r, t) for r in s.ranks for t in s.transports() if (r, t) not in done]
    skipped = [(r, t) for r in s.ranks for t in s.transports() if (r, t) in done]
    print(f"sweep lora: {folder}: {len(todo)} job(s) to run" + (f", {len(skipped)} complete there (skipped: "
          f"{', '.join(f'r={r} {t}' for r, t in skipped)})" if skipped else "") +
          f"; {s.model}, {s.rounds} rounds x {s.steps_per_round} steps, {s.device}; {LINK}", flush=True)
    failed = 0
    try:
        for rank, transport in todo:
            rows = run_rank(s, folder, rank, transport, timeout_s, rank in fail)
            append_rows(folder, rows)
            failed += rows[0]["status"] != "ok"
            print(describe(rows), flush=True)
            write_outputs(folder, table)
    except KeyboardInterrupt:  # the running job's processes are gone (run_job); what finished is kept
        print(f"sweep lora: interrupted; continue with --resume {folder}", file=sys.stderr)
        write_outputs(folder, table)
        return 130
    table_path, png = write_outputs(folder, table)
    print(f"sweep lora: table {table_path}" + (f", plot {png}" if png else "") + f", rows {folder}/results.jsonl")
    return 1 if failed else 0




