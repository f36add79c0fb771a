"""`fate-rdma doctor`: providers, devices, ports, GIDs, MTU, max_msg_sz; what `auto` picks and why; what
a channel configuration lets the receive pools hold (FedRDMA-E slots grow with the traffic and shrink
when idle)."""
from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--config", metavar="YAML", default=None,
                   help="a channel configuration (a file with a `channel:` section, e.g. conf/channel.yaml): "
                        "say what its receive pools hold (default: the built-in defaults)")


def run(args: argparse.Namespace) -> int:
    from easypyverbs.doctor import render, report

    from ..channel.slots import describe, pool_policy
    from ..config import ChannelConfig

    rep = report()
    cfg = ChannelConfig.from_yaml(args.config) if args.config else ChannelConfig()
    rep["receive_memory"] = pool_policy(cfg)
    lines = describe(rep["receive_memory"])
    if not args.config:
        lines[0] += " (defaults; --config FILE for yours)"
    if cfg.mode == "fedrdma-e":
        lines.insert(1, "  what a running endpoint's pools hold: logged when it closes (a FATE task's log), "
                        "Endpoint.pool_report() in code")
    from ..hugepages import check as huge_pages

    rep["malloc_huge_pages"] = huge_pages()[1]  # (measured where asked for; the warning where not got)
    lines.append(rep["malloc_huge_pages"])
    print(json.dumps(rep, indent=2) if args.json else "\n".join([render(rep), *lines]))
    return 0 if rep["usable"] else 1
