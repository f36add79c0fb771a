"""One party of `fate-rdma eval fate`, run in its testbed site (`ip netns exec <site> python -m
fate_rdma_lab.eval.fate_party ROLE ...`).

It builds its FATE Context directly, as FATE's launcher does for a cluster context: standalone
computing, FATE's OSX federation engine pointed at the OSX-compatible queue (`--osx`), with fate-rdma
switched on when `--section` is given. Then it runs one job's `run(ctx)` unchanged (`--job`):
  payload  the FedAvg secure-aggregation rounds of `fate_rdma_lab.bench.fate_job` (no training)
  train    GPT-2 LoRA FedAvg training with FATE-LLM, `fate_rdma_lab.llm.gpt2_fedavg` (`--model`,
           `--steps-per-round`)
Both read their options (BenchArgs, JobArgs) from sys.argv with FATE's HfArgumentParser, so this
adapter sets sys.argv to them. The job writes `<out>/<role>.json`.

Before the job, one untimed warm-up exchange between each client and the arbiter (`warm_up`); then
the party prints {"warm": true} and waits for a line "go" on stdin. stdout carries JSON lines only
(what FATE, fate-rdma and libraries print goes to `<out>/<role>.log`): after "go", {"done": true,
...} once the job ran and the context was destroyed, or {"error": "..."} at any point. The process exits when its stdin
closes (a parent that dies takes it along) and, whatever happens, after --deadline-s (with an error
line, and every thread's stack in its log, so a hang says where it was).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import threading
from typing import Any, Dict, List, Optional, TextIO

#: the launcher's party list for guest + host + arbiter (ranks 0, 1, 2)
PARTIES = ("guest:9999", "host:10000", "arbiter:10000")
WARMUP_NAME = "eval_fate_warmup"
#: just above fate-rdma's 1 MiB threshold, so the warm-up takes the channel
WARMUP_ELEMENTS = (1 << 20) // 8 + 1024


_emit_lock = threading.Lock()


def _emit(out: TextIO, obj: Dict[str, Any]) -> None:
    with _emit_lock:
        out.write(json.dumps(obj) + "\n")
        out.flush()


def _stop_at_deadline(out: TextIO, role: str, deadline_s: float, log_path: str) -> None:
    """After deadline_s: say so on stdout, every thread's stack to the log, exit 124 (a hang ends here)."""
    def fire() -> None:
        _emit(out, {"error": f"{role}: no result within {deadline_s:g} s, stopped (stacks in {log_path})"})
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(124)

    t = threading.Timer(deadline_s, fire)
    t.daemon = True
    t.start()


def _watch_stdin() -> threading.Event:
    """An event set by a line "go" on stdin; the process exits when stdin closes."""
    go = threading.Event()

    def watch() -> None:
        try:
            for line in sys.stdin:
                if line.strip() == "go":
                    go.set()
        except (OSError, ValueError):
            pass
        os._exit(3)

    threading.Thread(target=watch, name="stdin-watch", daemon=True).start()
    return go


def warm_up(ctx: Any, role: str) -> None:
    """One untimed exchange of WARMUP_ELEMENTS float64 each way between each client and the arbiter,
    under a name the job does not use, for every method alike: fate-rdma opens its connections here
    (connect, authentication, RTT probe), as FATE's gRPC channel to the queue is opened by the job's
    DH exchange before its timed rounds."""
    import numpy as np

    blob = np.zeros(WARMUP_ELEMENTS)
    if role == "arbiter":
        clients = [ctx.guest.rank, *ctx.hosts.ranks]
        for r in clients:
            ctx.parties[r].get(WARMUP_NAME)
        for r in clients:
            ctx.parties[r].put(WARMUP_NAME, blob)
    else:
        ctx.arbiter.put(WARMUP_NAME, blob)
        ctx.arbiter.get(WARMUP_NAME)


def build_context(role: str, fed_id: str, data_dir: str, osx: str, max_message_bytes: int,
                  section: Optional[Dict[str, Any]]) -> Any:
    """FATE's Context for `role`: standalone computing, OSX federation (wrapped by fate-rdma if `section`)."""
    from fate.arch.computing.backends.standalone import CSession
    from fate.arch.context import Context
    from fate.arch.federation import FederationBuilder
    from fate.arch.launchers.argparser import get_parties

    if section is not None:
        from fate_rdma.federation import activate

        activate.install(section)
    parties = get_parties(list(PARTIES))
    party = next(p for p in parties if p[0] == role)
    cs = CSession(session_id=f"{fed_id}_{party[0]}_{party[1]}", data_dir=data_dir)
    host, _, port = osx.rpartition(":")
    # FATE slices a pickle above max_message_size into a table, which its OSX engine cannot push from
    # standalone computing (docs/fate.md, Engines): the payload goes as one message, up to gRPC's 2 GiB
    fed = FederationBuilder(federation_session_id=fed_id, party=party, parties=parties).build_osx(
        cs, host, int(port), options={"max_message_size": max_message_bytes})
    return Context(computing=cs, federation=fed)


JOBS = {"payload": "fate_rdma_lab.bench.fate_job", "train": "fate_rdma_lab.llm.gpt2_fedavg"}


def job_argv(args: argparse.Namespace) -> List[str]:
    """The job's options (fate_job's BenchArgs, gpt2_fedavg's JobArgs) as its HfArgumentParser reads them
    from sys.argv."""
    common = ["--rounds", str(args.rounds), "--lora_rank", str(args.lora_rank), "--seed", str(args.seed),
              "--out", args.out]
    if args.job == "train":  # one torch thread per party: three parties share this machine's cores
        return ["gpt2_fedavg", *common, "--model", args.model, "--steps_per_round", str(args.steps_per_round),
                "--threads", "1", "--device", args.device]
    return ["fate_job", *common, "--scale", str(args.scale)]


def load_job(job: str) -> Any:
    """The job's module, with what its run(ctx) imports: loaded before the warm-up, so that the parties
    start the job together rather than each after its own imports (torch, transformers, FATE-LLM)."""
    import importlib

    module = importlib.import_module(JOBS[job])
    if job == "train":
        importlib.import_module("fate_llm.algo.fedavg.fedavg")
        importlib.import_module("fate_llm.trainer.seq2seq_trainer")
        importlib.import_module("fate_rdma_lab.llm.corpus")
    return module


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fate_rdma_lab.eval.fate_party", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role", choices=[x.split(":")[0] for x in PARTIES])
    p.add_argument("--fed-id", required=True, help="FATE federation session id (the same for all three)")
    p.add_argument("--data-dir", required=True, help="FATE standalone computing's data folder")
    p.add_argument("--osx", required=True, help="HOST:PORT of the OSX(-compatible) queue")
    p.add_argument("--section", default="null", help="JSON fate_rdma section; null: FATE's own path")
    p.add_argument("--out", required=True, help="where the job writes <role>.json")
    p.add_argument("--job", choices=sorted(JOBS), default="payload",
                   help="payload: fate_job's secure-aggregation rounds; train: gpt2_fedavg's training")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--scale", type=float, default=1.0, help="payload job: fraction of each tensor's leading dim")
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument("--model", choices=("gpt2", "tiny"), default="gpt2", help="train job: GPT-2 124M or tiny")
    p.add_argument("--steps-per-round", type=int, default=2, help="train job: local optimizer steps per round")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="train job: where the parties train")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-message-bytes", type=int, default=(2 << 30) - 1)
    p.add_argument("--deadline-s", type=float, default=600.0, help="stop (stacks to the log) after this long")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    # only our JSON lines on stdout; everything FATE, fate-rdma or a library prints goes to <out>/<role>.log
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, f"{args.role}.log")
    out = os.fdopen(os.dup(1), "w")
    with open(log_path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr
    _stop_at_deadline(out, args.role, args.deadline_s, log_path)
    go = _watch_stdin()
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"[{args.role}] %(levelname)s %(name)s: %(message)s")
    ctx = None
    try:
        ctx = build_context(args.role, args.fed_id, args.data_dir, args.osx, args.max_message_bytes,
                            json.loads(args.section))
        rdma = getattr(ctx.federation, "fate_rdma", None)
        job = load_job(args.job)
        warm_up(ctx, args.role)
        # the driver reads the link and queue counters between "warm" and "go": they then count the job only
        _emit(out, {"warm": True, "role": args.role})
        go.wait()
        sys.argv = job_argv(args)
        job.run(ctx)
        ctx.destroy()  # fate-rdma's close waits for puts still under way; FATE's OSX release
        ctx = None
        _emit(out, {"done": True, "role": args.role, "federation": type_name(rdma, args.section)})
        return 0
    except Exception as exc:  # reported to the driver, which stops the other parties
        import traceback

        traceback.print_exc()
        _emit(out, {"error": f"{args.role}: {type(exc).__name__}: {exc} (log: {log_path})"})
        return 1
    finally:
        if ctx is not None:
            try:
                ctx.destroy()
            except Exception:
                pass


def type_name(rdma: Any, section: str) -> str:
    return "OSXFederation wrapped by fate-rdma" if rdma is not None else (
        "OSXFederation" if section == "null" else "OSXFederation (fate-rdma asked for, NOT wrapped)")


if __name__ == "__main__":
    sys.exit(main())
