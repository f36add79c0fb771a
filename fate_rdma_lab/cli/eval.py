"""`fate-rdma eval link|stress|fairness|fate|faults|cost`: fate-rdma against TCP and FATE on a WAN testbed of real
packets (network namespaces, shaped links), each run a folder of evidence.

link, stress, fairness and fate build a WAN testbed of their own (`fate-rdma wan`; root; prefix freval by
default: give another with --prefix when a second testbed may exist) and remove it at the end, also
on failure, Ctrl-C or SIGTERM. cost runs on loopback (no testbed, no root). Every run writes
OUT/<UTC time>-<study>/results.jsonl, table.md and a PNG, and prints the table. Every row states the
machine, the provider (soft = verbs emulated over TCP, not RDMA), the link as measured (RTT, one TCP
stream) or "loopback", the payload, the repetitions and medians. Testbed rates are scaled: real
packets on 2 cores cannot carry the paper's 10 Gbit/s x 20 ms, and every row says so.

  fate-rdma eval link --quick                               # chunks: TCP, gRPC, fedrdma(-e) w=1/auto, Mooncake
  fate-rdma eval link --study qps,link-enable,window --quick  # several QPs on a lossy long link; Link-Enable; windows
  fate-rdma eval link --links 100:20:0,100:20:1 --chunks 65536,1048576 --bytes 33554432 --reps 5
  fate-rdma eval stress --quick          # loss 0/0.1/1/5 % and a CPU stress; every transfer verified
  fate-rdma eval fairness --quick        # 3 clients -> 1 arbiter at once: per-client times, slowest vs fastest
  fate-rdma eval fate --quick            # FATE's own path (OSX engine) vs fate-rdma: FedAvg rounds, three sites
  fate-rdma eval fate --job train --quick  # the same with real GPT-2 LoRA training: compute vs comm per round
  fate-rdma eval faults --quick          # drops, resets, a stopped receiver, loss bursts: resumed, delivered once
  fate-rdma eval cost --quick            # the paper's Table 4 on loopback: time, extra memory, CPU s per side

Exit codes: 0 ok; 1 a transfer failed, was corrupted or (stress, faults) anything was lost or came twice; 2 bad usage;
3 this host cannot build a testbed.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any, Callable, Tuple

HELP = "evaluation on the WAN testbed: link studies, FATE's own path, stress, fairness, system cost (JSONL, table, plot)"
#: starts process groups of its own: SIGTERM stops them as Ctrl-C does
STOPS_ITS_CHILDREN = True

LINK_STUDIES = """studies (--study, comma separated; one testbed, reshaped between links):
  chunks       TCP stream, gRPC stream, fedrdma / fedrdma-e at window 1 (the paper) and auto, Mooncake TE TCP
               (sync write; batch of chunk-sized writes) at each --chunks size: the paper's Table 2, scaled.
               Links: 100:20:0,200:40:0,100:20:1 (quick 100:20:0)
  qps          fedrdma-e (auto window) with qps_per_peer in --qps (the soft provider: one TCP stream per QP) beside
               one TCP stream, on a lossy long link. Links: 100:80:1,100:80:0.1 (quick 100:80:1)
  link-enable  fedrdma-e and fedrdma (quick: fedrdma-e), window 1 and auto (or --windows), link_enable
               false/true/auto (auto = on from 4 Gbit/s nominal: off at these scaled rates). Link: 100:20:0
  window       fedrdma-e and fedrdma at each of --windows: the best window per link, and what auto chose.
               Links: 100:20:0,200:40:0,50:80:0 (quick 100:20:0); chunk = the first of --chunks
qps and link-enable use the largest of --chunks. --links replaces every study's links."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    sub = p.add_subparsers(dest="eval_action", metavar="ACTION", required=True)
    fmt = argparse.RawDescriptionHelpFormatter
    l = sub.add_parser("link", help="transports on the same shaped link: chunks, several QPs, Link-Enable, windows",
                       description=LINK_STUDIES, formatter_class=fmt)
    l.add_argument("--study", default="chunks", help="comma list of chunks, qps, link-enable, window (default chunks)")
    l.add_argument("--quick", action="store_true", help="one link per study, chunks 64 KiB and 1 MiB, 8 MiB, 2 reps")
    l.add_argument("--links", default=None, metavar="RATE:RTT:LOSS,...", help="link settings as Mbit/s:ms:percent")
    l.add_argument("--chunks", default=None, help="chunk sizes in bytes, comma separated (default 16K..4M; quick 64K,1M)")
    l.add_argument("--qps", default="1,2,4", help="qps_per_peer values of the qps study")
    l.add_argument("--windows", default=None,
                   help="windows of the window study (default 1,2,4,8,16,32,auto; quick 1,4,16,auto)")
    l.add_argument("--modes", default=None, help="channel modes of the qps/link-enable/window studies "
                                                 "(default fedrdma-e,fedrdma; quick fedrdma-e)")
    _tcp_cc(l, "fate-rdma's soft provider and the TCP baselines run over it; how several QPs compare with one "
               "on a lossy link depends on it")
    _common(l, "64 MiB; quick 8 MiB", "5; quick 2")
    s = sub.add_parser("stress", help="FedComm's stresses: loss 0/0.1/1/5 %% and a CPU stress; nothing lost or corrupted",
                       formatter_class=fmt, description=_doc("stress"))
    _one_link(s, "link rate", "round trip", "fedrdma/fedrdma-e chunk", "")
    s.add_argument("--losses", default="0,0.1,1,5", help="loss percentages, one condition each")
    s.add_argument("--cpu-burners", type=int, default=None,
                   help="busy-looping processes in the sending site for the CPU condition (default: one per core; 0: none)")
    _common(s, "32 MiB; quick 4 MiB", "3; quick 1")
    f = sub.add_parser("fairness", help="3 clients send to one arbiter at once: per-client times, slowest vs fastest",
                       formatter_class=fmt, description=_doc("fairness"))
    _one_link(f, "the arbiter's link rate", "round trip client <-> arbiter", "fedrdma-e chunk", " per client")
    _tcp_cc(f, "fate-rdma's soft provider and the TCP baseline both run over it, and fairness depends on it")
    _common(f, "32 MiB per client; quick 4 MiB", "3; quick 1")
    e = sub.add_parser("fate", help="FATE's own path (OSX engine) beside fate-rdma: FedAvg rounds, three sites",
                       formatter_class=fmt, description=_doc("fate"))
    e.add_argument("--quick", action="store_true",
                   help="50 Mbit/s x 10 ms, LoRA rank 4, 1 round (--job train: tiny model, 1 step a round)")
    e.add_argument("--job", choices=("payload", "train"), default="payload",
                   help="payload (default): FedAvg secure-aggregation rounds of GPT-2-sized weights, no training "
                        "(bench fate's job); train: real GPT-2 LoRA FedAvg training with FATE-LLM (gpt2_fedavg), "
                        "compute and communication per round (Figure 7)")
    e.add_argument("--model", choices=("gpt2", "tiny"), default=None,
                   help="--job train: GPT-2 124M (GPT2Config(), random init) or a 2-layer GPT-2 (default gpt2; "
                        "quick tiny)")
    e.add_argument("--steps-per-round", type=int, default=None,
                   help="--job train: local optimizer steps per round (default 2; quick 1)")
    e.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="--job train: where the three parties train (default cpu; cuda: the same run and table on a "
                        "CUDA machine, the parties sharing its GPU)")
    e.add_argument("--lora-rank", type=int, default=None,
                   help="GPT-2 LoRA (c_attn) rank of the payload; 0: GPT-2's full weights, payload job only "
                        "(default 16; quick 4)")
    e.add_argument("--scale", type=float, default=None,
                   help="payload job: fraction of each tensor's leading dimension (default 1)")
    e.add_argument("--rounds", type=int, default=None, help="FedAvg rounds per method (default 3; quick 1)")
    e.add_argument("--rate-mbit", type=float, default=None, help="every site's link rate (default 100; quick 50)")
    e.add_argument("--rtt-ms", type=float, default=None, help="round trip between sites (default 20; quick 10)")
    e.add_argument("--loss-pct", type=float, default=None, help="random loss on packets leaving each site (default 0)")
    e.add_argument("--methods", default=None, help="comma list: fate (required), fedrdma-e, fedrdma (default all)")
    e.add_argument("--out", default="results/eval", help="results root; each run makes a time-stamped folder")
    e.add_argument("--prefix", default="freval", help="namespace prefix of the testbed this run builds")
    e.add_argument("--timeout-s", type=float, default=600.0, help="deadline of each method's job (every party)")
    x = sub.add_parser("faults", help="links that drop, reset and lose, a receiver stopped: resumed, delivered once",
                       formatter_class=fmt, description=_doc("faults"))
    x.add_argument("--quick", action="store_true", help="200 Mbit/s x 10 ms, 20 transfers up to 16 MiB, drops 2 and "
                                                       "5 s, a 5 s pause")
    x.add_argument("--count", type=int, default=None, help="transfers per condition (default 100; quick 20)")
    x.add_argument("--max-bytes", type=int, default=None, help="largest payload (default 256 MiB; quick 16 MiB)")
    x.add_argument("--drops", default=None, metavar="S,...", help="blackholes, seconds each (default 2,10,30)")
    x.add_argument("--reset-s", type=float, default=None, help="seconds of TCP resets (default 1; 0 = none)")
    x.add_argument("--pause-s", type=float, default=None, help="seconds the receiver is stopped (default 20; 0 = none)")
    x.add_argument("--loss-pct", type=float, default=None, help="loss of the three 2 s bursts (default 5; 0 = none)")
    x.add_argument("--rate-mbit", type=float, default=None, help="the link's rate (default 1000; quick 200)")
    x.add_argument("--rtt-ms", type=float, default=None, help="the link's RTT (default 10)")
    x.add_argument("--chunk-bytes", type=int, default=None, help="the channel's chunk (default 256 KiB)")
    x.add_argument("--mode", choices=("fedrdma", "fedrdma-e"), default=None,
                   help="the channel's mode (default fedrdma; fedrdma-e resumes from its old receive slot)")
    x.add_argument("--out", default="results/eval", help="results root; each run makes a time-stamped folder")
    x.add_argument("--prefix", default="freval", help="namespace prefix of the testbed this run builds")
    x.add_argument("--timeout-s", type=float, default=1800.0, help="deadline of each condition")
    c = sub.add_parser("cost", help="the paper's Table 4 on loopback: time, extra memory, CPU seconds each side",
                       formatter_class=fmt, description=_doc("cost"))
    c.add_argument("--quick", action="store_true", help="64 MiB, 1 rep, loopback TCP path only")
    c.add_argument("--payload-mib", type=int, default=None, help="payload (default 1024: the paper's 1 GB; quick 64)")
    c.add_argument("--reps", type=int, default=None, help="repetitions (default 3; quick 1)")
    c.add_argument("--paths", default=None, help="fate-rdma paths: tcp (loopback TCP, as between hosts), same-host "
                                                 "(shared memory or process_vm_readv); default tcp,same-host, quick tcp")
    c.add_argument("--out", default="results/eval", help="results root; each run makes a time-stamped folder")


def _doc(module: str) -> str:
    import importlib

    return importlib.import_module(f"fate_rdma_lab.eval.{module}").__doc__ or ""


def _one_link(p: argparse.ArgumentParser, rate: str, rtt: str, chunk: str, per: str) -> None:
    p.add_argument("--quick", action="store_true", help=f"50 Mbit/s x 10 ms, 4 MiB{per}, 1 rep")
    p.add_argument("--rate-mbit", type=float, default=None, help=f"{rate} (default 100; quick 50)")
    p.add_argument("--rtt-ms", type=float, default=None, help=f"{rtt} (default 20; quick 10)")
    p.add_argument("--chunk-bytes", type=int, default=256 * 1024, help=chunk)


def _tcp_cc(p: argparse.ArgumentParser, why: str) -> None:
    p.add_argument("--tcp-cc", default=None, metavar="NAME",
                   help=f"TCP congestion control in the sites (e.g. cubic, bbr; default: the host's). {why}")


def _common(p: argparse.ArgumentParser, bytes_default: str, reps_default: str) -> None:
    p.add_argument("--bytes", type=int, default=None, help=f"payload per transfer (default {bytes_default})")
    p.add_argument("--reps", type=int, default=None, help=f"timed repetitions per figure (default {reps_default})")
    p.add_argument("--out", default="results/eval", help="results root; each run makes a time-stamped folder")
    p.add_argument("--prefix", default="freval", help="namespace prefix of the testbed this run builds")
    p.add_argument("--timeout-s", type=float, default=300.0, help="deadline of each transfer")


def _link(text: str) -> Tuple[float, float, float]:
    parts = text.split(":")
    if len(parts) != 3:
        raise ValueError(f"--links: want RATE:RTT:LOSS (Mbit/s:ms:percent), got {text!r}")
    rate, rtt, loss = (float(x) for x in parts)
    if rate <= 0 or rtt < 0 or not 0 <= loss < 100:
        raise ValueError(f"--links: {text!r} out of range")
    return rate, rtt, loss


def _csv(text: str) -> Tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _plan(args: argparse.Namespace) -> Tuple[Callable[..., Any], Any, bool]:
    """(runner, plan, needs a testbed) for the action; ValueError on bad values."""
    act = args.eval_action
    if act == "link":
        return _link_plan(args)
    if act == "stress":
        return _stress_plan(args)
    if act == "fairness":
        return _fairness_plan(args)
    if act == "fate":
        return _fate_plan(args)
    if act == "faults":
        return _faults_plan(args)
    return _cost_plan(args)


# one function per action: each study has a Plan class of its own
def _link_plan(args: argparse.Namespace) -> Tuple[Callable[..., Any], Any, bool]:
    from fate_rdma_lab.eval.links import FULL, QUICK, STUDIES, Plan

    base = QUICK if args.quick else FULL
    studies = _csv(args.study)
    bad = [s for s in studies if s not in STUDIES]
    if bad or not studies:
        raise ValueError(f"--study: unknown {', '.join(bad) or '(none)'}; known: {', '.join(STUDIES)}")
    windows = _csv(args.windows) if args.windows else base.windows
    if any(w != "auto" and not (w.isdigit() and 1 <= int(w) <= 64) for w in windows):
        raise ValueError("--windows: numbers 1..64 or auto")
    modes = _csv(args.modes) if args.modes else base.modes
    if any(m not in ("fedrdma", "fedrdma-e") for m in modes):
        raise ValueError("--modes: fedrdma and/or fedrdma-e")
    qps = tuple(int(x) for x in _csv(args.qps))
    if not qps or any(not 1 <= q <= 16 for q in qps):
        raise ValueError("--qps: values 1..16")
    plan = Plan(links=tuple(_link(x) for x in _csv(args.links)) if args.links else base.links,
                chunks=tuple(int(x) for x in _csv(args.chunks)) if args.chunks else base.chunks,
                nbytes=args.bytes or base.nbytes, reps=args.reps or base.reps, studies=studies, qps=qps,
                windows=windows, le_windows=windows if args.windows else base.le_windows, modes=modes,
                measure_s=base.measure_s, links_given=bool(args.links), tcp_cc=args.tcp_cc)
    if min(plan.chunks) < 4096:
        raise ValueError("chunks must be at least 4096 bytes")
    from fate_rdma_lab.eval.links import run_eval

    return lambda **kw: run_eval(plan, quick=args.quick, **kw), plan, True


def _stress_plan(args: argparse.Namespace) -> Tuple[Callable[..., Any], Any, bool]:
    from fate_rdma_lab.eval.stress import FULL, QUICK, run_stress

    base = QUICK if args.quick else FULL
    plan = base.with_(rate_mbit=args.rate_mbit, rtt_ms=args.rtt_ms, nbytes=args.bytes, reps=args.reps,
                      losses=tuple(float(x) for x in _csv(args.losses)), burners=args.cpu_burners,
                      chunk_bytes=args.chunk_bytes)
    return lambda **kw: run_stress(plan, **kw), plan, True


def _fairness_plan(args: argparse.Namespace) -> Tuple[Callable[..., Any], Any, bool]:
    from fate_rdma_lab.eval.fairness import FULL, QUICK, run_fairness

    base = QUICK if args.quick else FULL
    plan = base.with_(rate_mbit=args.rate_mbit, rtt_ms=args.rtt_ms, nbytes=args.bytes, reps=args.reps,
                      chunk_bytes=args.chunk_bytes)
    return lambda **kw: run_fairness(plan, tcp_cc=args.tcp_cc, **kw), plan, True


def _fate_plan(args: argparse.Namespace) -> Tuple[Callable[..., Any], Any, bool]:
    from fate_rdma_lab.eval.fate_run import FULL, QUICK, run_fate

    base = QUICK if args.quick else FULL
    if args.job != "train" and (args.model or args.steps_per_round or args.device):
        raise ValueError("--model, --steps-per-round and --device belong to --job train")
    if args.job == "train" and args.quick:
        base = base.with_(job="train", model="tiny", steps_per_round=1)
    plan = base.with_(rate_mbit=args.rate_mbit, rtt_ms=args.rtt_ms, loss_pct=args.loss_pct,
                      lora_rank=args.lora_rank, scale=args.scale, rounds=args.rounds,
                      methods=_csv(args.methods) if args.methods else None, job=args.job, model=args.model,
                      steps_per_round=args.steps_per_round, device=args.device)
    return lambda **kw: run_fate(plan, **kw), plan, True


def _faults_plan(args: argparse.Namespace) -> Tuple[Callable[..., Any], Any, bool]:
    from fate_rdma_lab.eval.faults import FULL, QUICK, run_faults

    base = QUICK if args.quick else FULL
    plan = base.with_(rate_mbit=args.rate_mbit, rtt_ms=args.rtt_ms, chunk_bytes=args.chunk_bytes, count=args.count,
                      max_bytes=args.max_bytes, drops=tuple(float(x) for x in _csv(args.drops)) if args.drops else None,
                      reset_s=args.reset_s, pause_s=args.pause_s, loss_pct=args.loss_pct, mode=args.mode)
    return lambda **kw: run_faults(plan, **kw), plan, True


def _cost_plan(args: argparse.Namespace) -> Tuple[Callable[..., Any], Any, bool]:
    from fate_rdma_lab.eval.cost import FULL, QUICK, run_cost

    base = QUICK if args.quick else FULL
    plan = base.with_(nbytes=args.payload_mib << 20 if args.payload_mib else None, reps=args.reps,
                      paths=_csv(args.paths) if args.paths else None)
    return lambda **kw: run_cost(plan, **kw), plan, False


def run(args: argparse.Namespace) -> int:
    from fate_rdma_lab.testbed import bed as wan

    name = f"fate-rdma eval {args.eval_action}"
    try:
        runner, plan, needs_testbed = _plan(args)
        if needs_testbed:
            wan.check_prefix(args.prefix)
    except (ValueError, wan.WanError) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    if needs_testbed:
        problem = wan.host_problem() or wan.spec_problem(wan.Testbed(links=(wan.LinkSpec(loss_pct=1.0),) * 2))
        if problem:
            print(f"{name}: this host cannot build the testbed: {problem}", file=sys.stderr)
            return 3
    command = "fate-rdma " + shlex.join(sys.argv[1:] if sys.argv[1:2] == ["eval"] else ["eval", args.eval_action, "..."])

    kw: dict = {"log": lambda s: print(s, flush=True), "command": command}
    if needs_testbed:
        kw.update(prefix=args.prefix, timeout_s=args.timeout_s)
    removed = " (the testbed was removed)" if needs_testbed else ""
    try:
        runner(out_root=Path(args.out), **kw)  # (SIGTERM arrives as Ctrl-C: fate_rdma.cli.main)
    except wan.WanError as exc:
        print(f"{name}: {exc}{removed}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{name}: interrupted{removed}", file=sys.stderr)
        return 1
    return 0
