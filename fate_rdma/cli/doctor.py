"""`fate-rdma doctor`: providers, devices, ports, GIDs, MTU, max_msg_sz; what `auto` picks and why; what
a channel configuration lets the receive pools hold (FedRDMA-E slots grow with the traffic and shrink
when idle)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import ChannelConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--config", metavar="YAML", default=None,
                   help="a channel configuration: a file with a `channel:` section (conf/channel.yaml), else "
                        "a `fate_rdma:` one (a launcher conf, a task or fate-flow job conf; a job conf's site file "
                        "is not read): say what its receive pools hold (default: the built-in defaults)")


def channel_config(path: str) -> "ChannelConfig":
    """The channel settings of `path`: its `channel:` section (conf/channel.yaml) if it has one, else its `fate_rdma`
    section (a launcher, task or fate-flow job conf; a job conf's site file is not read). ConfigError where it has
    neither, names no readable file, or a value is of the wrong kind."""
    import os

    from ..config import ChannelConfig
    from ..errors import ConfigError
    from ..federation.config import FED_KEYS, read_conf, section_in

    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such file")
    doc = read_conf(path)  # (an unreadable file, or not a mapping: its ConfigError)
    try:
        if isinstance(doc.get("channel"), dict):
            return ChannelConfig.from_dict(doc["channel"])
        section = section_in(doc)
        if section is None:
            raise ConfigError(f"{path}: no `channel:` section (conf/channel.yaml) and no `fate_rdma` section "
                              f"(a launcher, task or fate-flow job conf): nothing to read the channel's settings from")
        if not isinstance(section, dict):
            raise ConfigError(f"{path}: the fate_rdma section must be a mapping")
        return ChannelConfig.from_dict({k: v for k, v in section.items() if k not in FED_KEYS})
    except (TypeError, ValueError) as exc:  # (a value of the wrong kind: ChannelConfig's own check)
        raise ConfigError(f"{path}: {exc}") from exc


def run(args: argparse.Namespace) -> int:
    from easypyverbs.doctor import render, report

    from ..channel.slots import describe, pool_policy
    from ..config import ChannelConfig
    from ..errors import ConfigError

    try:
        cfg = channel_config(args.config) if args.config else ChannelConfig()
    except ConfigError as exc:
        print(f"fate-rdma doctor: --config {exc}", file=sys.stderr)
        return 2
    rep = report()
    rep["receive_memory"] = pool_policy(cfg)
    lines = describe(rep["receive_memory"])
    if not args.config:
        lines[0] += " (defaults; --config FILE for yours)"
    if cfg.mode == "fedrdma-e":
        lines.insert(1, "  what a running endpoint's pools hold: logged when it closes (a FATE task's log), "
                        "Endpoint.pool_report() in code")
    from ..channel.posture import posture

    rep["security"] = [{"level": lvl, "what": line} for lvl, line in posture(cfg)]
    lines += ["security of this configuration (docs/security.md):"] + \
        [f"  {'WARNING: ' if lvl == 'warning' else ''}{line}" for lvl, line in posture(cfg)]
    from ..hugepages import check as huge_pages

    rep["malloc_huge_pages"] = huge_pages()[1]  # (measured where asked for; the warning where not got)
    lines.append(rep["malloc_huge_pages"])
    print(json.dumps(rep, indent=2) if args.json else "\n".join([render(rep), *lines]))
    return 0 if rep["usable"] else 1
