"""`fate-rdma exporter --dir DIR`: the site's Prometheus exporter (one long-lived process per site).

The site's fate-rdma processes (FATE tasks) write their metrics into DIR when the site file sets
`metrics_dir: DIR`; this process serves their sum on http://LISTEN/metrics for Prometheus to scrape, keeps
what ended tasks counted, and drops their live gauges (fate_rdma/exporter.py). Run it on the tasks' host, as
a user that can write DIR (deploy/metrics/fate-rdma-exporter.service). docs/operations.md#metrics lists the
metrics and a few PromQL queries. Stops on Ctrl-C or SIGTERM (exit 0); exit 2 on bad usage, 1 when it cannot
listen.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading

DEFAULT_LISTEN = "127.0.0.1:9464"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", required=True, help="the site's metrics_dir (made if missing)")
    p.add_argument("--listen", default=DEFAULT_LISTEN,
                   help=f"host:port to serve /metrics on (default {DEFAULT_LISTEN}; port 0: any free port, printed)")


def parse_listen(text: str) -> "tuple[str, int]":
    host, _, port = text.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--listen must be host:port, got {text!r}")
    return host, int(port)


def run(args: argparse.Namespace) -> int:
    from .. import exporter
    from . import sigterm_as_interrupt

    try:
        host, port = parse_listen(args.listen)
    except ValueError as exc:
        print(f"fate-rdma exporter: {exc}", file=sys.stderr)
        return 2
    try:
        os.makedirs(args.dir, mode=0o755, exist_ok=True)
        server, url = exporter.serve(os.path.abspath(args.dir), host, port)
    except OSError as exc:
        print(f"fate-rdma exporter: cannot serve on {args.listen} from {args.dir}: {exc}", file=sys.stderr)
        return 1
    print(f"fate-rdma exporter: serving the metrics of {os.path.abspath(args.dir)} on {url}", flush=True)
    try:
        with sigterm_as_interrupt():
            threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
    print("fate-rdma exporter: stopped", flush=True)
    return 0
