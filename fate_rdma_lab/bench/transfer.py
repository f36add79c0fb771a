"""Transfer bench: one payload moved by raw TCP, gRPC, Mooncake TE, fedrdma and fedrdma-e, with CPU per GB.

gRPC: a client stream of 4 MiB chunks, and one unary message; fedrdma and fedrdma-e: window 1 (the
paper's stop-and-wait) and the automatic window.

Two processes on this machine; the receiver is a separate process. Scenarios: `loopback` (unshaped)
and the soft provider's link model at 10 Gbit/s / 20 ms RTT and 1 Gbit/s / 20 ms RTT. The link
model exists only inside the soft provider, so raw TCP, gRPC and Mooncake are measured on loopback only; the
link scenarios compare against the wire time (payload x 8 / rate). Every line names the provider
and whether it is emulated. Seconds are medians, end to end: until the receiver holds the verified
message. `extra_rss_bytes`: the receiver's peak RSS beyond what the method must hold: for fedrdma
and fedrdma-e, above the level before the receiving endpoint existed, less the payload (fedrdma's
destination) or the registered pool (fedrdma-e), so staging buffers and bookkeeping count; for raw
TCP and gRPC, above the level before the transfer, less the payload where gRPC allocates it.
With `--tls` every fedrdma/fedrdma-e row is measured again right after it with `tls: true` (mutual TLS
1.3 on the bootstrap and on the soft provider's data connections; on the same-host path only request
headers cross TLS, the payload is a local copy): the cost of TLS, beside the plain row of the same run.

`mooncake`, `mooncake_batch`: Mooncake Transfer Engine's TCP transport (P2PHANDSHAKE, no etcd), one
sync write and one batch of chunk-sized async writes, each side in its own process (mooncake.py);
with the `mooncake` extra missing its rows say so and how to install it. `cpu_send_s_per_gb`,
`cpu_recv_s_per_gb`: CPU seconds (user + system, every thread) of the sending and the receiving
process over the measured transfer, per GB moved (medians): what the method costs the two hosts,
which wall time on a shared machine hides (a method that busy-polls spends CPU while it waits).
`raw_tcp_checked`: raw TCP once more with the channel's check (`--checksum`: crc32c or xxh3) done as cheaply
as Python can, each piece digested on both sides by the thread that moves it (checked_tcp.py): what the
check costs on this machine, a baseline for a channel row that pays for it too. `shm_copy`,
`shm_copy_checked`: the same host's cheapest move, one copy out of the sender's shared memory (memfd) by the
receiver's copy threads, without and with that check (checked_shm.py): what bounds the same-host path here.
The raw TCP, gRPC, Mooncake and copy rows run once, under the first loopback scenario asked for. With raw_tcp
among the methods, every fedrdma/fedrdma-e transfer on loopback is paired with a raw TCP transfer of the
same payload, run right before it in odd repetitions and right after it in even ones (each method's
transfer follows the other's equally often; so are the checked and copy baselines' transfers; not with
`--unpaired`), and its row's `x_raw_tcp` is the
median of those pairs' throughput ratios: the verdicts print it beside the ratio against the raw TCP
row, since a shared machine's speed drifts between one row and the next. On loopback the channel's
warm-up sends the whole payload, as raw TCP's does, so neither's measured transfers fault in receive
memory; a first transfer's passing growth (a slot grown for it) is not in `extra_rss_bytes`.
With `--puts copy,overlap` every fedrdma-e row is measured again as a buffered put of the FATE wrapper
sends it: the payload copied (into recycled or, `--put-memory fresh`, new memory) and then sent, or
copied back to front while the chunks already copied go; seconds from the copy's start. `--source`: the
sender's payload in shared memory (default: a memfd, as the FATE wrapper's put copies, which the soft
provider's same-host path reads through a mapping) or private memory (read with process_vm_readv); every
fedrdma row names it.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from fate_rdma.channel import Endpoint
from easypyverbs.buffers import shared_array

from fate_rdma.channel.buffers import copy_into, fresh
from fate_rdma.channel.checksum import block_digest
from fate_rdma.channel.transfer import Fill
from fate_rdma import metrics
from fate_rdma.config import ChannelConfig
from fate_rdma.protocol.integrity import BLOCK_BYTES
from fate_rdma_lab.bench import checked_shm, mooncake
from fate_rdma_lab.bench.baselines import PAYLOAD_SEED, pair as pair_raw, paired, run_baselines
from fate_rdma_lab.bench.cpu import ceiling as cpu_ceiling, cpu_s, per_gb, usable_cores
from fate_rdma_lab.bench.driver import PeerProcess
from fate_rdma_lab.bench.report import emit, figure_tag as tag, human_bytes, median, table

MiB = 1 << 20
#: loopback: the channel between two processes of this host (the soft provider's same-host path where it
#: works); loopback-tcp: the same, forced over loopback TCP as between hosts; link-*: the link model
SCENARIOS = {"loopback": None, "loopback-tcp": None, "link-10g-20ms": "rate=10gbit,rtt=20ms",
             "link-1g-20ms": "rate=1gbit,rtt=20ms"}
RATES = {"link-10g-20ms": 10e9, "link-1g-20ms": 1e9}
PUT_LABELS = {"copy": "copy, then send", "overlap": "copy overlapped"}
METHODS = ["raw_tcp", "raw_tcp_checked", "shm_copy", "shm_copy_checked", "grpc_stream", "grpc_unary", "mooncake", "mooncake_batch", "fedrdma", "fedrdma-e"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="256 MiB payload, 3 repetitions (a median of three, as every verdict; about three minutes)")
    p.add_argument("--payload-mib", type=int, default=None, help="payload size in MiB (default 1024, quick 256)")
    p.add_argument("--reps", type=int, default=None, help="repetitions per point (default 3, quick too)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma list of {', '.join(SCENARIOS)} (default all). loopback: two processes of this host, the "
                        f"soft provider on its same-host path (shared memory, not a network); loopback-tcp: the same "
                        f"over loopback TCP, as between hosts; link-*: the soft provider's link model (rate, RTT)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma list of methods (default all; mooncake and mooncake_batch need the mooncake extra: "
                        "pip install -e './lab[mooncake]', and say so where it is missing)")
    p.add_argument("--windows", default="1,auto", help="windows to measure for fedrdma/fedrdma-e (default 1,auto)")
    p.add_argument("--checksum", default="blake3", choices=["blake3", "blake2b", "xxh3", "crc32c", "none"],
                   help="end-to-end checksum (default blake3: what checksum auto means between sites, a MAC under "
                        "each connection's session key, with a fresh secret for the two endpoints; blake2b: the "
                        "same with BLAKE2b; xxh3: an XXH3-128 "
                        "tag against accidents, what auto means on an unauthenticated loopback endpoint; crc32c: 32 "
                        "bits; none: nothing, as raw TCP checks nothing end to end). raw_tcp_checked pays the same "
                        "check, so that the channel's rows compare with a baseline that does")
    p.add_argument("--provider", default="soft", help="verbs provider on loopback (default soft; link scenarios are soft)")
    p.add_argument("--puts", default="",
                   help="comma list of copy, overlap: each fedrdma-e row once more as a buffered put makes it (what "
                        "the FATE wrapper does with arrays the caller may change): copy = copy the payload, then send "
                        "the copy; overlap = the copy runs back to front while the chunks already copied go (transfer.Fill)")
    p.add_argument("--put-memory", default="warm", choices=["warm", "fresh"],
                   help="the buffered put's copy goes into recycled memory (warm, default: later rounds) or into fresh "
                        "memory each time (fresh: a job's first round, page faults included)")
    p.add_argument("--source", default="shared", choices=["shared", "private"],
                   help="the sender's payload (and a put's copy) in shared memory (shared, default: a memfd, as the "
                        "FATE wrapper's buffered puts are where the soft provider's same-host path is on; a same-host "
                        "peer reads it through a mapping) or in the process's private memory (private: numpy's "
                        "allocation, as a model's tensors; a same-host peer reads it with process_vm_readv)")
    p.add_argument("--unpaired", action="store_true",
                   help="do not pair: by default (with raw_tcp among the methods) every loopback fedrdma/fedrdma-e "
                        "transfer, and every raw_tcp_checked, shm_copy and shm_copy_checked one, is paired with a raw TCP transfer of the same payload run right before or (every "
                        "other repetition) right after it, and its row's x_raw_tcp is the median of those pairs' "
                        "throughput ratios, which the verdicts print")
    p.add_argument("--tls", action="store_true",
                   help="each fedrdma/fedrdma-e row once more with tls: true (mutual TLS on the bootstrap and the soft "
                        "provider's data connections; certificates from a throwaway CA): the cost of TLS beside it")
    p.add_argument("--metrics", action="store_true",
                   help="each fedrdma/fedrdma-e row once more with metrics_dir set at both ends (Prometheus metrics "
                        "on, into a throwaway folder), and the metric hooks' own cost per transfer: the cost of metrics")


class _Put:
    """A buffered put's copy of `data` before (copy) or while (overlap) it is sent, into recycled or fresh memory."""

    def __init__(self, how: str, memory: str, data: np.ndarray, checksum: str, shared: bool) -> None:
        self.how, self.memory, self.data, self.checksum, self.shared = how, memory, data, checksum, shared
        self.recycled = [self._new() for _ in range(2)] if memory == "warm" else []
        for b in self.recycled:
            b.fill(1)  # faulted in
        self.turn = 0

    def _new(self) -> np.ndarray:
        return fresh(self.data.nbytes, self.shared)  # where the FATE wrapper puts its copies (RecvBuffers)

    def send(self, ep: Endpoint, address: str) -> Any:
        self.turn += 1
        dest = self.recycled[self.turn % 2] if self.recycled else self._new()
        if self.how == "copy":
            copy_into(dest, 0, self.data.data)
            return ep.send(address, dest)
        fill = Fill(self.data.nbytes, block_digest(self.checksum))
        fut = ep.send(address, dest, None, fill)
        fill.run(dest, [self.data], BLOCK_BYTES)
        return fut


def _channel(peer: PeerProcess, data: np.ndarray, cfg: ChannelConfig, reps: int,
             put: Optional[_Put] = None, pair: Optional[Callable[[], float]] = None) -> Dict[str, Any]:
    """`reps` transfers of `data` with `cfg`; with `pair`, each one beside a raw TCP transfer of the same payload
    (`pair` returns its seconds), before it in odd repetitions and after it in even ones, so that the two see
    the machine in the same state and neither always follows the other."""
    reply = peer.cmd({"cmd": "endpoint", "config": {k: v for k, v in cfg.__dict__.items()}})
    times, rss, cpu_send, cpu_recv, paired = [], [], [], [], []
    info: Dict[str, Any] = {}
    # tls: one certificate names both ends (_bench_tls); the receiver is known by its address
    names: Dict[str, Any] = {"name": "bench-sender", "party_names": {reply["address"]: "bench-receiver"}} if cfg.tls else {}
    with Endpoint(cfg, **names) as ep:
        count = peer.cmd({"cmd": "mark"})["count"]
        # connects, probes the RTT; on loopback the whole payload, as raw TCP's warm-up, so that neither's first
        # measured transfer faults in its receive memory (a link scenario's wire time dwarfs that)
        ep.send(reply["address"], b"warm-up" if cfg.soft_link else data).result(60 if cfg.soft_link else cfg.transfer_timeout_s)
        peer.cmd({"cmd": "expect", "count": count + 1})
        path = getattr(ep.connect(reply["address"]).rcs[0].qp, "data_path", "verbs")
        for i in range(reps):
            if pair is not None and i % 2 == 0:
                paired.append(pair())
            mark = peer.cmd({"cmd": "mark"})
            c0, t0 = cpu_s(), time.perf_counter()
            fut = put.send(ep, reply["address"]) if put is not None else ep.send(reply["address"], data)
            info = fut.result(cfg.transfer_timeout_s)
            r = peer.cmd({"cmd": "expect", "count": mark["count"] + 1})
            times.append(time.perf_counter() - t0)
            cpu_send.append(cpu_s() - c0)
            cpu_recv.append(r["cpu_s"] - mark["cpu_s"])
            # above the receiver's level before its endpoint existed, less what the method must hold:
            # fedrdma its destination (the payload), fedrdma-e its registered pool
            held = data.nbytes if cfg.mode == "fedrdma" else r["pool_bytes"]
            rss.append(max(0, r["endpoint_rss_bytes"] - held))
            if pair is not None and i % 2 == 1:
                paired.append(pair())
        emulated, provider, label = ep.ctx.emulated, ep.ctx.provider, ep.ctx.label
    return {"times": times, "rss": rss, "cpu_send": cpu_send, "cpu_recv": cpu_recv, "paired": paired,
            "window": info.get("window"), "chunks": info.get("chunks"),
            "emulated": emulated, "provider": provider, "label": label, "path": path}


def run(args: argparse.Namespace) -> int:
    nbytes = (args.payload_mib or (256 if args.quick else 1024)) * MiB
    reps = args.reps or 3
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    windows = [w.strip() for w in args.windows.split(",")]
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [x for x in scenarios if x not in SCENARIOS] + [m for m in methods if m not in METHODS] + \
        [p for p in args.puts.split(",") if p and p not in PUT_LABELS]
    if unknown:
        raise SystemExit(f"fate-rdma bench transfer: unknown scenario, method or put {', '.join(unknown)} "
                         f"(scenarios: {', '.join(SCENARIOS)}; methods: {', '.join(METHODS)}; puts: {', '.join(PUT_LABELS)})")
    print(f"fate-rdma bench transfer: payload {human_bytes(nbytes)}, {reps} repetitions, scenarios {','.join(scenarios)}, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    # every method sends it. --source shared: in a memfd, where the FATE wrapper copies what it puts (a same-host
    # peer maps it); private: numpy's own allocation, as a model's tensors are (numpy asks the kernel for
    # transparent huge pages for it; a bytes object gets 4 KiB pages, which process_vm_readv pins ~1.5 x slower)
    data = shared_array(nbytes) if args.source == "shared" else np.empty(nbytes, dtype=np.uint8)
    data[:] = np.frombuffer(np.random.default_rng(PAYLOAD_SEED).bytes(nbytes), dtype=np.uint8)
    rows: List[Dict[str, Any]] = []
    tls_dir = tempfile.TemporaryDirectory(prefix="fate-rdma-bench-tls-") if args.tls else None
    tls_files = _bench_tls(tls_dir.name) if tls_dir is not None else {}
    metrics_dir = tempfile.TemporaryDirectory(prefix="fate-rdma-bench-metrics-") if args.metrics else None
    variants: List[Dict[str, Any]] = [{}] + ([tls_files] if tls_files else []) + \
        ([{"metrics_dir": metrics_dir.name}] if metrics_dir is not None else [])
    secret, secret_dir = None, None
    if args.checksum in ("blake2b", "blake3"):  # the MAC is keyed per connection from the secret both endpoints prove (as demo does)
        from fate_rdma.channel.auth import write_secret

        secret_dir = tempfile.TemporaryDirectory(prefix="fate-rdma-bench-")  # private (0700), removed with the object
        secret = os.path.join(secret_dir.name, "secret")
        write_secret(secret)

    def add(row: Dict[str, Any], cpu_send: Optional[List[float]] = None, cpu_recv: Optional[List[float]] = None) -> None:
        # the machine's 1-minute load average with every row: figures from a busy machine say so
        row = {"bench": "transfer", **row, "payload_bytes": nbytes, "loadavg_1m": round(os.getloadavg()[0], 2)}
        if row.get("seconds"):
            row["gbps"] = round(nbytes * 8 / row["seconds"] / 1e9, 3)
        if cpu_send is not None:
            row["cpu_send_s_per_gb"] = per_gb(median(cpu_send), nbytes)
        if cpu_recv is not None:
            row["cpu_recv_s_per_gb"] = per_gb(median(cpu_recv), nbytes)
        rows.append(row)
        emit(row)

    baselines_done, raw = False, None  # raw: the baselines' raw TCP connection, kept open for pairing
    with PeerProcess(module="fate_rdma_lab.bench.transfer_peer") as peer, contextlib.ExitStack() as closing:
        for scen in scenarios:
            link = SCENARIOS[scen]
            if link is None and not baselines_done:  # once: the same TCP over loopback serves both loopback scenarios
                baselines_done = True
                raw = run_baselines(peer, scen, methods, data, reps, add, args.checksum, pairs=not args.unpaired)
                if raw is not None:
                    closing.callback(raw.close)
            elif link is not None:
                add({"scenario": scen, "method": "wire_time", "window": None, "provider": "model", "emulated": True,
                     "seconds": round(nbytes * 8 / RATES[scen], 4), "extra_rss_bytes": None, "chunks": None})
            for mode in ("fedrdma", "fedrdma-e"):
                if mode not in methods:
                    continue
                puts = [None] + ([p for p in args.puts.split(",") if p] if mode == "fedrdma-e" else [])
                for w, variant, how in [(w, v, how) for w in windows for v in variants for how in puts]:
                    cfg = ChannelConfig(mode=mode, window=int(w) if w != "auto" else "auto", slot_bytes=nbytes,
                                        provider="soft" if link else args.provider, soft_link=link,
                                        transfer_timeout_s=3600, no_progress_timeout_s=120, checksum=args.checksum,
                                        same_host=scen != "loopback-tcp", secret_file=secret, **variant)
                    tls = cfg.tls
                    put = _Put(how, args.put_memory, data, args.checksum, args.source == "shared") if how else None
                    pair = pair_raw(raw, data) if raw is not None and link is None and not args.unpaired else None
                    res = _channel(peer, data, cfg, reps, put, pair)
                    metrics.disable()  # (this process's sender: the next row's endpoint has it off, if it is)
                    method = f"{mode} put: {PUT_LABELS[how]} ({args.put_memory})" if how else mode
                    add({"scenario": scen, "method": method, "window": res["window"] if w != "auto" else f"auto ({res['window']})",
                         "provider": res["provider"], "emulated": res["emulated"], "label": res["label"],
                         "path": res["path"], "source": args.source, "checksum": args.checksum, "tls": tls,
                         "metrics": bool(cfg.metrics_dir),
                         "seconds": round(median(res["times"]), 4),
                         "extra_rss_bytes": int(median(res["rss"])), "chunks": res["chunks"], **paired(res)},
                        res["cpu_send"], res["cpu_recv"])
    print()
    table([dict(r, rss=human_bytes(r["extra_rss_bytes"]) if r.get("extra_rss_bytes") is not None else "-",
                seconds=r.get("seconds", "skipped"), cpu_snd=r.get("cpu_send_s_per_gb", "-"),
                cpu_rcv=r.get("cpu_recv_s_per_gb", "-")) for r in rows],
          ["scenario", "method", "window", "provider", "path", "source", "emulated", "checksum", "seconds", "gbps", "x_raw_tcp",
           "chunks", "rss", "cpu_snd", "cpu_rcv", "loadavg_1m"])
    print("cpu_snd, cpu_rcv: CPU seconds per GB moved, of the sending and the receiving process (user + system, all "
          "threads); the soft provider is an emulation of verbs (over TCP, or shared memory on the same-host path; "
          "emulated: True), not RDMA")
    for r in rows:
        if r.get("skipped"):
            print(f"skipped {r['method']}: {r['skipped']}")
    _verdicts(rows, nbytes, reps)
    _tls_verdicts(rows)
    if metrics_dir is not None:
        off = metrics_hook_cost_s()
        metrics.enable(metrics_dir.name)
        on = metrics_hook_cost_s()
        metrics.disable()
        _metrics_verdicts(rows, on, off)
    return 0


def _beyond(where: str, r: Dict[str, Any], base: Dict[str, Any], raw: Optional[Dict[str, Any]], target: float) -> None:
    """Say so where the baseline that pays for the same check as row `r`, with nothing else to do, itself stays
    under the path's target against raw TCP: that target is then out of any sender's reach on this machine."""
    x = base.get("x_raw_tcp") or (raw["seconds"] / base["seconds"] if raw else None)
    if x is not None and x < target:
        print(f"{where}, checksum {r.get('checksum')}{tag(r)}: the target (>= {target:g} x raw TCP) is beyond this machine "
              f"with this check: {base['method']}, which moves the bytes and checks them and does nothing else, "
              f"reaches {x:.2f} x")


def _bench_tls(folder: str) -> Dict[str, Any]:
    """ChannelConfig keys for tls: true, from a throwaway CA: one certificate naming both ends."""
    from fate_rdma.cli.tls import make_certificates

    f = make_certificates(folder, ["bench-sender+bench-receiver"])["bench-sender"]
    return {"tls": True, "tls_cert": f.cert, "tls_key": f.key, "tls_ca": f.ca}


def metrics_hook_cost_s(n: int = 20000) -> float:
    """Seconds the metric hooks of one transfer take (the sender's `sending` and its verdict's callback, the
    receiver's `received`), the median of 5 runs of `n` transfers, in this process as its metrics are now."""
    import concurrent.futures

    times = []
    for _ in range(5):
        futs = []
        for i in range(n):
            f: "concurrent.futures.Future[Dict[str, Any]]" = concurrent.futures.Future()
            f.total_bytes = 1 << 30  # type: ignore[attr-defined]
            futs.append(f)
        t0 = time.perf_counter()
        for f in futs:
            metrics.sending(f, "bench:1", "soft", "tcp-emulated", "blake3")
            f.set_result({"mode": "fedrdma-e", "chunks": 32, "seconds": 0.5})
            metrics.received("bench:1", 1 << 30, "fedrdma-e", "soft", "tcp-emulated")
        times.append((time.perf_counter() - t0) / n)
    return median(times)


def _metrics_verdicts(rows: List[Dict[str, Any]], hook_s: float, off_s: float) -> None:
    for r in rows:
        if not r.get("metrics"):
            continue
        plain = next((p for p in rows if not p.get("metrics") and not p.get("tls") and p["scenario"] == r["scenario"]
                      and p["method"] == r["method"] and str(p["window"])[:4] == str(r["window"])[:4]), None)
        if plain:
            both = plain.get("x_raw_tcp") and r.get("x_raw_tcp")
            vs = f"; against raw TCP beside each: {plain['x_raw_tcp']} x off, {r['x_raw_tcp']} x on" if both else ""
            print(f"metrics cost{tag(r)}: {r['scenario']} {r['method']} window {r['window']}: {plain['seconds']:.3f} s "
                  f"off -> {r['seconds']:.3f} s on ({100 * (r['seconds'] / plain['seconds'] - 1):+.1f}% time, within "
                  f"the machine's drift{vs}); the hooks themselves: {hook_s * 1e6:.1f} us per transfer, both ends "
                  f"= {100 * hook_s / r['seconds']:.4f}% of it (target < 1%); off: {off_s * 1e6:.1f} us")


def _tls_verdicts(rows: List[Dict[str, Any]]) -> None:
    for r in rows:
        if not r.get("tls"):
            continue
        plain = next((p for p in rows if p.get("tls") is False and p["scenario"] == r["scenario"]
                      and p["method"] == r["method"] and str(p["window"])[:4] == str(r["window"])[:4]), None)
        if plain:
            emu = tag(r)
            print(f"tls cost{emu}: {r['scenario']} {r['method']} window {r['window']}: {plain['seconds']:.3f} s plain "
                  f"({plain.get('gbps')} Gbit/s, {plain['path']}) -> {r['seconds']:.3f} s with TLS ({r.get('gbps')} "
                  f"Gbit/s, {r['path']}): {100 * (r['seconds'] / plain['seconds'] - 1):+.0f}% time")


def _verdicts(rows: List[Dict[str, Any]], nbytes: int, reps: int) -> None:
    def get(scen: Optional[str], method: str, auto: Optional[bool] = None) -> Optional[Dict[str, Any]]:
        """The measured row of `method` in `scen` (None: any scenario, for the baselines run once)."""
        for r in rows:
            if (scen is None or r["scenario"] == scen) and r["method"] == method and r.get("seconds"):
                if auto is None or str(r["window"]).startswith("auto") == auto:
                    return r
        return None

    def x_raw(r: Dict[str, Any], raw: Dict[str, Any]) -> str:
        """fedrdma-e / raw TCP throughput of row `r`: against the raw TCP row `raw`, and the median of its pairs
        (baselines.paired) where it has them (both printed: the two can differ by a fifth on this machine)."""
        ratio = raw["seconds"] / r["seconds"]
        if r.get("x_raw_tcp") is not None:
            return (f"{r['x_raw_tcp']:.2f} (median of {reps} pairs, each beside a raw TCP transfer; "
                    f"{ratio:.2f} against the raw TCP row)")
        return f"{ratio:.2f} (against the raw TCP row)"

    def base_x(b: Dict[str, Any], raw: Dict[str, Any]) -> str:
        """A baseline row's throughput against raw TCP: its pairs' median where it has them."""
        if b.get("x_raw_tcp") is not None:
            return f"it reaches {b['x_raw_tcp']:.2f} x raw TCP's throughput (median of {reps} pairs)"
        return f"it reaches {raw['seconds'] / b['seconds']:.2f} x raw TCP's throughput (against the raw TCP row)"

    print()
    raw, gs = get(None, "raw_tcp"), get(None, "grpc_stream")
    e, t = get("loopback", "fedrdma-e", True), get("loopback-tcp", "fedrdma-e", True)
    # each row against raw TCP of the same run and the target of the path it took, never two paths in one ratio;
    # gRPC (over TCP) only beside a row that did not take the same-host copy
    for r, scen in ((e, "loopback"), (t, "loopback-tcp")):
        if not r or not raw:
            continue
        path = str(r.get("path"))
        if path.startswith("same-host"):
            print(f"same host, data path {path}{tag(r)}: fedrdma-e / raw TCP throughput = {x_raw(r, raw)} (target >= 2)")
            continue
        grpc = f"; fedrdma-e / gRPC stream = {gs['seconds'] / r['seconds']:.2f} (target >= 2)" if gs else ""
        where = (f"over loopback TCP (as between hosts{', same-host path not taken' if scen == 'loopback' else ''}, "
                 if path == "tcp" else f"{scen}, data path {path} (")  # (else a device's verbs: rxe, or a NIC)
        print(f"{where}checksum {r.get('checksum')}){tag(r)}: fedrdma-e / raw TCP throughput = {x_raw(r, raw)} "
              f"(target >= {0.95 if path == 'tcp' else 0.8}){grpc}")
        if path == "tcp":
            line = cpu_ceiling(r, raw, nbytes, usable_cores())
            if line:
                print(f"over loopback TCP, checksum {r.get('checksum')}{tag(r)}: {line}")
    checked = get(None, "raw_tcp_checked")
    for r in (e, t):  # against raw TCP paying for the same check (checked_tcp.py), each path on its own line
        if r and checked and checked.get("checksum") == r.get("checksum"):
            vs_raw = f"; {base_x(checked, raw)}" if raw else ""
            print(f"{r['scenario']}, data path {r.get('path')}{tag(r)}: fedrdma-e / raw TCP with the same "
                  f"{r.get('checksum')} check on both sides = {checked['seconds'] / r['seconds']:.2f}"
                  f"{' (target >= 0.9 for the keyed default)' if r.get('checksum') == 'blake3' else ''} (against that "
                  f"row, {checked['seconds']:.3f} s{vs_raw})")
    if t and checked and checked.get("checksum") == t.get("checksum") and str(t.get("path")) == "tcp":
        _beyond("over loopback TCP", t, checked, raw, 0.95)
    if e and str(e.get("path")).startswith("same-host"):  # against the plain copy paying for the same check, if any
        base = next((b for b in (get(None, m) for m in checked_shm.METHODS) if b and b["checksum"] == e.get("checksum")), None)
        if base:
            vs_raw = f", {base_x(base, raw)}" if raw else ""
            print(f"same host, data path {e.get('path')}{tag(e)}: fedrdma-e / one plain copy out of shared memory "
                  f"({base['method']}, checksum {base['checksum']}) = {base['seconds'] / e['seconds']:.2f} (that copy "
                  f"{base['seconds']:.3f} s{vs_raw})")
            if base["checksum"] != "none":
                _beyond("same host", e, base, raw, 2.0)
    for r in rows:  # a buffered put's copy overlapped against copy-then-send, in the same scenario and window
        if r["method"].startswith("fedrdma-e put: copy overlapped") and r.get("seconds"):
            serial = next((x for x in rows if x["scenario"] == r["scenario"] and x.get("tls") == r.get("tls")
                           and (x["window"] == r["window"] or str(x["window"]).startswith("auto")
                                and str(r["window"]).startswith("auto"))  # (auto's own choice may differ by one)
                           and x["method"] == r["method"].replace("copy overlapped", "copy, then send")), None)
            if serial and serial.get("seconds"):
                print(f"{r['scenario']}{tag(r)}: a buffered put with its copy overlapped {r['seconds']:.3f} s against copy, then "
                      f"send {serial['seconds']:.3f} s ({serial['seconds'] / r['seconds']:.2f} x)")
    mc = [r for r in (get(None, m) for m in mooncake.METHODS) if r]
    if t and mc:  # both over loopback TCP; Mooncake checksums nothing, fedrdma-e its whole payload (unless none)
        best = min(mc, key=lambda r: r["seconds"])
        verdict = "faster" if t["seconds"] < best["seconds"] else "NOT faster"
        print(f"over loopback TCP{tag(t)}: fedrdma-e {t['seconds']:.3f} s (checksum {t.get('checksum')}) vs Mooncake TE TCP "
              f"{best['method']} {best['seconds']:.3f} s (no checksum): {verdict} (throughput ratio "
              f"{best['seconds'] / t['seconds']:.2f})")
    w1, auto = get("link-10g-20ms", "fedrdma-e", False), get("link-10g-20ms", "fedrdma-e", True)
    if w1 and auto:
        wire = nbytes * 8 / 10e9
        print(f"link model 10 Gbit/s 20 ms{tag(auto)}: window 1 {w1['seconds']:.2f} s (paper's stop-and-wait: 6.0 s for 1 GiB); "
              f"auto window {auto['seconds']:.2f} s = {auto['seconds'] / wire:.2f} x wire time {wire:.2f} s (target <= 1.5)")
    for r in rows:
        if r["method"] in ("fedrdma", "fedrdma-e") and r["scenario"] == "loopback":
            print(f"memory{tag(r)}: {r['method']} window {r['window']}: {human_bytes(r['extra_rss_bytes'])} extra at the "
                  f"receiver")
