"""`fate-rdma demo`: move a GPT-2-sized buffer (124,439,808 float32, ~498 MB) between two processes.

The sender registers the weights, the receiver (a separate process) registers a destination MR;
the sender RDMA-WRITEs the bytes (a window of large WRITEs, the last one WRITE_WITH_IMM so the
receiver learns of completion from a completion event), and the receiver answers the crc32c of what
landed, which must equal the sender's. Prints time and throughput, labelled with the provider.
"""
from __future__ import annotations

import argparse
import time

import crc32c
import numpy as np

import easypyverbs as ev

GPT2_PARAMS = 124_439_808  # GPT-2 small, 148 tensors


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--provider", default="auto", choices=["auto", "soft", "pyverbs"], help="verbs provider (default auto)")
    p.add_argument("--params", type=int, default=GPT2_PARAMS, help="float32 parameters to move (default GPT-2 small)")
    p.add_argument("--msg-mib", type=int, default=64, help="size of one WRITE in MiB (capped by max_msg_sz)")
    p.add_argument("--window", type=int, default=8, help="WRITEs in flight")
    p.add_argument("--link", default=None, help="soft provider link model, e.g. rate=10gbit,rtt=20ms")


def run(args: argparse.Namespace) -> int:
    from ..bench.driver import PeerProcess, connect_verbs, stream_writes

    print(f"fate-rdma demo: generating {args.params:,} float32 parameters (GPT-2 small size) ...", flush=True)
    weights = np.random.default_rng(0).standard_normal(args.params, dtype=np.float32)
    nbytes = weights.nbytes
    expect = crc32c.crc32c(memoryview(weights).cast("B"))
    with ev.open_device(provider=args.provider, link=args.link) as ctx, PeerProcess() as peer:
        pd = ctx.alloc_pd()
        t_reg = time.perf_counter()
        src = pd.reg_mr(weights, ev.Access.LOCAL_WRITE)
        t_reg = time.perf_counter() - t_reg
        rc = connect_verbs(peer, ctx.provider, args.link, nbytes, src, recvs=1)
        msg = min(args.msg_mib << 20, ctx.max_msg_bytes, rc.qp.remote_info.max_msg_bytes)
        print(f"provider: {ctx.label}" + ("  [EMULATION: these are not RDMA figures]" if ctx.emulated else ""))
        secs = stream_writes(rc, src, rc.remote_mrs["dst"], nbytes, msg, window=args.window, imm=0xF00D,
                             src_offset_wraps=False)
        reply = peer.cmd({"cmd": "verify", "nbytes": nbytes, "timeout_s": 60})
        rc.close()
    ok = reply["crc32c"] == expect and reply["imm"] == 0xF00D
    print(f"moved {nbytes / 1e6:.1f} MB in {secs:.3f} s = {nbytes * 8 / secs / 1e9:.2f} Gbit/s "
          f"({-(-nbytes // msg)} WRITEs of {msg >> 20} MiB, window {args.window}, MR registration {t_reg * 1e3:.0f} ms)")
    print(f"verify: receiver crc32c {reply['crc32c']:#010x}, sender {expect:#010x}: {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1
