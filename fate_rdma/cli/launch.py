"""`fate-rdma launch --conf FILE SCRIPT [ARGS...]`: run a FATE launcher script (e.g. one using
fate.arch.launchers.multiprocess_launcher) with fate-rdma switched on for every party process."""
from __future__ import annotations

import argparse
import os
import runpy
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conf", required=True, help="YAML/JSON file with a fate_rdma section (see conf/fate_rdma_launcher.yaml)")
    p.add_argument("script", help="the Python script to run")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")


def run(args: argparse.Namespace) -> int:
    from ..federation.config import RdmaFederationConfig, load_section

    section = load_section(os.path.abspath(args.conf))
    if section is None:
        print(f"fate-rdma launch: {args.conf} has no fate_rdma section", file=sys.stderr)
        return 2
    RdmaFederationConfig.from_section(section)  # fail early on a bad configuration
    from ..federation.hook import pth_path

    if not os.path.exists(pth_path()):
        print("fate-rdma launch: the start-up hook is not installed in this environment, so FATE's party "
              "processes would not see fate-rdma; run `fate-rdma hook install` first", file=sys.stderr)
        return 2
    os.environ["FATE_RDMA_CONF"] = os.path.abspath(args.conf)  # reaches the spawned party processes
    from ..federation.hook import install_import_hook

    install_import_hook()
    sys.argv = [args.script] + list(args.script_args)
    runpy.run_path(args.script, run_name="__main__")
    return 0
