"""The `fate-rdma` command: one subcommand per module.

Exit codes: 0 success; 1 the command ran and failed (verification mismatch, transfer error);
2 usage error (bad arguments); 130 interrupted (Ctrl-C, or SIGTERM for the commands that start jobs; eval
and wan report it themselves and exit 1).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import logging
import signal
import sys
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

#: the commands a site runs; each module offers add_arguments(parser) and run(args) -> exit code
SUBCOMMANDS: Dict[str, Tuple[str, str]] = {
    "doctor": ("fate_rdma.cli.doctor", "explain what this machine offers: providers, RDMA devices, ports, GIDs"),
    "hook": ("fate_rdma.cli.hook", "install the start-up hook that switches fate-rdma on in FATE task processes"),
    "launch": ("fate_rdma.cli.launch", "run a FATE launcher script with fate-rdma switched on"),
    "flow": ("fate_rdma.cli.flow", "fate-flow jobs: once-per-site setup/remove/check of dag.conf.extra.fate_rdma"),
    "secret": ("fate_rdma.cli.secret", "write a fresh federation secret for peer authentication (secret_file)"),
    "tls": ("fate_rdma.cli.tls", "make a federation CA and each party's TLS certificate and key (tls: true)"),
    "site": ("fate_rdma.cli.site", "a site's pieces from the federation's description (init); its peers reached "
                                   "and proven before any job (check)"),
    "exporter": ("fate_rdma.cli.exporter", "serve this site's fate-rdma metrics (metrics_dir) to Prometheus"),
    "top": ("fate_rdma.cli.top", "transfers per peer now, from the site's exporter: rates, bytes, errors"),
}

#: entry-point group through which other distributions add subcommands (the lab adds bench, demo, eval,
#: sweep, vm, wan). Each entry point names a module with HELP, add_arguments, run and, optionally,
#: STOPS_ITS_CHILDREN = True for a command that starts process groups of its own (SIGTERM then stops them
#: as Ctrl-C does, so that what they started is taken down with them instead of outliving a killed parent).
PLUGIN_GROUP = "fate_rdma.commands"


def plugin_commands() -> Dict[str, str]:
    """Subcommands other installed distributions offer: name -> module. Empty without them."""
    found: Dict[str, str] = {}
    for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        if ep.name not in SUBCOMMANDS:
            found[ep.name] = ep.value
    return dict(sorted(found.items()))


def commands() -> Dict[str, str]:
    """Every subcommand available here: name -> module."""
    out = {name: mod for name, (mod, _) in SUBCOMMANDS.items()}
    out.update(plugin_commands())
    return out


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
        epilog="Exit codes: 0 ok, 1 failed, 2 bad usage, 130 interrupted. Run 'fate-rdma COMMAND --help' for details. "
               "The lab (bench, demo, eval, sweep, vm, wan) adds its commands when installed (pip install -e ./lab).",
    )
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (mod, help_) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        importlib.import_module(mod).add_arguments(sp)
    for name, mod in plugin_commands().items():
        m = importlib.import_module(mod)
        sp = sub.add_parser(name, help=m.HELP, description=m.HELP)
        m.add_arguments(sp)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    module = importlib.import_module(commands()[args.command])
    if not getattr(module, "STOPS_ITS_CHILDREN", False):
        return int(module.run(args) or 0)
    try:
        with sigterm_as_interrupt():
            return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print(f"fate-rdma {args.command}: interrupted (what it started was stopped)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
