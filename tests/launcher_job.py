"""A FATE launcher job for tests/test_launcher.py in which one party never reports to the launcher.

--dies host: the host ends its process (exit code 3) as its job begins, while the guest and the arbiter
wait to get an object from it. --dies none: the guest and the host wait to get an object from the
arbiter, which sends it (the test takes the arbiter's fate-rdma port, so its federation fails to start and
it never gets that far). Nothing here ends a wait but the launcher.
"""
# (no `from __future__ import annotations`: FATE's argument parser reads the dataclass types)
import os
from dataclasses import dataclass, field


@dataclass
class Args:
    dies: str = field(default="host")


def run(ctx):
    from fate.arch.launchers.argparser import HfArgumentParser

    args = HfArgumentParser(Args).parse_args_into_dataclasses(return_remaining_strings=True)[0]
    me = ctx.local.role
    if args.dies == "host":
        if me == "host":
            os._exit(3)
        ctx.hosts[0].get("never")
    elif me == "arbiter":
        ctx.guest.put("x", 1)
        ctx.hosts[0].put("x", 1)
    else:
        ctx.arbiter.get("x")


if __name__ == "__main__":
    from fate.arch.launchers.multiprocess_launcher import launch

    launch(run, extra_args_desc=[Args])
