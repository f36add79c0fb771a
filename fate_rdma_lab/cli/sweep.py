"""`fate-rdma sweep lora`: the LoRA rank sweep as its users run it, with training.

For each LoRA rank, a real GPT-2 LoRA (c_attn) FedAvg job with FATE-LLM (Seq2SeqFedAVGClient/Server,
FATE's secure aggregation): guest + host + arbiter through FATE's multiprocess launcher on this host,
fate-rdma switched on by `fate-rdma launch --conf` (and with --also-fate the same job over FATE's own
federation). Per rank and round it records each client's training loss (the mean over the round's
local steps, before the average is applied), the computation and communication seconds, the payload
per client up and down, and each party's peak RSS. GPT-2 is built from GPT2Config() (124M
parameters, random init) and the corpus is generated: nothing is downloaded.

Writes OUT/results.jsonl (one line per rank x round, appended when a rank's job ends), OUT/table.md
(rank, payload, loss at the last round, median communication and computation per round) and
OUT/lora_sweep.png. OUT is results/sweep/<UTC time>/ unless --out names one. A rank whose job fails
or overruns --timeout-s is recorded with its error (its log stays in OUT/rank-NNNN/) and the sweep
goes on; `--resume OUT` skips the ranks already complete there and retries the others.

  fate-rdma sweep lora                                    # ranks 4..1024, 3 rounds: about 12 min on 2 cores
  fate-rdma sweep lora --ranks 4,64,1024 --rounds 2      # about 4 min on 2 cores
  fate-rdma sweep lora --tiny --ranks 2,4 --rounds 2      # a two-layer GPT-2: about a minute
  fate-rdma sweep lora --resume results/sweep/20250101T120000Z --also-fate   # add FATE's own path
  fate-rdma sweep lora --device cuda --steps-per-round 20 # same table on a CUDA machine

Time, measured on 2 CPU cores with other jobs running: each job starts three Python processes
(torch, transformers, FATE-LLM: ~15 s) and FATE's launcher waits 10 s at its end; GPT-2 124M with 2
rounds of 2 steps took 35-80 s a rank (rank 1024: ~70 s, 11 s of it communication per round). More
rounds and steps add linearly. --also-fate about doubles it; FATE's own path at rank 1024 needs ~17
GiB in all, and a rank it would not fit in the free memory is recorded as not run.

Device: FATE-LLM's Seq2SeqTrainingArguments are transformers' TrainingArguments, which put the model
on cuda:0 when CUDA is available unless use_cpu is set; --device cpu sets use_cpu, --device cuda
clears it and checks first that torch sees a CUDA device. Guest and host share that one GPU.

Every row names the machine, the provider and the link: all parties on this one host over loopback.
The soft provider (verbs emulated over TCP) is an emulation, not RDMA, and every figure says so.
Exit codes: 0 every rank completed; 1 a rank failed (recorded; see table.md); 2 bad usage; 130
interrupted (Ctrl-C: the running job is stopped, finished ranks are kept; --resume continues).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import subprocess
import sys
from dataclasses import asdict
from typing import Any, Dict, Optional, Tuple

from fate_rdma.errors import ConfigError
from fate_rdma_lab.bench.local import local_endpoints
from fate_rdma_lab.llm.sweep import (FIXED, Settings, SweepError, parse_ranks, read_meta, sweep,
                         utc_stamp)

HELP = 'LoRA rank sweep with real GPT-2 FedAvg training: loss, compute, communication per rank'
#: starts process groups of its own: SIGTERM stops them as Ctrl-C does
STOPS_ITS_CHILDREN = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    sub = p.add_subparsers(dest="sweep_kind", metavar="SWEEP", required=True)
    lora = sub.add_parser("lora", help="GPT-2 LoRA FedAvg with training at each rank: loss, compute, communication",
                          description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_lora_arguments(lora)


def add_lora_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `sweep lora`. Options that define the figures default to None, so that --resume
    can take them from the folder it resumes."""
    p.add_argument("--ranks", default=None,
                   help="comma list of LoRA ranks (default 4,8,16,32,64,128,256,512,1024; on --resume: the folder's)")
    p.add_argument("--rounds", type=int, default=None, help="FedAvg rounds per rank (default 3)")
    p.add_argument("--steps-per-round", type=int, default=None,
                   help="local optimizer steps per client per round (default 2)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 2)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 48)")
    p.add_argument("--tiny", action="store_const", const="tiny", dest="model", default=None,
                   help="a two-layer GPT-2 (n_embd 128) instead of GPT-2 124M: for tests and a quick look")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="where the clients train (default cpu; cuda: cuda:0, shared by guest and host)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads per party (default 1)")
    p.add_argument("--provider", default=None, choices=["auto", "soft", "pyverbs"],
                   help="fate-rdma verbs provider (default: --conf's, else auto: pyverbs where an RDMA device exists, "
                        "else soft)")
    p.add_argument("--conf", default=None,
                   help="a YAML/JSON file with the fate_rdma section to use (default: the gpt2_lora_fedavg "
                        "example's settings); its endpoints are replaced by free ports on 127.0.0.1")
    p.add_argument("--also-fate", action="store_true", default=None,
                   help="run each rank's job over FATE's own federation too, for comparison")
    p.add_argument("--out", default=None, help="results folder (default results/sweep/<UTC time>)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue the sweep in DIR with its settings: skip ranks complete there, retry failed or "
                        "missing ones (--ranks and --also-fate may add to it; other settings must match)")
    p.add_argument("--timeout-s", type=float, default=1800.0,
                   help="seconds allowed for one rank's job before it is stopped and recorded as failed (default 1800)")
    p.add_argument("--fail-ranks", default="", help=argparse.SUPPRESS)  # tests: give these ranks' jobs a bad argument


def settings_from_args(args: argparse.Namespace, saved: Optional[Settings]) -> Settings:
    """The CLI's options over the saved settings (on --resume) or the defaults; a figure-defining option
    that contradicts the saved one is an error."""
    base = saved or Settings()
    given: Dict[str, Any] = {k: getattr(args, k) for k in ("model", "rounds", "steps_per_round", "batch_size",
                                                           "seq_len", "device", "threads", "provider", "also_fate")
                             if getattr(args, k, None) is not None}
    if getattr(args, "conf", None):
        given["section"] = load_section(args.conf)
        if "provider" not in given:  # the file's provider, unless --provider says otherwise
            given["provider"] = given["section"].get("provider", "auto")
    if args.ranks:
        given["ranks"] = parse_ranks(args.ranks)
    if saved is not None:
        clash = [k for k in FIXED if k in given and given[k] != getattr(saved, k)]
        if clash:
            raise SweepError(f"--resume: {', '.join(clash)} differ from the sweep being resumed "
                             f"({', '.join(f'{k}={getattr(saved, k)!r}' for k in clash)}); start a new sweep instead")
    s = Settings(**{**asdict(base), **given})
    for name in ("rounds", "steps_per_round", "batch_size", "seq_len", "threads"):
        if getattr(s, name) < 1:
            raise SweepError(f"--{name.replace('_', '-')} must be at least 1")
    return s


def load_section(path: str) -> Dict[str, Any]:
    from fate_rdma.federation.config import RdmaFederationConfig
    from fate_rdma.federation.config import load_section as load

    section = load(os.path.abspath(path))
    if section is None:
        raise SweepError(f"--conf {path}: no fate_rdma section")
    section = {k: v for k, v in section.items() if k != "endpoints"}
    RdmaFederationConfig.from_section({**section, "endpoints": local_endpoints()})  # fail early, on our side
    return section


def resolve_folder(args: argparse.Namespace) -> Tuple[str, Optional[Settings]]:
    """(folder, saved settings or None) for a new sweep or for --resume; nothing is created yet."""
    if args.resume and args.out:
        raise SweepError("give either --out (a new sweep) or --resume DIR, not both")
    if args.timeout_s <= 0:
        raise SweepError("--timeout-s must be positive")
    if args.resume:
        folder = args.resume
        meta = read_meta(folder)
        if meta is None:
            raise SweepError(f"--resume {folder}: no sweep.json there (not a `fate-rdma sweep lora` folder)")
        try:
            return folder, Settings(**meta["settings"])
        except (KeyError, TypeError) as exc:
            raise SweepError(f"--resume {folder}: sweep.json is not one this version wrote ({exc})") from exc
    folder = args.out or os.path.join("results", "sweep", utc_stamp())
    if os.path.exists(os.path.join(folder, "results.jsonl")):
        raise SweepError(f"{folder} holds a sweep already: continue it with --resume {folder}, or choose another --out")
    return folder, None


def check_device(device: str) -> None:
    if device != "cuda":
        return
    probe = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"
    try:
        rc = subprocess.run([sys.executable, "-c", probe], timeout=300, capture_output=True).returncode
    except subprocess.TimeoutExpired:
        raise SweepError("--device cuda: checking for CUDA took over 300 s") from None
    if rc != 0:
        raise SweepError("--device cuda: torch sees no CUDA device on this machine (torch.cuda.is_available() is "
                         "False); use --device cpu")


def run(args: argparse.Namespace) -> int:
    try:  # the options first (cheap, and the user's to fix), then what this environment lacks
        folder, saved = resolve_folder(args)
        s = settings_from_args(args, saved)
        fail = set(parse_ranks(args.fail_ranks)) if args.fail_ranks else set()
    except ConfigError as exc:  # SweepError, or a --conf that fate-rdma refuses
        print(f"sweep lora: {exc}", file=sys.stderr)
        return 2
    missing = [m for m in ("fate", "fate_llm", "peft", "transformers", "torch") if importlib.util.find_spec(m) is None]
    if missing:  # found, not imported: the parties import them, this process needs none of them
        print(f"sweep lora: {', '.join(missing)} not installed here (pip install 'fate-rdma[fate]', or make venv)",
              file=sys.stderr)
        return 2
    from fate_rdma.federation.hook import pth_path

    if not os.path.exists(pth_path()):
        print("sweep lora: the start-up hook is not installed in this environment, so FATE's party processes would "
              "not see fate-rdma; run `fate-rdma hook install` first", file=sys.stderr)
        return 2
    try:
        check_device(s.device)
    except SweepError as exc:
        print(f"sweep lora: {exc}", file=sys.stderr)
        return 2
    os.makedirs(folder, exist_ok=True)
    return sweep(s, folder, args.timeout_s, fail, command=typed_command())


def typed_command() -> str:
    """The command line as typed, without this machine's paths to the program."""
    prog = sys.argv[0]
    if os.path.basename(prog) in ("__main__.py", "fate-rdma"):
        prog = "fate-rdma"
    elif os.path.abspath(prog).startswith(os.getcwd() + os.sep):
        prog = "python " + os.path.relpath(prog)
    else:
        prog = "python " + os.path.basename(prog)
    return " ".join([prog] + [shlex.quote(a) for a in sys.argv[1:]])


