"""WRITE bandwidth per message size on each provider, against raw TCP measured in the same run.

Two processes on this machine: this one posts RDMA WRITEs (a window in flight) into a peer's MR;
the baseline sends the same bytes with sendall/recv_into over one TCP connection. Medians of
several repetitions, interleaved so both see the same machine. The soft provider is an emulation
over TCP, and every line says so (`emulated: true`); `path` says how its payloads moved (the
same-host copy, or TCP: `--soft-path tcp`, as between hosts). `msgs_per_s`: messages completed per
second; small messages (4 KiB, 64 KiB) measure per-message cost, and their rate is compared with raw
TCP sending the same messages (one sendall each) in the same run.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Dict, List

import numpy as np

import easypyverbs as ev

from fate_rdma_lab.bench.driver import PeerProcess, RawTcp, connect_verbs, stream_writes
from fate_rdma_lab.bench.report import emit, human_bytes, median, parse_size, table

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]
SMALL = [4 * KiB, 64 * KiB]  # message rates, not bandwidth
SAME_HOST_ENV = "EASYPYVERBS_SOFT_SAME_HOST"  # easypyverbs.providers.soft.samehost.enabled_by_env


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="fewer bytes and repetitions (under a minute)")
    p.add_argument("--providers", default="auto-all", help="comma list of soft,pyverbs (default: every available one)")
    p.add_argument("--reps", type=int, default=None, help="repetitions per point (default 5, quick 3)")
    p.add_argument("--window", type=int, default=32, help="WRITEs in flight (default 32)")
    p.add_argument("--link", default=None, help="soft provider link model, e.g. rate=10gbit,rtt=20ms")
    p.add_argument("--sizes", default=None, help="message sizes, e.g. 4K,1M,4M (default 4K..64M)")
    p.add_argument("--max-bytes", type=int, default=None, help="cap on bytes moved per repetition")
    p.add_argument("--soft-path", choices=["auto", "tcp"], default="auto",
                   help="soft provider data path: auto (same-host copy where both ends share this host) or tcp "
                        "(over loopback TCP, as between hosts)")


def _parse_size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise SystemExit(f"fate-rdma bench verbs: {exc}") from None


def _volume(size: int, quick: bool, cap: "int | None" = None) -> int:
    lo, hi = (16 * MiB, 128 * MiB) if quick else (64 * MiB, 512 * MiB)
    vol = max(lo, min(hi, size * 64))
    return max(size, min(vol, cap)) if cap else vol


def providers(spec: str) -> List[str]:
    if spec != "auto-all":
        return [p.strip() for p in spec.split(",") if p.strip()]
    ok, _, devices = ev.device.pyverbs_status()
    return ["soft"] + (["pyverbs"] if ok and devices else [])


def run(args: argparse.Namespace) -> int:
    if args.soft_path != "tcp":
        return _run(args)
    # the peer process opens its device with the default path: switch the same-host path off in the
    # environment it inherits (and back for this process's later work)
    saved = os.environ.get(SAME_HOST_ENV)
    os.environ[SAME_HOST_ENV] = "off"
    try:
        return _run(args)
    finally:
        if saved is None:
            os.environ.pop(SAME_HOST_ENV, None)
        else:
            os.environ[SAME_HOST_ENV] = saved


def _run(args: argparse.Namespace) -> int:
    reps = args.reps or (3 if args.quick else 5)
    sizes = [_parse_size(x) for x in args.sizes.split(",")] if args.sizes else SIZES
    src_buf = np.random.default_rng(0).integers(0, 256, max(sizes), dtype=np.uint8)
    # figures from a busy machine say so: the load average at the start and with every row
    print(f"fate-rdma bench verbs: sizes {','.join(human_bytes(z) for z in sizes)}, {reps} repetitions, window "
          f"{args.window}, soft path {args.soft_path}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
          flush=True)
    rows: List[Dict[str, Any]] = []
    samples: Dict[Any, List[float]] = {}
    with PeerProcess() as peer:
        raw = RawTcp(peer)
        for prov in providers(args.providers):
            soft = {"link": args.link, **({"same_host": False} if args.soft_path == "tcp" else {})} if prov == "soft" else {}
            ctx = ev.open_device(provider=prov, **soft)
            with ctx:
                pd = ctx.alloc_pd()
                src = pd.reg_mr(src_buf, ev.Access.LOCAL_WRITE)
                rc = connect_verbs(peer, prov, args.link if prov == "soft" else None, max(sizes), src)
                remote = rc.remote_mrs["dst"]
                # never post above max_msg_sz (rxe: 8 MiB): such sizes are reported as skipped, not split
                limit = min(ctx.max_msg_bytes, rc.qp.remote_info.max_msg_bytes if rc.qp.remote_info else ctx.max_msg_bytes)
                prov_sizes = [z for z in sizes if z <= limit]
                for z in sizes:
                    if z > limit:
                        emit({"bench": "verbs", "method": "write", "provider": prov, "msg_bytes": z, "skipped":
                              f"above {ctx.label}'s max_msg_sz of {limit} bytes"})
                for rep in range(reps + 1):  # rep 0 warms up connections, caches and page tables
                    for size in prov_sizes:
                        vol = _volume(size, args.quick, args.max_bytes)
                        if len(samples.get(("raw_tcp", "tcp", size), [])) < reps:
                            dt = raw.stream(src_buf.data, size, vol, max(sizes))
                            if rep:
                                samples.setdefault(("raw_tcp", "tcp", size), []).append(vol * 8 / dt / 1e9)
                        dt = stream_writes(rc, src, remote, vol, size, window=args.window)
                        if rep:
                            samples.setdefault(("write", prov, size), []).append(vol * 8 / dt / 1e9)
                path = getattr(rc.qp, "data_path", "verbs")
                rc.close()
                emulated, label = ctx.emulated, ctx.label
            for size in prov_sizes:
                for method, pname, emu, lab, how in (("raw_tcp", "tcp", False, "kernel TCP sendall/recv_into", "tcp"),
                                                      ("write", prov, emulated, label, path)):
                    key = (method, pname, size)
                    if method == "raw_tcp" and any(r["method"] == "raw_tcp" and r["msg_bytes"] == size for r in rows):
                        continue
                    g = samples[key]
                    row = {"bench": "verbs", "method": method, "provider": pname, "emulated": emu, "label": lab,
                           "path": how, "msg_bytes": size, "msgs_per_s": round(median(g) * 1e9 / 8 / size),
                           "gbps": round(median(g), 3), "gbps_min": round(min(g), 3),
                           "gbps_max": round(max(g), 3), "reps": len(g), "bytes_per_rep": _volume(size, args.quick, args.max_bytes),
                           "link": args.link or "loopback", "loadavg_1m": round(os.getloadavg()[0], 2)}
                    rows.append(row)
                    emit(row)
            for size in prov_sizes:
                w = median(samples[("write", prov, size)])
                t = median(samples[("raw_tcp", "tcp", size)])
                row = {"bench": "verbs", "method": "ratio", "provider": prov, "emulated": emulated, "label": label,
                       "path": path, "msg_bytes": size, "write_over_raw_tcp": round(w / t, 3),
                       "write_msgs_per_s": round(w * 1e9 / 8 / size), "raw_tcp_msgs_per_s": round(t * 1e9 / 8 / size)}
                emit(row)
                rows.append(row)
    print()
    table([dict(r, msg=human_bytes(r["msg_bytes"])) for r in rows if r["method"] != "ratio"],
          ["method", "provider", "path", "emulated", "msg", "msgs_per_s", "gbps", "gbps_min", "gbps_max", "reps",
           "loadavg_1m"])
    print()
    for r in rows:
        if r["method"] == "ratio" and r["msg_bytes"] in SMALL:
            emu_note = ", emulated verbs" if r["emulated"] else ""
            print(f"small messages: {r['provider']} ({r['path']}{emu_note}) WRITE of {human_bytes(r['msg_bytes'])}, window "
                  f"{args.window}: {r['write_msgs_per_s']:,} messages/s; raw TCP (one sendall each) "
                  f"{r['raw_tcp_msgs_per_s']:,} messages/s; ratio {r['write_over_raw_tcp']:.2f}")
    for r in rows:
        if r["method"] == "ratio" and r["msg_bytes"] == 4 * MiB:
            verdict = "met" if r["write_over_raw_tcp"] >= 0.8 else "NOT met"
            # Soft-RoCE (rxe) is real verbs but not RDMA hardware: its label says so
            kind = "emulated, not RDMA" if r["emulated"] else ("real RDMA" if r["label"].startswith("pyverbs") else r["label"])
            if r["emulated"] and r["path"] != "tcp":
                # shared memory against loopback TCP: not the between-sites figure the target is about
                print(f"target: {r['provider']} ({kind}) WRITE of 4 MiB messages >= 0.8 x raw TCP: not judged on the "
                      f"{r['path']} path ({r['write_over_raw_tcp']:.2f} x raw loopback TCP); `--soft-path tcp` measures "
                      f"it as between hosts")
                continue
            print(f"target: {r['provider']} ({kind}, path {r['path']}) WRITE of 4 MiB messages >= 0.8 x raw TCP in the "
                  f"same run: ratio {r['write_over_raw_tcp']:.2f} ({verdict})")
    return 0
