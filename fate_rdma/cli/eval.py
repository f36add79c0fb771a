"""`fate-rdma eval link`: transports side by side on one shaped link of the WAN testbed (root).

Builds a two-site testbed (`fate-rdma wan`, prefix freval), and for each link setting sends the same
payload from site a to site b by one TCP stream, a gRPC client stream, fedrdma and fedrdma-e with
window 1 (the paper) and auto, at each chunk size; every transfer verified by crc32c, medians of
--reps after a warm-up. Writes OUT/<UTC time>/results.jsonl, table.md and link_throughput.png, and
removes the testbed at the end, also on failure or Ctrl-C.

  fate-rdma eval link --quick                      # 100 Mbit/s x 20 ms, 64 KiB and 1 MiB chunks, 8 MiB, 2 reps
  fate-rdma eval link --links 100:20:0,100:20:1 --chunks 65536,1048576 --bytes 33554432 --reps 5

Rates are scaled (real packets on 2 cores): chunk/BDP and the chunk it corresponds to on the paper's
10 Gbit/s x 20 ms link are printed beside every figure. FATE's own path and Mooncake are not in yet.
Exit codes: 0 ok; 1 a transfer failed or was corrupted; 2 bad usage; 3 this host cannot build a testbed.
"""
from __future__ import annotations

import argparse
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Tuple


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    sub = p.add_subparsers(dest="eval_action", metavar="ACTION", required=True)
    l = sub.add_parser("link", help="TCP, gRPC, fedrdma, fedrdma-e on the same shaped link; JSONL + table + plot",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    l.add_argument("--quick", action="store_true", help="one link, two chunk sizes, 8 MiB, 2 reps (about a minute)")
    l.add_argument("--links", default=None, metavar="RATE:RTT:LOSS,...",
                   help="link settings as Mbit/s:ms:percent (default: 100:20:0,200:40:0,100:20:1; quick 100:20:0)")
    l.add_argument("--chunks", default=None, help="chunk sizes in bytes, comma separated")
    l.add_argument("--bytes", type=int, default=None, help="payload per transfer (default 64 MiB; quick 8 MiB)")
    l.add_argument("--reps", type=int, default=None, help="timed repetitions per figure (default 5; quick 2)")
    l.add_argument("--out", default="results/eval", help="results root; each run makes a time-stamped folder")
    l.add_argument("--prefix", default="freval", help="namespace prefix of the testbed this run builds")
    l.add_argument("--timeout-s", type=float, default=300.0, help="deadline of each transfer")


def _link(text: str) -> Tuple[float, float, float]:
    parts = text.split(":")
    if len(parts) != 3:
        raise ValueError(f"--links: want RATE:RTT:LOSS (Mbit/s:ms:percent), got {text!r}")
    rate, rtt, loss = (float(x) for x in parts)
    if rate <= 0 or rtt < 0 or not 0 <= loss < 100:
        raise ValueError(f"--links: {text!r} out of range")
    return rate, rtt, loss


def run(args: argparse.Namespace) -> int:
    from .. import wan
    from ..wan_eval import FULL, QUICK, Plan, run_eval

    base = QUICK if args.quick else FULL
    try:
        plan = Plan(links=tuple(_link(x) for x in args.links.split(",")) if args.links else base.links,
                    chunks=tuple(int(x) for x in args.chunks.split(",")) if args.chunks else base.chunks,
                    nbytes=args.bytes or base.nbytes, reps=args.reps or base.reps)
        if plan.nbytes <= 0 or plan.reps <= 0 or min(plan.chunks) < 4096:
            raise ValueError("--bytes and --reps must be positive and chunks at least 4096 bytes")
        wan.check_prefix(args.prefix)
    except (ValueError, wan.WanError) as exc:
        print(f"fate-rdma eval link: {exc}", file=sys.stderr)
        return 2
    problem = wan.host_problem() or wan.spec_problem(wan.Testbed(links=(wan.LinkSpec(loss_pct=1.0),) * 2))
    if problem:
        print(f"fate-rdma eval link: this host cannot build the testbed: {problem}", file=sys.stderr)
        return 3
    command = "fate-rdma " + shlex.join(sys.argv[1:] if sys.argv[1:2] == ["eval"] else ["eval", "link", "..."])

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM as Ctrl-C, so the testbed is removed

    previous = signal.signal(signal.SIGTERM, interrupted) if threading.current_thread() is threading.main_thread() else None
    try:
        run_eval(plan, Path(args.out), prefix=args.prefix, timeout_s=args.timeout_s,
                 log=lambda s: print(s, flush=True), command=command)
    except wan.WanError as exc:
        print(f"fate-rdma eval link: {exc} (the testbed was removed)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fate-rdma eval link: interrupted (the testbed was removed)", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0
