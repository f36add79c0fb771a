"""`fate-rdma site init|check`: a site's pieces from the federation's description, and whether it reaches its peers.

    fate-rdma site init FEDERATION.yaml --party ROLE:ID --out DIR   (every piece this site needs, docs/sites.md)

    fate-rdma site check --serve [--party ROLE:ID]     at each peer site (answers checks; Ctrl-C stops it)
    fate-rdma site check [--party ROLE:ID]             at the site that checks: one line per peer

For each peer it connects and authenticates as a task of this site would (its party's name, its secret or
certificate, from the site file), then sends a payload of --bytes that the peer sends back, verified; it
prints per peer: reachable, how the identity was proven, connect time, RTT, rate, MTU, provider and data path;
or the stage that failed and its likely cause (connection refused, no answer / firewall, wrong CA, clocks
apart, another secret). The site file is `flow setup`'s (--site, else $FATE_RDMA_SITE, else this Python's).
--party names this site's party where the site file's endpoints do not tell (several on this host).
Exit codes: 0 every peer passed, 1 one failed, 2 bad usage, 130 interrupted.
"""
from __future__ import annotations

import argparse
import errno
import socket
import sys
import threading
from typing import List, Optional

STOPS_ITS_CHILDREN = False


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION")
    i = sub.add_parser("init", help="write this site's pieces (site file, key and certificate request, OSX route "
                                    "table, FATE-Flow keys, firewall ports) from the federation's description",
                       description=("From the federation's description (the same YAML at every site: its parties, "
                                    "their hosts and ports, security) write into --out every piece this site needs: "
                                    "fate-rdma's site file, the site's key and certificate request, OSX's "
                                    "broker.properties and route_table.json, the keys of FATE-Flow's "
                                    "service_conf.yaml, the firewall's ports and the steps left (NEXT.txt). It "
                                    "edits no installed package and no server's files: it says where each piece "
                                    "goes. docs/sites.md."))
    i.add_argument("federation", help="the federation's description (YAML)")
    i.add_argument("--party", required=True, help="this site's party (ROLE:PARTY_ID), one of the description's")
    i.add_argument("--out", required=True, help="folder for this site's pieces")
    i.add_argument("--force", action="store_true", help="write the pieces again (the key, if made, is kept)")
    c = sub.add_parser("check", help="reach, authenticate and exchange a verified payload with every peer",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--site", help="site file (default: $FATE_RDMA_SITE, else <this Python's prefix>/etc/fate_rdma/"
                                  "site.yaml)")
    c.add_argument("--party", help="this site's party (ROLE:PARTY_ID), where its endpoints do not tell")
    c.add_argument("--serve", action="store_true", help="answer checks on this party's endpoint until Ctrl-C")
    c.add_argument("--peer", action="append", default=None, help="check only this peer (ROLE:PARTY_ID; repeatable)")
    c.add_argument("--bytes", type=int, default=1 << 20, help="payload of the check each way (default 1 MiB)")
    c.add_argument("--timeout", type=float, default=20.0, help="seconds to wait for each transfer and its echo")


def _local(host: str) -> bool:
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host.strip("[]"), 0))
        return True
    except OSError:
        return False


def which_party(endpoints: dict, given: Optional[str]) -> str:
    """This site's party: `given`, else the one whose endpoint's host is an address of this machine."""
    if given:
        if given not in endpoints:
            raise ValueError(f"--party {given} is not in the site file's endpoints ({', '.join(sorted(endpoints))})")
        return given
    mine = [p for p, a in endpoints.items() if _local(str(a).rpartition(":")[0])]
    if len(mine) != 1:
        raise ValueError(f"cannot tell this site's party from its endpoints ({'several' if mine else 'none'} of them "
                         f"on this host: {', '.join(mine) or '-'}); give --party ROLE:PARTY_ID")
    return mine[0]


def _init(args: argparse.Namespace) -> int:
    import yaml

    from ..errors import ConfigError
    from ..federation.site_recipe import write
    from .tls import request_certificate

    try:
        with open(args.federation) as f:
            doc = yaml.safe_load(f)
        steps = write(doc, args.party, args.out, args.force, request=lambda folder, p: request_certificate(folder, [p]))
    except (OSError, yaml.YAMLError, ConfigError, ValueError) as exc:
        print(f"fate-rdma site init: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, (ConfigError, ValueError, yaml.YAMLError, FileNotFoundError)) else 1
    print(f"fate-rdma site init: {args.party}'s pieces are in {args.out}; what is left ({args.out}/NEXT.txt):")
    for n, step in enumerate(steps, 1):
        print(f"  {n}. {step}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.action == "init":
        return _init(args)
    if args.action != "check":
        print("fate-rdma site: give an action: init or check (fate-rdma site ACTION --help)", file=sys.stderr)
        return 2
    import easypyverbs as ev

    from ..errors import ConfigError, FateRdmaError
    from ..federation.config import RdmaFederationConfig
    from ..federation.flow import default_site_path, load_site
    from ..federation.site_check import check, serve

    path = args.site or default_site_path()
    try:
        site = load_site(path)
        cfg = RdmaFederationConfig.from_section({k: v for k, v in site.items() if k != "flow_address"})
        party = which_party(cfg.endpoints, args.party)
        if args.bytes < 1 or args.timeout <= 0:
            raise ValueError("--bytes and --timeout must be positive")
    except (ConfigError, ValueError, TypeError) as exc:
        print(f"fate-rdma site check: {exc}", file=sys.stderr)
        return 2
    if args.serve:
        stop = threading.Event()
        try:
            serve(cfg, party, stop)
        except KeyboardInterrupt:
            stop.set()
        except (OSError, FateRdmaError, ev.EasyVerbsError) as exc:
            in_use = "in use" in str(exc).lower() or getattr(exc, "errno", None) == errno.EADDRINUSE
            print(f"fate-rdma site check --serve: cannot answer checks as {party} at {cfg.endpoints[party]}: {exc}"
                  + (" (a job's endpoint holds the port while it runs)" if in_use else ""), file=sys.stderr)
            return 1
        return 0
    print(f"fate-rdma site check: {party} ({path}) checks {len(cfg.endpoints) - 1} peer(s)", flush=True)
    results = check(cfg, party, args.bytes, args.timeout, args.peer)
    failed: List[str] = []
    for r in results:
        print(r.line(), flush=True)
        if not r.ok:
            failed.append(r.party)
    print(f"{len(results) - len(failed)} of {len(results)} peers passed" + (f"; failed: {', '.join(failed)}"
                                                                             if failed else ""))
    return 1 if failed else 0
