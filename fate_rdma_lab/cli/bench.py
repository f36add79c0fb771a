"""`fate-rdma bench verbs|transfer|latency|fate|timeline|regrant`: figures (JSON lines plus a table), not pass/fail tests."""
from __future__ import annotations

import argparse
import importlib

HELP = 'benchmarks that print figures (JSON lines + table): verbs, transfer, latency, fate, timeline, regrant'
#: starts process groups of its own: SIGTERM stops them as Ctrl-C does
STOPS_ITS_CHILDREN = True

KINDS = {
    "verbs": "fate_rdma_lab.bench.verbs",
    "transfer": "fate_rdma_lab.bench.transfer",
    "latency": "fate_rdma_lab.bench.latency",
    "fate": "fate_rdma_lab.bench.fate_federation",
    "timeline": "fate_rdma_lab.bench.timeline",
    "regrant": "fate_rdma_lab.bench.regrant",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, mod in KINDS.items():
        m = importlib.import_module(mod)
        # the help line: the docstring's first sentence (it may run over several lines)
        doc = m.__doc__ or ""
        first = " ".join(doc.strip().split("\n\n")[0].split()).split(". ")[0].rstrip(".") + "."
        sp = sub.add_parser(name, help=first, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        m.add_arguments(sp)


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(KINDS[args.bench]).run(args) or 0)
