"""FedAvg-style weight exchange on real FATE (guest + host + arbiter, FATE's multiprocess launcher).

Each client puts its weights (float64 arrays of GPT-2-like shapes, `--params` in all) to the arbiter,
the arbiter averages them and sends the average back, for `--rounds` rounds. Each party writes the
sha256 of its final weights and its communication seconds per round to `--out`.

    python examples/fedavg_weights/fedavg.py --parties guest:9999 host:10000 arbiter:10000 --out fedavg_out
    fate-rdma launch --conf examples/fedavg_weights/fate_rdma.yaml examples/fedavg_weights/fedavg.py ...
"""
# (no `from __future__ import annotations`: FATE's argument parser reads the dataclass types)
import hashlib
import json
import os
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Args:
    params: int = field(default=2_000_000)
    rounds: int = field(default=2)
    out: str = field(default="fedavg_out")
    seed: int = field(default=0)


def weights(params: int, seed: int):
    rng = np.random.default_rng(seed)
    shapes, left = [], params
    while left > 0:  # a few big matrices and small vectors, like a transformer's state dict
        n = min(left, 768 * 2304 if len(shapes) % 3 == 0 else 768)
        shapes.append(n)
        left -= n
    return [rng.standard_normal(n) for n in shapes]


def run(ctx):
    from fate.arch.launchers.argparser import HfArgumentParser

    args = HfArgumentParser(Args).parse_args_into_dataclasses(return_remaining_strings=True)[0]
    me = ctx.local.role
    comm = []
    if me in ("guest", "host"):
        w = weights(args.params, args.seed + (0 if me == "guest" else 1))
        for r, rctx in ctx.ctxs_range(args.rounds):
            t0 = time.perf_counter()
            rctx.arbiter.put("weights", w)
            w = rctx.arbiter.get("avg")
            comm.append(time.perf_counter() - t0)
            w = [x * 1.0001 + 0.001 for x in w]  # "local training"
    else:
        for r, rctx in ctx.ctxs_range(args.rounds):
            t0 = time.perf_counter()
            ws = rctx.guest.get("weights"), rctx.hosts[0].get("weights")
            avg = [(a + b) / 2 for a, b in zip(*ws)]
            rctx.guest.put("avg", avg)
            rctx.hosts[0].put("avg", avg)
            comm.append(time.perf_counter() - t0)
            w = avg
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(x).tobytes() for x in w)).hexdigest()
    fed = ctx.federation
    rdma = getattr(fed, "fate_rdma", None)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{me}.json"), "w") as f:
        json.dump({"role": me, "sha256": digest, "comm_seconds": comm,
                   "rdma": rdma.stats if rdma else None, "label": rdma.endpoint.label if rdma else "FATE"}, f)


if __name__ == "__main__":
    from fate.arch.launchers.multiprocess_launcher import launch

    launch(run, extra_args_desc=[Args])
