"""`fate-rdma doctor`: providers, devices, ports, GIDs, MTU, max_msg_sz; what `auto` picks and why."""
from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    from easypyverbs.doctor import render, report

    rep = report()
    print(json.dumps(rep, indent=2) if args.json else render(rep))
    return 0 if rep["usable"] else 1
