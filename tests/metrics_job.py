"""A FATE launcher job for tests/test_prometheus.py: the guest and the host each upload a float32 array of known
size to the arbiter, which sends each of them the mean back: four objects over fate-rdma (all above the
channel's threshold), whose sizes the test compares with what Prometheus scraped."""
# (no `from __future__ import annotations`: FATE's argument parser reads the dataclass types)
from dataclasses import dataclass, field

import numpy as np

#: elements of each party's upload: 1.5 and 2.5 Mi float32 (6 and 10 MiB)
UPLOAD = {"guest": 3 << 19, "host": 5 << 19}


@dataclass
class Args:
    rounds: int = field(default=1)


def run(ctx):
    from fate.arch.launchers.argparser import HfArgumentParser

    args = HfArgumentParser(Args).parse_args_into_dataclasses(return_remaining_strings=True)[0]
    me = ctx.local.role
    for r in range(args.rounds):
        if me == "arbiter":
            g, h = ctx.guest.get(f"w{r}"), ctx.hosts[0].get(f"w{r}")
            mean = (g + h[: g.size]) / 2
            ctx.guest.put(f"avg{r}", mean)
            ctx.hosts[0].put(f"avg{r}", mean)
        else:
            ctx.arbiter.put(f"w{r}", np.full(UPLOAD[me], r + 1, dtype=np.float32))
            got = ctx.arbiter.get(f"avg{r}")
            assert got.size == UPLOAD["guest"], got.size


if __name__ == "__main__":
    from fate.arch.launchers.multiprocess_launcher import launch

    launch(run, extra_args_desc=[Args])
