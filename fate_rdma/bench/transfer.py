"""Transfer bench: one payload moved by raw TCP, gRPC (client stream of 4 MiB chunks, and one unary
message), fedrdma and fedrdma-e (window 1 = the paper's stop-and-wait, and the automatic window).

Two processes on this machine; the receiver is a separate process. Scenarios: `loopback` (unshaped)
and the soft provider's link model at 10 Gbit/s / 20 ms RTT and 1 Gbit/s / 20 ms RTT. The link
model exists only inside the soft provider, so raw TCP and gRPC are measured on loopback only; the
link scenarios compare against the wire time (payload x 8 / rate). Every line names the provider
and whether it is emulated. Seconds are medians, end to end: until the receiver holds the verified
message. `extra_rss_bytes`: the receiver's peak RSS beyond what the method must hold: for fedrdma
and fedrdma-e, above the level before the receiving endpoint existed, less the payload (fedrdma's
destination) or the registered pool (fedrdma-e), so staging buffers and bookkeeping count; for raw
TCP and gRPC, above the level before the transfer, less the payload where gRPC allocates it.
With `--tls` every fedrdma/fedrdma-e row is measured again right after it with `tls: true` (mutual TLS
1.3 on the bootstrap and on the soft provider's data connections; on the same-host path only request
headers cross TLS, the payload is a local copy): the cost of TLS, beside the plain row of the same run.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any, Dict, List, Optional

import numpy as np

from ..channel import Endpoint
from ..config import ChannelConfig
from .driver import PeerProcess, RawTcp
from .report import emit, human_bytes, median, table

MiB = 1 << 20
#: loopback: the channel between two processes of this host (the soft provider's same-host path where it
#: works); loopback-tcp: the same, forced over loopback TCP as between hosts; link-*: the link model
SCENARIOS = {"loopback": None, "loopback-tcp": None, "link-10g-20ms": "rate=10gbit,rtt=20ms",
             "link-1g-20ms": "rate=1gbit,rtt=20ms"}
RATES = {"link-10g-20ms": 10e9, "link-1g-20ms": 1e9}
GRPC_CHUNK = 4 * MiB


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="256 MiB payload, 2 repetitions (about two minutes)")
    p.add_argument("--payload-mib", type=int, default=None, help="payload size in MiB (default 1024, quick 256)")
    p.add_argument("--reps", type=int, default=None, help="repetitions per point (default 3, quick 2)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma list of {', '.join(SCENARIOS)}")
    p.add_argument("--methods", default="raw_tcp,grpc_stream,grpc_unary,fedrdma,fedrdma-e", help="comma list of methods")
    p.add_argument("--windows", default="1,auto", help="windows to measure for fedrdma/fedrdma-e (default 1,auto)")
    p.add_argument("--checksum", default="crc32c", choices=["crc32c", "blake2b", "none"],
                   help="end-to-end checksum (default crc32c; blake2b: the keyed MAC, with a fresh secret for the two endpoints)")
    p.add_argument("--provider", default="soft", help="verbs provider on loopback (default soft; link scenarios are soft)")
    p.add_argument("--tls", action="store_true",
                   help="each fedrdma/fedrdma-e row once more with tls: true (mutual TLS on the bootstrap and the soft "
                        "provider's data connections; certificates from a throwaway CA): the cost of TLS beside it")


def _grpc(peer: PeerProcess, payload: bytes, reps: int) -> Dict[str, List[float]]:
    import grpc

    from .transfer_peer import GRPC_OPTIONS

    port = peer.cmd({"cmd": "grpc"})["port"]
    ident = lambda b: b  # noqa: E731
    out: Dict[str, List[float]] = {"grpc_stream": [], "grpc_unary": [], "rss_stream": [], "rss_unary": []}
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as ch:
        stream = ch.stream_unary("/bench.Bench/Stream", request_serializer=ident, response_deserializer=ident)
        unary = ch.unary_unary("/bench.Bench/Unary", request_serializer=ident, response_deserializer=ident)
        stream(iter([b"warm-up"]))
        unary(b"warm-up")
        count = peer.cmd({"cmd": "mark"})["count"]
        for rep in range(reps):
            for name, call in (("grpc_stream", lambda: stream((payload[i:i + GRPC_CHUNK] for i in range(0, len(payload), GRPC_CHUNK)))),
                               ("grpc_unary", lambda: unary(payload))):
                count = peer.cmd({"cmd": "mark"})["count"]
                t0 = time.perf_counter()
                call()
                reply = peer.cmd({"cmd": "expect", "count": count + 1})
                out[name].append(time.perf_counter() - t0)
                out["rss_" + name.split("_")[1]].append(max(0, reply["extra_rss_bytes"] - len(payload)))
    return out


def _channel(peer: PeerProcess, data: np.ndarray, cfg: ChannelConfig, reps: int) -> Dict[str, Any]:
    reply = peer.cmd({"cmd": "endpoint", "config": {k: v for k, v in cfg.__dict__.items()}})
    times, rss = [], []
    info: Dict[str, Any] = {}
    # tls: one certificate names both ends (_bench_tls); the receiver is known by its address
    names = {"name": "bench-sender", "party_names": {reply["address"]: "bench-receiver"}} if cfg.tls else {}
    with Endpoint(cfg, **names) as ep:
        count = peer.cmd({"cmd": "mark"})["count"]
        ep.send(reply["address"], b"warm-up").result(60)  # connects, probes the RTT
        peer.cmd({"cmd": "expect", "count": count + 1})
        path = getattr(ep.connect(reply["address"]).rcs[0].qp, "data_path", "verbs")
        for _ in range(reps):
            count = peer.cmd({"cmd": "mark"})["count"]
            t0 = time.perf_counter()
            fut = ep.send(reply["address"], data)
            info = fut.result(cfg.transfer_timeout_s)
            r = peer.cmd({"cmd": "expect", "count": count + 1})
            times.append(time.perf_counter() - t0)
            # above the receiver's level before its endpoint existed, less what the method must hold:
            # fedrdma its destination (the payload), fedrdma-e its registered pool
            held = data.nbytes if cfg.mode == "fedrdma" else r["pool_bytes"]
            rss.append(max(0, r["endpoint_rss_bytes"] - held))
        emulated, provider, label = ep.ctx.emulated, ep.ctx.provider, ep.ctx.label
    return {"times": times, "rss": rss, "window": info.get("window"), "chunks": info.get("chunks"),
            "emulated": emulated, "provider": provider, "label": label, "path": path}


def run(args: argparse.Namespace) -> int:
    nbytes = (args.payload_mib or (256 if args.quick else 1024)) * MiB
    reps = args.reps or (2 if args.quick else 3)
    methods = [m.strip() for m in args.methods.split(",")]
    windows = [w.strip() for w in args.windows.split(",")]
    print(f"fate-rdma bench transfer: payload {human_bytes(nbytes)}, {reps} repetitions, scenarios {args.scenarios}", flush=True)
    data = np.frombuffer(np.random.default_rng(0).bytes(nbytes), dtype=np.uint8)
    rows: List[Dict[str, Any]] = []
    tls_dir = tempfile.TemporaryDirectory(prefix="fate-rdma-bench-tls-") if args.tls else None
    tls_files = _bench_tls(tls_dir.name) if tls_dir is not None else None
    secret, secret_dir = None, None
    if args.checksum == "blake2b":  # the MAC is keyed per connection from the secret both endpoints prove (as demo does)
        from ..channel.auth import write_secret

        secret_dir = tempfile.TemporaryDirectory(prefix="fate-rdma-bench-")  # private (0700), removed with the object
        secret = os.path.join(secret_dir.name, "secret")
        write_secret(secret)

    def add(row: Dict[str, Any]) -> None:
        # the machine's 1-minute load average with every row: figures from a busy machine say so
        row = {"bench": "transfer", **row, "payload_bytes": nbytes, "loadavg_1m": round(os.getloadavg()[0], 2)}
        if row.get("seconds"):
            row["gbps"] = round(nbytes * 8 / row["seconds"] / 1e9, 3)
        rows.append(row)
        emit(row)

    with PeerProcess(module="fate_rdma.bench.transfer_peer") as peer:
        for scen in [s.strip() for s in args.scenarios.split(",")]:
            link = SCENARIOS[scen]
            if link is None and scen == "loopback-tcp" and "loopback" in args.scenarios:
                pass  # the raw TCP and gRPC baselines of "loopback" serve both
            elif link is None:
                if "raw_tcp" in methods:
                    raw = RawTcp(peer)
                    raw.stream(memoryview(data), 4 * MiB, nbytes, nbytes)  # warm-up
                    ts = []
                    for _ in range(reps):
                        peer.cmd({"cmd": "mark"})
                        ts.append(raw.stream(memoryview(data), 4 * MiB, nbytes, nbytes))
                    r = peer.cmd({"cmd": "peak"})
                    add({"scenario": scen, "method": "raw_tcp", "window": None, "provider": "tcp", "emulated": False,
                         "seconds": round(median(ts), 4), "extra_rss_bytes": r["extra_rss_bytes"], "chunks": None})
                    raw.close()
                if {"grpc_stream", "grpc_unary"} & set(methods):
                    g = _grpc(peer, data.tobytes(), reps)
                    for m in ("grpc_stream", "grpc_unary"):
                        if m in methods:
                            add({"scenario": scen, "method": m, "window": None, "provider": "grpc", "emulated": False,
                                 "seconds": round(median(g[m]), 4), "extra_rss_bytes": int(median(g["rss_" + m.split("_")[1]])),
                                 "chunks": -(-nbytes // GRPC_CHUNK) if m == "grpc_stream" else 1})
            else:
                add({"scenario": scen, "method": "wire_time", "window": None, "provider": "model", "emulated": True,
                     "seconds": round(nbytes * 8 / RATES[scen], 4), "extra_rss_bytes": None, "chunks": None})
            for mode in ("fedrdma", "fedrdma-e"):
                if mode not in methods:
                    continue
                for w, tls in [(w, tls) for w in windows for tls in ([False, True] if tls_files else [False])]:
                    cfg = ChannelConfig(mode=mode, window=int(w) if w != "auto" else "auto", slot_bytes=nbytes,
                                        provider="soft" if link else args.provider, soft_link=link,
                                        transfer_timeout_s=3600, no_progress_timeout_s=120, checksum=args.checksum,
                                        same_host=scen != "loopback-tcp", secret_file=secret,
                                        **(tls_files if tls else {}))
                    res = _channel(peer, data, cfg, reps)
                    add({"scenario": scen, "method": mode, "window": res["window"] if w != "auto" else f"auto ({res['window']})",
                         "provider": res["provider"], "emulated": res["emulated"], "label": res["label"],
                         "path": res["path"], "checksum": args.checksum, "tls": tls,
                         "seconds": round(median(res["times"]), 4),
                         "extra_rss_bytes": int(median(res["rss"])), "chunks": res["chunks"]})
    print()
    table([dict(r, rss=human_bytes(r["extra_rss_bytes"]) if r.get("extra_rss_bytes") is not None else "-") for r in rows],
          ["scenario", "method", "window", "provider", "path", "emulated", "checksum", "seconds", "gbps", "chunks", "rss",
           "loadavg_1m"])
    _verdicts(rows, nbytes)
    _tls_verdicts(rows)
    return 0


def _bench_tls(folder: str) -> Dict[str, Any]:
    """ChannelConfig keys for tls: true, from a throwaway CA: one certificate naming both ends."""
    from ..cli.tls import make_certificates

    f = make_certificates(folder, ["bench-sender+bench-receiver"])["bench-sender"]
    return {"tls": True, "tls_cert": f.cert, "tls_key": f.key, "tls_ca": f.ca}


def _tls_verdicts(rows: List[Dict[str, Any]]) -> None:
    for r in rows:
        if not r.get("tls"):
            continue
        plain = next((p for p in rows if p.get("tls") is False and p["scenario"] == r["scenario"]
                      and p["method"] == r["method"] and str(p["window"])[:4] == str(r["window"])[:4]), None)
        if plain:
            emu = " (soft provider: emulated verbs over TCP, not RDMA)" if r["emulated"] else ""
            print(f"tls cost{emu}: {r['scenario']} {r['method']} window {r['window']}: {plain['seconds']:.3f} s plain "
                  f"({plain.get('gbps')} Gbit/s, {plain['path']}) -> {r['seconds']:.3f} s with TLS ({r.get('gbps')} "
                  f"Gbit/s, {r['path']}): {100 * (r['seconds'] / plain['seconds'] - 1):+.0f}% time")


def _verdicts(rows: List[Dict[str, Any]], nbytes: int) -> None:
    def get(scen: str, method: str, auto: Optional[bool] = None) -> Optional[Dict[str, Any]]:
        for r in rows:
            if r["scenario"] == scen and r["method"] == method:
                if auto is None or str(r["window"]).startswith("auto") == auto:
                    return r
        return None

    print()
    e, raw, gs = get("loopback", "fedrdma-e", True), get("loopback", "raw_tcp"), get("loopback", "grpc_stream")
    if e and raw and gs:
        # Soft-RoCE (rxe) is real verbs but no RDMA hardware: its label says so, never "RDMA"
        kind = "emulated" if e["emulated"] else ("RDMA" if e["label"].startswith("pyverbs") else e["label"])
        print(f"loopback ({kind}): fedrdma-e / raw TCP throughput = "
              f"{raw['seconds'] / e['seconds']:.2f} (target >= 0.8); fedrdma-e / gRPC stream = {gs['seconds'] / e['seconds']:.2f} (target >= 2)")
    t = get("loopback-tcp", "fedrdma-e", True)
    if e and raw and t:  # the two paths, each against raw TCP of the same run, never mixed in one ratio
        print(f"same host, {e.get('path')}: fedrdma-e / raw TCP throughput = {raw['seconds'] / e['seconds']:.2f} "
              f"(target >= 2); over loopback TCP (as between hosts): {raw['seconds'] / t['seconds']:.2f} (target >= 0.95)")
    w1, auto = get("link-10g-20ms", "fedrdma-e", False), get("link-10g-20ms", "fedrdma-e", True)
    if w1 and auto:
        wire = nbytes * 8 / 10e9
        print(f"link 10 Gbit/s 20 ms (emulated): window 1 {w1['seconds']:.2f} s (paper's stop-and-wait: 6.0 s for 1 GiB); "
              f"auto window {auto['seconds']:.2f} s = {auto['seconds'] / wire:.2f} x wire time {wire:.2f} s (target <= 1.5)")
    for r in rows:
        if r["method"] in ("fedrdma", "fedrdma-e") and r["scenario"] == "loopback":
            print(f"memory: {r['method']} window {r['window']}: {human_bytes(r['extra_rss_bytes'])} extra at the receiver")
