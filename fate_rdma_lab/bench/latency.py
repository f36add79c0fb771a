"""Message latency: a ping-pong of one message each way between two processes, fate-rdma's channel
against raw TCP in the same run.

Each round trip sends a message of the given size to a peer process, which receives it whole and
answers with a message of the same size; the figure is the round trip's median (and 90th percentile)
over the measured repetitions, after a warm-up. This is what a FedAvg round does at small sizes (LoRA
adapters: the clients' uploads, the arbiter's answer), where a message's fixed costs outweigh its
bytes, which `bench transfer`'s 1 GiB hides. `cpu_ms_local`, `cpu_ms_peer`: CPU milliseconds (user +
system, every thread) each process spends per round trip (one message sent and one received).
Raw TCP: one connection with TCP_NODELAY, sendall and recv_into. The channel's rows name the provider,
the data path (soft provider: `tcp`, as between sites, or `same-host`; pyverbs: `verbs`) and whether the
provider is an emulation: with the soft provider every figure is emulated verbs over TCP or shared
memory, not RDMA. `x_raw_tcp`: raw TCP's median round trip over the row's (above 1: faster than raw
TCP), both from this run. A peer that fails is named with its error (exit 1); bad arguments exit 2.

`--steps`: after each channel row, a second pass of the same ping-pong with both processes traced
(fate_rdma/trace.py; each event costs its process a few microseconds, so these round trips are not the
row's) splits a message's time into the channel's steps, medians in ms over every message of the pass:
queue (the caller's send began -> the connection's engine starts it: registering the payload, a hand-off
between threads, a receive slot), post (-> its first WRITE posted), wire (-> the receiver holds every byte:
the NIC's threads, the bytes, the receiver's engine woken; in fedrdma mode also each chunk's check and copy
out, so its verify is '-'), verify (-> the checksum held), deliver (-> in the receiver's inbox), verdict
(verified -> the sender's engine has the verdict) and total (the caller's send -> the verdict); the pass's
warm-up messages are left out.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from easypyverbs.errors import EasyVerbsError

from fate_rdma.errors import FateRdmaError
from fate_rdma_lab.bench.cpu import cpu_s
from fate_rdma_lab.bench.report import emit, human_bytes, loadavg, parse_size, table

MODES = ("fedrdma-e", "fedrdma")
DEFAULT_SIZES = "64K,1M,4M"
WARMUP = 10
STEP_REPS = 200  # round trips of a --steps pass at most


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"message sizes, e.g. 64K,1M,4M (default {DEFAULT_SIZES})")
    p.add_argument("--reps", type=int, default=200, help="measured round trips per size and method (default 200)")
    p.add_argument("--modes", default=",".join(MODES), help="channel modes to measure (default fedrdma-e,fedrdma)")
    p.add_argument("--provider", default="soft",
                   help="the channel's verbs provider: soft (default), pyverbs (a real RDMA device) or auto")
    p.add_argument("--path", choices=("tcp", "same-host"), default="tcp",
                   help="the soft provider's data path: tcp (as between sites, default) or same-host (shared memory)")
    p.add_argument("--checksum", choices=("crc32c", "xxh3", "blake3", "blake2b", "none"), default=None,
                   help="the channel's end-to-end check (default: the channel's default, xxh3)")
    p.add_argument("--timeout-s", type=float, default=30.0, help="deadline for each message (default 30 s)")
    p.add_argument("--steps", action="store_true",
                   help="after each channel row, a traced pass that splits a message's time into the channel's "
                        "steps (queue, post, wire, verify, deliver, verdict; medians in ms)")


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    pos = 0
    while pos < view.nbytes:
        got = sock.recv_into(view[pos:])
        if not got:
            raise ConnectionError(f"peer closed the connection after {pos} of {view.nbytes} bytes")
        pos += got


def _raw_peer(ctl: Any, nbytes: int, count: int, timeout_s: float) -> None:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        srv.settimeout(timeout_s)
        ctl.send(srv.getsockname()[1])
        sock, _ = srv.accept()
    with sock:
        sock.settimeout(timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf, data = memoryview(bytearray(nbytes)), np.ones(nbytes, dtype=np.uint8)
        c0 = cpu_s()
        for i in range(count):
            if i == WARMUP:  # the driver's measured round trips begin: its message i, this answer
                c0 = cpu_s()
            _recv_exactly(sock, buf)
            sock.sendall(data.data)
        ctl.send(cpu_s() - c0)


def _channel_peer(ctl: Any, cfg: Dict[str, Any], nbytes: int, count: int, timeout_s: float,
                  trace_dir: Optional[str] = None) -> None:
    import logging

    from fate_rdma import trace
    from fate_rdma.channel import Endpoint
    from fate_rdma.config import ChannelConfig

    logging.basicConfig(level=logging.ERROR)
    if trace_dir:
        trace.start(trace_dir)  # (this process ends with the pass: nothing to go back to)
    data = np.ones(nbytes, dtype=np.uint8)
    with Endpoint(ChannelConfig.from_dict(cfg)) as ep:
        ctl.send(ep.address)
        if not ctl.poll(60):
            raise TimeoutError("the driver did not name its endpoint within 60 s")
        back = ctl.recv()
        c0 = cpu_s()
        for i in range(count):
            if i == WARMUP:  # the driver's measured round trips begin: its message i, this answer
                c0 = cpu_s()
            ep.recv(timeout_s).release()
            ep.send(back, data).result(timeout_s)
        ctl.send(cpu_s() - c0)
        ctl.poll(timeout_s)  # until the driver holds its last message: closing then loses nothing


class _PeerFailed(RuntimeError):
    """The peer process failed; its error, as it reported it."""


def _peer_main(target: Any, ctl: Any, *args: Any) -> None:
    try:
        target(ctl, *args)
    except BaseException as exc:  # reported to the driver, which names it; nothing else reads this process
        ctl.send({"error": f"{type(exc).__name__}: {exc}"})


def _peer(target: Any, *args: Any) -> Any:
    """A separate interpreter (spawn, as on another host) running `target(ctl, *args)`; its control pipe."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_peer_main, args=(target, theirs, *args), daemon=True)
    proc.start()
    theirs.close()  # the child's end: once it exits, our end reads EOF
    return proc, ours


def _ctl_recv(ctl: Any, proc: Any, timeout_s: float) -> Any:
    """The peer's next answer; an error as soon as the peer process is gone without one, or at `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not ctl.poll(0.2):
        if not proc.is_alive() and not ctl.poll(0):
            raise _PeerFailed(f"the peer process ended (exit code {proc.exitcode}) without answering")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the peer process did not answer within {timeout_s} s")
    got = ctl.recv()
    if isinstance(got, dict) and "error" in got:
        raise _PeerFailed(f"the peer process failed: {got['error']}")
    return got


def _peer_error(ctl: Any, exc: BaseException) -> BaseException:
    """What the driver reports for its own failure `exc`: the peer's error instead, if the peer sent one
    (the driver's is then only its symptom, a closed connection or a timeout)."""
    try:
        got = ctl.recv() if ctl.poll(0.5) else None
    except (EOFError, OSError):
        got = None
    if isinstance(got, dict) and "error" in got:
        return _PeerFailed(f"the peer process failed: {got['error']}")
    return exc


def _stop(proc: Any, ctl: Any) -> None:
    proc.join(timeout=10)
    if proc.is_alive():
        proc.kill()
        proc.join()
    ctl.close()


def _summary(times: List[float], cpu_local: float, cpu_peer: float, reps: int) -> Dict[str, Any]:
    ts = np.array(times) * 1e3
    return {"rtt_ms_median": round(float(np.median(ts)), 4), "rtt_ms_p90": round(float(np.percentile(ts, 90)), 4),
            "cpu_ms_local": round(cpu_local * 1e3 / reps, 4), "cpu_ms_peer": round(cpu_peer * 1e3 / reps, 4)}


def _raw(nbytes: int, reps: int, timeout_s: float) -> Dict[str, Any]:
    proc, ctl = _peer(_raw_peer, nbytes, reps + WARMUP, timeout_s)
    try:
        port = _ctl_recv(ctl, proc, 60)
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            data, buf, times = np.ones(nbytes, dtype=np.uint8), memoryview(bytearray(nbytes)), []
            c0 = cpu_s()
            for i in range(reps + WARMUP):
                if i == WARMUP:
                    c0 = cpu_s()
                t0 = time.perf_counter()
                sock.sendall(data.data)
                _recv_exactly(sock, buf)
                times.append(time.perf_counter() - t0)
            mine = cpu_s() - c0
        return {"method": "raw_tcp", "provider": "tcp", "emulated": False, "path": "tcp",
                **_summary(times[WARMUP:], mine, _ctl_recv(ctl, proc, timeout_s), reps)}
    except (OSError, TimeoutError) as exc:
        raise _peer_error(ctl, exc) from exc
    finally:
        _stop(proc, ctl)


def _channel(cfg: Dict[str, Any], nbytes: int, reps: int, timeout_s: float,
             trace_dir: Optional[str] = None) -> Dict[str, Any]:
    from fate_rdma import trace
    from fate_rdma.channel import Endpoint
    from fate_rdma.config import ChannelConfig

    config = ChannelConfig.from_dict(cfg)
    proc, ctl = _peer(_channel_peer, cfg, nbytes, reps + WARMUP, timeout_s, trace_dir)
    before = trace.start(trace_dir) if trace_dir else None
    try:
        address = _ctl_recv(ctl, proc, 60)
        with Endpoint(config) as ep:
            ctl.send(ep.address)
            data, times = np.ones(nbytes, dtype=np.uint8), []
            c0 = cpu_s()
            for i in range(reps + WARMUP):
                if i == WARMUP:
                    c0 = cpu_s()
                t0 = time.perf_counter()
                ep.send(address, data).result(timeout_s)
                ep.recv(timeout_s).release()
                times.append(time.perf_counter() - t0)
            mine = cpu_s() - c0
            path = getattr(ep.connect(address).rcs[0].qp, "data_path", "verbs")
            peer_cpu = _ctl_recv(ctl, proc, timeout_s)
            ctl.send("done")
            return {"method": cfg["mode"], "provider": ep.ctx.provider, "emulated": ep.ctx.emulated,
                    "label": ep.ctx.label, "path": path, "checksum": config.checksum,
                    **_summary(times[WARMUP:], mine, peer_cpu, reps)}
    except (FateRdmaError, EasyVerbsError, OSError, TimeoutError, concurrent.futures.TimeoutError) as exc:
        raise _peer_error(ctl, exc) from exc
    finally:
        if trace_dir:
            trace.stop(back_to=before)  # (a FATE_RDMA_TRACE of the user's own goes on)
        _stop(proc, ctl)


#: the steps `--steps` reports: (name, from event, to event); sender events and receiver events join on the
#: transfer id, the receiver's in the other process's trace file
STEPS = (("queue", "c_send", "c_start"), ("post", "c_start", "c_first"), ("wire", "c_first", "c_arrived"),
         ("verify", "c_arrived", "c_verified"), ("deliver", "c_verified", "c_deliver"),
         ("verdict", "c_verified", "c_done"), ("total", "c_send", "c_done"))
SENDER_EVENTS = frozenset({"c_send", "c_start", "c_first", "c_done"})


def steps(folder: str, skip: int = 0) -> Dict[str, Any]:
    """Medians (ms) of STEPS over the messages traced in `folder` by the two processes of one ping-pong, leaving
    out each sender's first `skip` (the warm-up), and how many messages were joined whole."""
    from fate_rdma_lab.bench.timeline import load

    by: Dict[Tuple[str, bool, Any], Dict[str, float]] = {}  # (file, sender's side, tid) -> event -> first time
    for e in load(folder, with_file=True):
        if e.get("tid") is not None:
            by.setdefault((e["file"], e["ev"] in SENDER_EVENTS, e["tid"]), {}).setdefault(e["ev"], float(e["t"]))
    received: Dict[Any, List[Tuple[str, Dict[str, float]]]] = {}
    for (path, sender, tid), side in by.items():
        if not sender:
            received.setdefault(tid, []).append((path, side))
    whole: Dict[str, List[Dict[str, float]]] = {}  # per sender's file, its messages joined whole
    for (path, sender, tid), snd in by.items():
        rcv = next((v for p, v in received.get(tid, []) if p != path), None) if sender else None
        if rcv is None:
            continue
        ev = {**snd, **rcv}
        if all(a in ev and b in ev for _, a, b in STEPS):
            whole.setdefault(path, []).append(ev)
    spans: Dict[str, List[float]] = {name: [] for name, _, _ in STEPS}
    joined = 0
    for msgs in whole.values():
        for ev in sorted(msgs, key=lambda m: m["c_send"])[skip:]:
            joined += 1
            for name, a, b in STEPS:
                spans[name].append((ev[b] - ev[a]) * 1000)
    return {"messages": joined, **{f"{k}_ms": round(float(np.median(v)), 3) if v else None for k, v in spans.items()}}


def _measure(args: argparse.Namespace, sizes: List[int], modes: List[str],
             out: Optional[Any]) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """The rows, and (--steps) the split of each channel row's messages into steps."""
    rows: List[Dict[str, Any]] = []
    split_rows: List[Dict[str, Any]] = []
    for nbytes in sizes:
        raw = {"bench": "latency", "msg_bytes": nbytes, **_raw(nbytes, args.reps, args.timeout_s)}
        emit(raw, out)
        rows.append(raw)
        for mode in modes:
            cfg: Dict[str, Any] = {"mode": mode, "provider": args.provider, "same_host": args.path == "same-host"}
            if args.checksum:
                cfg["checksum"] = args.checksum
            row = {"bench": "latency", "msg_bytes": nbytes, **_channel(cfg, nbytes, args.reps, args.timeout_s)}
            row["x_raw_tcp"] = round(raw["rtt_ms_median"] / row["rtt_ms_median"], 3)
            emit(row, out)
            rows.append(row)
            if args.steps:
                with tempfile.TemporaryDirectory(prefix="fate-rdma-latency-trace-") as folder:
                    traced = _channel(cfg, nbytes, min(args.reps, STEP_REPS), args.timeout_s, folder)
                    split = {"bench": "latency", "steps": True, "msg_bytes": nbytes, "method": mode,
                             "provider": traced["provider"], "path": traced["path"], "emulated": traced["emulated"],
                             "traced_rtt_ms_median": traced["rtt_ms_median"], **steps(folder, skip=WARMUP)}
                if mode == "fedrdma":  # its receiver checks each chunk as it lands: the checks are in `wire`
                    split["verify_ms"] = None
                emit(split, out)
                split_rows.append(split)
    return rows, split_rows


def _usage(why: str) -> int:
    print(f"fate-rdma bench latency: {why}", file=sys.stderr)
    return 2  # bad usage, as every fate-rdma command


def run(args: argparse.Namespace, out: Optional[Any] = None) -> int:
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as exc:
        return _usage(str(exc))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        return _usage(f"modes must be among {', '.join(MODES)}, got {args.modes!r}")
    if not sizes or args.reps < 1:
        return _usage("give at least one message size (--sizes) and --reps >= 1")
    print(f"fate-rdma bench latency: sizes {', '.join(human_bytes(z) for z in sizes)}, {args.reps} round trips "
          f"after {WARMUP} warm-up, path {args.path}, load average {loadavg()}", flush=True)
    try:
        rows, split_rows = _measure(args, sizes, modes, out)
    except (FateRdmaError, EasyVerbsError, RuntimeError, OSError, TimeoutError, concurrent.futures.TimeoutError) as exc:
        what = "" if isinstance(exc, _PeerFailed) else f"{type(exc).__name__}: "
        print(f"fate-rdma bench latency: {what}{exc}", file=sys.stderr)
        return 1
    print()
    for r in rows:
        r["size"] = human_bytes(r["msg_bytes"])
    table(rows, ["size", "method", "provider", "path", "emulated", "checksum", "rtt_ms_median", "rtt_ms_p90",
                 "x_raw_tcp", "cpu_ms_local", "cpu_ms_peer", "loadavg_1m"], out)
    if any(r.get("emulated") for r in rows):
        print("the soft provider is an emulation of verbs (over TCP, or shared memory on the same-host path), "
              "not RDMA: these are emulated figures", flush=True)
    print(f"cpu_ms_local, cpu_ms_peer: CPU milliseconds per round trip of this process and of the peer (pid "
          f"{os.getpid()} and a spawned one), user + system, every thread", flush=True)
    if split_rows:
        print(f"\nwhere a message's time goes (--steps: a traced pass of up to {STEP_REPS} round trips after each "
              f"row; medians in ms per message, both directions; tracing costs each event a few us)", flush=True)
        shown = [{**{k: "-" if v is None else v for k, v in r.items()}, "size": human_bytes(r["msg_bytes"])}
                 for r in split_rows]
        table(shown, ["size", "method", "provider", "path", "emulated", "messages", "traced_rtt_ms_median",
                           *(f"{name}_ms" for name, _, _ in STEPS)], out)
    return 0
