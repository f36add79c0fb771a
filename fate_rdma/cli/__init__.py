"""The `fate-rdma` command: one subcommand per module.

Exit codes: 0 success; 1 the command ran and failed (verification mismatch, transfer error);
2 usage error (bad arguments); 130 interrupted (Ctrl-C, or SIGTERM for the commands that start jobs; eval
and wan report it themselves and exit 1).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import signal
import sys
import threading
from typing import Any, Iterator, List, Optional

SUBCOMMANDS = {
    "doctor": ("fate_rdma.cli.doctor", "explain what this machine offers: providers, RDMA devices, ports, GIDs"),
    "demo": ("fate_rdma.cli.demo", "the main job: GPT-2 LoRA FedAvg with FATE-LLM over fate-rdma, FATE's own path "
             "against fate-rdma, then a GPT-2-sized transfer, each verified"),
    "bench": ("fate_rdma.cli.bench", "benchmarks that print figures (JSON lines + table): verbs, transfer, latency, "
              "fate, timeline, regrant"),
    "hook": ("fate_rdma.cli.hook", "install the start-up hook that switches fate-rdma on in FATE task processes"),
    "launch": ("fate_rdma.cli.launch", "run a FATE launcher script with fate-rdma switched on"),
    "flow": ("fate_rdma.cli.flow", "fate-flow jobs: once-per-site setup/remove/check of dag.conf.extra.fate_rdma"),
    "secret": ("fate_rdma.cli.secret", "write a fresh federation secret for peer authentication (secret_file)"),
    "tls": ("fate_rdma.cli.tls", "make a federation CA and each party's TLS certificate and key (tls: true)"),
    "vm": ("fate_rdma.cli.vm", "run a command in a qemu VM with a Soft-RoCE (rxe0) RDMA device: real verbs, no NIC"),
    "eval": ("fate_rdma.cli.eval", "evaluation on the WAN testbed: link studies, FATE's own path, stress, fairness, system cost (JSONL, table, plot)"),
    "wan": ("fate_rdma.cli.wan", "a WAN testbed with real packets: sites as namespaces, shaped links (up/down/status/check)"),
    "sweep": ("fate_rdma.cli.sweep", "LoRA rank sweep with real GPT-2 FedAvg training: loss, compute, communication per rank"),
}


#: commands that start process groups of their own (FATE jobs, peers, testbeds): SIGTERM stops them as Ctrl-C
#: does, so that what they started is taken down with them instead of outliving a killed parent
STOPS_ITS_CHILDREN = {"bench", "demo", "sweep", "eval", "wan"}


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt in the main thread (as Ctrl-C), so `finally`
    blocks and `except BaseException` clean-ups run; the previous handler comes back after it. Off the
    main thread (where Python cannot install handlers) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupted(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupted)
    try:
        yield
    finally:  # (None: a handler installed from C, which Python cannot put back: the default then)
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fate-rdma",
        description="fate-rdma: model weights between FATE parties over RDMA (or the soft verbs emulation).",
        epilog="Exit codes: 0 ok, 1 failed, 2 bad usage. Run 'fate-rdma COMMAND --help' for details.",
    )
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (mod, help_) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        importlib.import_module(mod).add_arguments(sp)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    if args.command not in STOPS_ITS_CHILDREN:
        return int(module.run(args) or 0)
    try:
        with sigterm_as_interrupt():
            return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print(f"fate-rdma {args.command}: interrupted (what it started was stopped)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
