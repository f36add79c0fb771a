"""`fate-rdma hook install|uninstall|status`: the start-up hook that lets FATE task processes pick up
fate-rdma from their configuration (a `.pth` file in this environment's site-packages)."""
from __future__ import annotations

import argparse
import os


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["install", "uninstall", "status"],
                   help="install: write fate_rdma_hook.pth into the site-packages of the Python that runs this "
                        "command (status shows the path; inert until a fate_rdma configuration is present); "
                        "uninstall: remove it (`fate-rdma flow remove` does too); status: is it there, and "
                        "FATE_RDMA_CONF")


def run(args: argparse.Namespace) -> int:
    from ..federation.hook import PTH_LINE, pth_path

    path = pth_path()
    if args.action == "install":
        with open(path, "w") as f:
            f.write(PTH_LINE)
        print(f"installed {path}: FATE processes of this environment pick up fate-rdma when configured")
    elif args.action == "uninstall":
        if os.path.exists(path):
            os.remove(path)
            print(f"removed {path}")
        else:
            print("no hook installed")
    else:
        print(f"hook {'installed at ' + path if os.path.exists(path) else 'not installed'}")
        conf = os.environ.get("FATE_RDMA_CONF")
        print(f"FATE_RDMA_CONF={conf}" if conf
              else "FATE_RDMA_CONF not set (a fate-flow task conf may still carry a fate_rdma section)")
    return 0
