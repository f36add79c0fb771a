"""`fate-rdma bench verbs|transfer|latency|fate|timeline|regrant`: figures (JSON lines plus a table), not pass/fail tests."""
from __future__ import annotations

import argparse
import importlib

KINDS = {
    "verbs": "fate_rdma.bench.verbs",
    "transfer": "fate_rdma.bench.transfer",
    "latency": "fate_rdma.bench.latency",
    "fate": "fate_rdma.bench.fate_federation",
    "timeline": "fate_rdma.bench.timeline",
    "regrant": "fate_rdma.bench.regrant",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, mod in KINDS.items():
        m = importlib.import_module(mod)
        # the help line: the docstring's first sentence (it may run over several lines)
        first = " ".join(m.__doc__.strip().split("\n\n")[0].split()).split(". ")[0].rstrip(".") + "."
        sp = sub.add_parser(name, help=first, description=m.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        m.add_arguments(sp)


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(KINDS[args.bench]).run(args) or 0)
