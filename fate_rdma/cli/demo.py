"""`fate-rdma demo`: move a GPT-2-sized buffer (124,439,808 float32, ~498 MB) between two processes.

1. easypyverbs: RDMA WRITEs of the buffer into the receiver's MR (the last one WRITE_WITH_IMM),
   verified by crc32c at the receiver.
2. the fate-rdma channel in both modes, fedrdma and fedrdma-e, to a receiving endpoint in another
   process, each verified by crc32c, next to a gRPC client stream of 4 MiB chunks (gRPC's best case)
   of the same bytes.
Every figure names the provider; the soft provider is an emulation and says so.
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
    p.add_argument("--msg-mib", type=int, default=64, help="size of one WRITE in MiB for the verbs part (capped by max_msg_sz)")
    p.add_argument("--window", type=int, default=8, help="WRITEs in flight for the verbs part")
    p.add_argument("--link", default=None, help="soft provider link model, e.g. rate=10gbit,rtt=20ms")
    p.add_argument("--skip-channel", action="store_true", help="only the verbs part")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bars (default: on a terminal)")


def _verbs(args: argparse.Namespace, weights: np.ndarray, expect: int) -> bool:
    from ..bench.driver import PeerProcess, connect_verbs, stream_writes

    nbytes = weights.nbytes
    with ev.open_device(provider=args.provider, link=args.link) as ctx, PeerProcess() as peer:
        pd = ctx.alloc_pd()
        t_reg = time.perf_counter()
        src = pd.reg_mr(weights, ev.Access.LOCAL_WRITE)
        t_reg = time.perf_counter() - t_reg
        rc = connect_verbs(peer, ctx.provider, args.link, nbytes, src, recvs=1)
        msg = min(args.msg_mib << 20, ctx.max_msg_bytes, rc.qp.remote_info.max_msg_bytes)
        print(f"[1] easypyverbs, provider: {ctx.label}" + ("  [EMULATION: not RDMA figures]" if ctx.emulated else ""))
        secs = stream_writes(rc, src, rc.remote_mrs["dst"], nbytes, msg, window=args.window, imm=0xF00D,
                             src_offset_wraps=False)
        reply = peer.cmd({"cmd": "verify", "nbytes": nbytes, "timeout_s": 60})
        rc.close()
    ok = reply["crc32c"] == expect and reply["imm"] == 0xF00D
    print(f"    moved {nbytes / 1e6:.1f} MB in {secs:.3f} s = {nbytes * 8 / secs / 1e9:.2f} Gbit/s "
          f"({-(-nbytes // msg)} WRITEs of {msg >> 20} MiB, window {args.window}, MR registration {t_reg * 1e3:.0f} ms)")
    print(f"    verify: receiver crc32c {reply['crc32c']:#010x}, sender {expect:#010x}: {'OK' if ok else 'MISMATCH'}")
    return ok


def _channel(args: argparse.Namespace, weights: np.ndarray, expect: int) -> bool:
    from ..bench.driver import PeerProcess
    from ..bench.report import table
    from ..bench.transfer import _grpc
    from ..channel import Endpoint
    from ..config import ChannelConfig
    from .progress import attach

    nbytes = weights.nbytes
    rows, ok_all = [], True
    provider = "soft" if args.link else args.provider
    print(f"[2] fate-rdma channel vs gRPC, {nbytes / 1e6:.1f} MB to another process" + (f", link model {args.link}" if args.link else ""))
    with PeerProcess(module="fate_rdma.bench.transfer_peer") as peer:
        g = _grpc(peer, weights.tobytes(), 1)
        rows.append({"method": "grpc_stream (4 MiB chunks)", "provider": "grpc over TCP", "seconds": g["grpc_stream"][0], "verified": "-"})
        for mode in ("fedrdma", "fedrdma-e"):
            cfg = ChannelConfig(mode=mode, slot_bytes=nbytes, provider=provider, soft_link=args.link)
            reply = peer.cmd({"cmd": "endpoint", "config": dict(cfg.__dict__), "record": True})
            with Endpoint(cfg) as ep:
                count = peer.cmd({"cmd": "mark"})["count"]
                ep.send(reply["address"], b"hello", {"warm-up": True}).result(60)
                t0 = time.perf_counter()
                fut = ep.send(reply["address"], weights, {"name": "gpt2.weights", "dtype": "float32", "params": args.params})
                attach(fut, mode, args.progress)
                info = fut.result(600)
                rec = peer.cmd({"cmd": "expect", "count": count + 2})["records"][-1]
                secs = time.perf_counter() - t0
                ok = rec["crc32c"] == expect and rec["nbytes"] == nbytes
                ok_all &= ok
                label = ep.ctx.label + (" [emulated]" if ep.ctx.emulated else "")
                rows.append({"method": f"{mode} (window {info['window']}, {info['chunks']} chunks)", "provider": label,
                             "seconds": secs, "verified": "OK" if ok else "MISMATCH"})
    base = rows[0]["seconds"]
    for r in rows:
        r["Gbit/s"] = round(nbytes * 8 / r["seconds"] / 1e9, 2)
        r["vs grpc"] = f"{base / r['seconds']:.1f}x"
        r["seconds"] = round(r["seconds"], 3)
    table(rows, ["method", "provider", "seconds", "Gbit/s", "vs grpc", "verified"])
    return ok_all


def run(args: argparse.Namespace) -> int:
    print(f"fate-rdma demo: generating {args.params:,} float32 parameters (GPT-2 small size) ...", flush=True)
    weights = np.random.default_rng(0).standard_normal(args.params, dtype=np.float32)
    expect = crc32c.crc32c(memoryview(weights).cast("B"))
    ok = _verbs(args, weights, expect)
    if not args.skip_channel:
        ok &= _channel(args, weights, expect)
    print("demo: all transfers verified" if ok else "demo: VERIFICATION FAILED")
    return 0 if ok else 1
