"""Processes that run inside a WAN-testbed site (`ip netns exec <site> python -m fate_rdma_lab.testbed.probe ...`).

Each command prints one JSON object per line on stdout and exits 0 when it did what it was asked,
1 when it failed (the JSON then has "error"), 2 on bad usage. Servers print {"ready": true, ...} once
they listen, and stop when their stdin closes (so a parent that dies takes them with it) or when
--deadline-s passes.

  serve --host H                 UDP echo + TCP sink on one port; each TCP stream is answered with
                                 {"bytes", "crc32c", "seconds"} after the sender shuts its side
  measure --to H:P               RTT by UDP echo (one probe in flight, as ping) and a timed TCP stream
  tcp-send --to H:P --bytes N    N seeded bytes over one TCP stream; the sink's count and crc32c back
  channel-recv --host H --secret F       a fate-rdma Endpoint (soft provider) receiving --count messages
  channel-send --host H --secret F --to ADDR --bytes N   N seeded bytes to ADDR (--reps times)
  grpc-serve --host H / grpc-send --to H:P --bytes N     a gRPC client stream of N bytes, verified
  mooncake --role recv|send --host H --bytes N   a Mooncake TE (TCP transport, P2PHANDSHAKE) side driven by
                                 JSON lines on stdin: write / fill / crc (fate_rdma_lab.bench.mooncake_peer's engine)
  burn                           one busy-looping process (a CPU stress) until stdin closes or --deadline-s

Senders given --wait-go print {"ready": true} once connected, then before each timed transfer read one
line "go T" from stdin and start at wall-clock time T (time.time()): several senders in several sites
then start together (the sites are namespaces of one machine: one clock).

Payloads are `wan_tcp.payload(n, seed)`: both sides of a test can name the bytes without sending them twice.
The TCP and UDP probes themselves are in `fate_rdma_lab.testbed.tcp`.
Only the channel commands import the channel; the rest is the standard library and crc32c.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import select
import socket
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple, Union, cast

import crc32c

from fate_rdma_lab.testbed.tcp import ECHO_MAGIC, KEEP_MAGIC, payload, rtt_probe, sink, tcp_kept, tcp_stream

def emit(obj: Dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _addr(s: str) -> Tuple[str, int]:
    host, sep, port = s.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"want HOST:PORT, got {s!r}")
    return host, int(port)


def wait_go() -> None:
    """Block until the parent says "go T", then until wall-clock time T (a shared start across sites)."""
    line = sys.stdin.readline()
    if not line.startswith("go "):
        raise RuntimeError(f"expected 'go <time>' on stdin, got {line.strip()!r}" if line else "stdin closed before go")
    delay = float(line.split()[1]) - time.time()
    if delay > 0:
        time.sleep(delay)


def _stdin_read1() -> bytes:
    """Up to 4 KiB of what stdin holds, with one read at most (b"": closed). Its binary side is a
    BufferedReader (typeshed says BinaryIO, which has no read1)."""
    return cast(io.BufferedReader, sys.stdin.buffer).read1(4096)


def _stdin_closed_or(deadline: float) -> None:
    """Block until stdin reaches EOF or the deadline passes (a server's lifetime)."""
    while time.monotonic() < deadline:
        r, _, _ = select.select([sys.stdin], [], [], min(1.0, max(0.0, deadline - time.monotonic())))
        if r and not _stdin_read1():
            return


# -- serve: UDP echo + TCP sink ---------------------------------------------------------------------
def serve(host: str, port: int, deadline_s: float, idle_timeout_s: float) -> int:
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((host, port))
    tcp = socket.create_server((host, udp.getsockname()[1]))
    stop = threading.Event()

    def echo() -> None:
        udp.settimeout(0.5)
        while not stop.is_set():
            try:
                data, peer = udp.recvfrom(2048)
            except socket.timeout:
                continue
            except OSError:
                return
            if data.startswith(ECHO_MAGIC):
                udp.sendto(data, peer)

    def accept() -> None:
        tcp.settimeout(0.5)
        while not stop.is_set():
            try:
                conn, _ = tcp.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=sink, args=(conn, idle_timeout_s), daemon=True).start()

    threads = [threading.Thread(target=echo, daemon=True), threading.Thread(target=accept, daemon=True)]
    for t in threads:
        t.start()
    emit({"ready": True, "address": f"{host}:{tcp.getsockname()[1]}"})
    try:
        _stdin_closed_or(time.monotonic() + deadline_s)
    finally:
        stop.set()
        udp.close()
        tcp.close()
    return 0


# -- fate-rdma channel ------------------------------------------------------------------------------
def _channel_config(args: argparse.Namespace) -> Any:
    from fate_rdma.config import ChannelConfig

    # same_host=False: the soft provider would otherwise copy straight from the sender's memory
    # (process_vm_readv) between the namespaces of this one machine, and no byte would cross the link
    window = args.window if args.window == "auto" else int(args.window)
    link_enable = {"true": True, "false": False}.get(args.link_enable, args.link_enable)
    # (the testbed's sites share one secret and no certificates: a lab of one operator)
    return ChannelConfig(provider="soft", same_host=False, secret_file=args.secret, shared_secret_only=True, mode=args.mode,
                         chunk_bytes=args.chunk_bytes, window=window, qps_per_peer=args.qps, link_enable=link_enable,
                         link_rate_bps=args.link_rate_mbit * 1e6 if args.link_rate_mbit else None,
                         slot_bytes=args.slot_bytes, pool_slots=2, connect_timeout_s=args.timeout_s,
                         no_progress_timeout_s=args.timeout_s, transfer_timeout_s=args.timeout_s)


def channel_recv(args: argparse.Namespace) -> int:
    from fate_rdma.channel import Endpoint

    with Endpoint(_channel_config(args), host=args.host, port=args.port) as ep:
        emit({"ready": True, "address": ep.address, "label": ep.label})
        for _ in range(args.count):
            msg = ep.recv(timeout=args.timeout_s)
            try:
                emit({"peer": msg.peer, "nbytes": msg.nbytes, "crc32c": crc32c.crc32c(msg.view),
                      "mode": msg.mode, "metadata": msg.metadata})
            finally:
                msg.release()
        # stay until the sender is done with us (its futures resolve on our verdicts)
        _stdin_closed_or(time.monotonic() + args.timeout_s)
    return 0


def channel_send(args: argparse.Namespace) -> int:
    from fate_rdma.channel import Endpoint

    data = payload(args.bytes, args.seed)
    crc = crc32c.crc32c(data)
    with Endpoint(_channel_config(args), host=args.host) as ep:
        if args.warmup:  # connect, authenticate and probe the RTT outside the timed transfers
            ep.send(args.to, payload(args.chunk_bytes, 0), {"warmup": True}).result(timeout=args.timeout_s)
        if args.wait_go:
            emit({"ready": True, "address": ep.address, "crc32c": crc})
        for rep in range(args.reps):
            if args.wait_go:
                wait_go()
            t0 = time.perf_counter()
            info = ep.send(args.to, data, {"seed": args.seed, "rep": rep}).result(timeout=args.timeout_s)
            dt = time.perf_counter() - t0
            emit({"rep": rep, "bytes": len(data), "crc32c": crc, "seconds": dt, "bps": len(data) * 8 / dt,
                  "label": ep.label, "address": ep.address, "info": info if isinstance(info, dict) else repr(info)})
    return 0


def burn(deadline_s: float) -> int:
    """Spin on one core until stdin closes (checked every ~50 ms) or the deadline passes."""
    emit({"ready": True, "pid": os.getpid()})
    end = time.monotonic() + deadline_s
    x = 0
    while time.monotonic() < end:
        t = time.monotonic() + 0.05
        while time.monotonic() < t:
            x += 1
        if select.select([sys.stdin], [], [], 0)[0] and not _stdin_read1():
            break
    return 0


# -- gRPC client stream (what FATE-style federation over gRPC does with one large payload) ----------
GRPC_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


def grpc_serve(args: argparse.Namespace) -> int:
    import grpc
    from concurrent import futures

    def stream(request_iterator: Any, context: Any) -> bytes:
        total, crc = 0, 0
        for part in request_iterator:
            total += len(part)
            crc = crc32c.crc32c(part, crc)
        return json.dumps({"bytes": total, "crc32c": crc}).encode()

    ident = lambda b: b  # noqa: E731  raw bytes, no protobuf
    handler = grpc.method_handlers_generic_handler("wan.Probe", {
        "Stream": grpc.stream_unary_rpc_method_handler(stream, ident, ident)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port(f"{args.host}:0")
    server.start()
    emit({"ready": True, "address": f"{args.host}:{port}"})
    try:
        _stdin_closed_or(time.monotonic() + args.deadline_s)
    finally:
        server.stop(0)
    return 0


def grpc_send(args: argparse.Namespace) -> int:
    import grpc

    data = payload(args.bytes, args.seed)
    crc = crc32c.crc32c(data)
    mv = memoryview(data)
    with grpc.insecure_channel(f"{args.to[0]}:{args.to[1]}", options=GRPC_OPTIONS) as ch:
        call = ch.stream_unary("/wan.Probe/Stream", request_serializer=lambda b: b, response_deserializer=lambda b: b)
        call(iter([b"x"]), timeout=args.timeout_s)  # warm-up: the HTTP/2 connection outside the timed streams
        for rep in range(args.reps):
            parts = (bytes(mv[o:o + args.chunk_bytes]) for o in range(0, len(data), args.chunk_bytes))
            t0 = time.perf_counter()
            sink = json.loads(call(parts, timeout=args.timeout_s))
            dt = time.perf_counter() - t0
            ok = sink["bytes"] == len(data) and sink["crc32c"] == crc
            emit({"rep": rep, "bytes": len(data), "crc32c": crc, "seconds": dt, "bps": len(data) * 8 / dt,
                  "sink": sink, "ok": ok})
            if not ok:
                return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fate_rdma_lab.testbed.probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--host", required=True)
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--deadline-s", type=float, default=600.0)
    s.add_argument("--idle-timeout-s", type=float, default=60.0, help="a TCP stream silent this long is dropped")
    m = sub.add_parser("measure")
    m.add_argument("--to", type=_addr, required=True)
    m.add_argument("--pings", type=int, default=10)
    m.add_argument("--seconds", type=float, default=2.0, help="length of the TCP stream (0: no stream)")
    m.add_argument("--timeout-s", type=float, default=30.0)
    g = sub.add_parser("grpc-serve")
    g.add_argument("--host", required=True)
    g.add_argument("--deadline-s", type=float, default=600.0)
    g = sub.add_parser("grpc-send")
    g.add_argument("--to", type=_addr, required=True)
    g.add_argument("--bytes", type=int, required=True)
    g.add_argument("--chunk-bytes", type=int, default=1 << 20, help="bytes per streamed message")
    g.add_argument("--reps", type=int, default=1)
    g.add_argument("--seed", type=int, default=1)
    g.add_argument("--timeout-s", type=float, default=120.0)
    t = sub.add_parser("tcp-send")
    t.add_argument("--to", type=_addr, required=True)
    t.add_argument("--bytes", type=int, required=True)
    t.add_argument("--seed", type=int, default=1)
    t.add_argument("--timeout-s", type=float, default=60.0)
    t.add_argument("--reps", type=int, default=1, help="transfers, each on a new connection, one JSON line each")
    t.add_argument("--wait-go", action="store_true", help="print ready, then wait for 'go T' before each transfer")
    t.add_argument("--keep", action="store_true", help="one connection for every transfer (opened before ready)")
    mc = sub.add_parser("mooncake")
    mc.add_argument("--role", required=True, choices=["recv", "send"])
    mc.add_argument("--host", required=True, help="this site's address (the engine's local server name)")
    mc.add_argument("--bytes", type=int, required=True, help="bytes to register (the sender's are its payload)")
    mc.add_argument("--seed", type=int, default=1)
    b = sub.add_parser("burn")
    b.add_argument("--deadline-s", type=float, default=600.0)
    for name in ("channel-recv", "channel-send"):
        c = sub.add_parser(name)
        c.add_argument("--host", required=True, help="this site's address (the endpoint binds it)")
        c.add_argument("--secret", required=True, help="the federation secret file (non-loopback endpoints need one)")
        c.add_argument("--mode", default="fedrdma-e", choices=["fedrdma", "fedrdma-e"])
        c.add_argument("--chunk-bytes", type=int, default=1 << 20)
        c.add_argument("--slot-bytes", type=int, default=64 << 20)
        c.add_argument("--timeout-s", type=float, default=60.0)
        c.add_argument("--window", default="auto", help="chunks in flight: a number (1 = the paper) or auto")
        c.add_argument("--link-rate-mbit", type=float, default=0.0,
                       help="nominal link rate for the automatic window (0: the channel's default)")
        c.add_argument("--qps", type=_qps, default=1, help="qps_per_peer: QPs (soft provider: TCP streams) per peer, or "
                                                            "auto (4 where the RTT is >= 10 ms, else 1)")
        c.add_argument("--link-enable", default="auto", choices=["true", "false", "auto"],
                       help="Link-Enable: a 4 KiB first chunk (auto: on from 4 Gbit/s nominal rate)")
        if name == "channel-recv":
            c.add_argument("--port", type=int, default=0)
            c.add_argument("--count", type=int, default=1)
        else:
            c.add_argument("--to", required=True, help="the receiver's HOST:PORT")
            c.add_argument("--bytes", type=int, required=True)
            c.add_argument("--seed", type=int, default=1)
            c.add_argument("--reps", type=int, default=1, help="timed transfers, one JSON line each")
            c.add_argument("--warmup", action="store_true", help="one untimed chunk first (connect, RTT probe)")
            c.add_argument("--wait-go", action="store_true", help="print ready, then wait for 'go T' before each transfer")
    return p


def _qps(text: str) -> Union[int, str]:
    return text if text == "auto" else int(text)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "serve":
            return serve(args.host, args.port, args.deadline_s, args.idle_timeout_s)
        if args.cmd == "measure":
            out: Dict[str, Any] = {"rtt": rtt_probe(args.to, args.pings, min(args.timeout_s, 2.0))}
            if args.seconds > 0:
                out["tcp"] = tcp_stream(args.to, None, args.seconds, args.timeout_s)
            emit(out)
            return 0
        if args.cmd == "tcp-send":
            data = payload(args.bytes, args.seed)
            kept = socket.create_connection(args.to, timeout=args.timeout_s) if args.keep else None
            if kept is not None:
                kept.sendall(KEEP_MAGIC)
            if args.wait_go:
                emit({"ready": True, "crc32c": crc32c.crc32c(data)})
            for _ in range(args.reps):
                if args.wait_go:
                    wait_go()
                out = tcp_kept(kept, data) if kept is not None else tcp_stream(args.to, data, 0.0, args.timeout_s)
                emit(out)
                if not out["ok"]:
                    return 1
            return 0
        if args.cmd == "mooncake":
            from fate_rdma_lab.bench.mooncake_peer import stdin_side

            return stdin_side(args.role, args.host, args.bytes, args.seed, emit)
        if args.cmd == "burn":
            return burn(args.deadline_s)
        if args.cmd == "channel-recv":
            return channel_recv(args)
        if args.cmd == "grpc-serve":
            return grpc_serve(args)
        if args.cmd == "grpc-send":
            return grpc_send(args)
        return channel_send(args)
    except Exception as exc:  # one line the parent can show: which command, what failed
        emit({"error": f"{args.cmd}: {type(exc).__name__}: {exc}"})
        return 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
