"""The transfer bench's baselines: over loopback TCP raw TCP (plain, and with the channel's check,
checked_tcp.py), gRPC and Mooncake TE, on the same host the cheapest copy out of the sender's shared memory
(plain, and with the check, checked_shm.py), each moving the same payload to the peer process; and the
pairing of the channel's transfers with raw TCP ones (`bench transfer`, transfer.py)."""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import crc32c
import numpy as np

from fate_rdma.config import ChannelConfig
from easypyverbs.buffers import shared_array

from fate_rdma_lab.bench import checked_shm, checked_tcp, mooncake
from fate_rdma_lab.bench.cpu import cpu_s
from fate_rdma_lab.bench.driver import PeerProcess, RawTcp
from fate_rdma_lab.bench.report import median

MiB = 1 << 20
GRPC_CHUNK = 4 * MiB
PAYLOAD_SEED = 0  # the Mooncake sender process regenerates the payload from it


def grpc_times(peer: PeerProcess, payload: bytes, reps: int,
               methods: Tuple[str, ...] = ("grpc_stream", "grpc_unary")) -> Dict[str, List[float]]:
    import grpc

    from fate_rdma_lab.bench.transfer_peer import GRPC_OPTIONS

    port = peer.cmd({"cmd": "grpc"})["port"]
    ident = lambda b: b  # noqa: E731
    out: Dict[str, List[float]] = {k + m: [] for k in ("", "rss_", "cpu_send_", "cpu_recv_")
                                   for m in ("grpc_stream", "grpc_unary")}
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as ch:
        stream = ch.stream_unary("/bench.Bench/Stream", request_serializer=ident, response_deserializer=ident)
        unary = ch.unary_unary("/bench.Bench/Unary", request_serializer=ident, response_deserializer=ident)
        stream(iter([b"warm-up"]))
        unary(b"warm-up")
        for _ in range(reps):
            for name, call in (("grpc_stream", lambda: stream((payload[i:i + GRPC_CHUNK] for i in range(0, len(payload), GRPC_CHUNK)))),
                               ("grpc_unary", lambda: unary(payload))):
                if name not in methods:
                    continue
                mark = peer.cmd({"cmd": "mark"})
                c0, t0 = cpu_s(), time.perf_counter()
                call()
                reply = peer.cmd({"cmd": "expect", "count": mark["count"] + 1})
                out[name].append(time.perf_counter() - t0)
                out["cpu_send_" + name].append(cpu_s() - c0)
                out["cpu_recv_" + name].append(reply["cpu_s"] - mark["cpu_s"])
                out["rss_" + name].append(max(0, reply["extra_rss_bytes"] - len(payload)))
    return out


def pair(raw: RawTcp, data: np.ndarray, check: Optional[str] = None) -> Callable[[], float]:
    """One raw TCP transfer of `data` on the baselines' open connection, its seconds (the raw TCP row's
    transfers, and a channel row's pairs); with `check`, the checked one (checked_tcp.py)."""
    return lambda: raw.stream(data.data, 4 * MiB, data.nbytes, data.nbytes, check=check)


def paired(res: Dict[str, Any]) -> Dict[str, Any]:
    """A row's raw TCP transfers, each run beside one of its own (paired_raw_tcp_seconds, their median), and
    x_raw_tcp: the median over those pairs of raw TCP's time / the row's (a throughput ratio), which the
    machine's drift between the raw TCP row and this one does not move."""
    if not res["paired"]:
        return {}
    return {"paired_raw_tcp_seconds": round(median(res["paired"]), 4),
            "x_raw_tcp": round(median([r / t for r, t in zip(res["paired"], res["times"])]), 3)}


def run_baselines(peer: PeerProcess, scen: str, methods: List[str], data: np.ndarray, reps: int, add: Any,
                  checksum: str = "blake3", pairs: bool = True) -> Optional[RawTcp]:
    """Raw TCP (with `raw_tcp_checked`, once more with the channel's `checksum` done on both sides), gRPC and
    Mooncake TE over loopback TCP, and the same-host copies (checked_shm.py), each against the same payload;
    with `pairs`, the checked and the copy rows' transfers each paired with a raw TCP one. The raw TCP
    connection stays open (returned) for the channel's rows to pair their transfers with."""
    raw = RawTcp(peer) if {"raw_tcp", "raw_tcp_checked", *checked_shm.METHODS} & set(methods) else None
    try:
        if raw is not None and "raw_tcp" in methods:
            _raw_row(peer, scen, pair(raw, data), reps, add, {"method": "raw_tcp"})
        if raw is not None and "raw_tcp_checked" in methods:
            if checksum in checked_tcp.KINDS:
                _raw_row(peer, scen, pair(raw, data, checksum), reps, add, {"method": "raw_tcp_checked", "checksum": checksum},
                         pair_with=pair(raw, data) if pairs else None)
            else:
                add({"scenario": scen, "method": "raw_tcp_checked", "checksum": checksum,
                     "skipped": f"raw TCP has no {checksum} check to price (it takes crc32c or xxh3: --checksum)"})
        if raw is not None and set(checked_shm.METHODS) & set(methods):
            _shm_rows(peer, raw, methods, data, reps, add, checksum, pairs)
        _other_baselines(peer, scen, methods, data, reps, add)
    except BaseException:
        if raw is not None:
            raw.close()
        raise
    return raw


def _raw_row(peer: PeerProcess, scen: str, stream: Callable[[], float], reps: int, add: Any, fields: Dict[str, Any],
             pair_with: Optional[Callable[[], float]] = None) -> None:
    """A baseline's row: a warm-up, then `reps` transfers with the CPU of both sides; with `pair_with` (a raw
    TCP transfer), each paired with one of those as the channel's rows are (`paired`)."""
    stream()  # warm-up
    ts, cpu_send, cpu_recv, pairs = [], [], [], []
    for i in range(reps):
        if pair_with is not None and i % 2 == 0:
            pairs.append(pair_with())
        c_recv = peer.cmd({"cmd": "mark"})["cpu_s"]
        c_send = cpu_s()
        ts.append(stream())
        cpu_send.append(cpu_s() - c_send)
        cpu_recv.append(peer.cmd({"cmd": "cpu"})["cpu_s"] - c_recv)
        if pair_with is not None and i % 2 == 1:
            pairs.append(pair_with())
    r = peer.cmd({"cmd": "peak"})
    add({"scenario": scen, "window": None, "provider": "tcp", "path": "tcp", "emulated": False, **fields,
         "seconds": round(median(ts), 4), "extra_rss_bytes": r["extra_rss_bytes"], "chunks": None,
         **paired({"paired": pairs, "times": ts})}, cpu_send, cpu_recv)


def shm_copy(raw: RawTcp, data: np.ndarray, region: List[int], check: Optional[str]) -> Callable[[], float]:
    """One same-host copy of `data` (in the shared `region`) by the peer, its seconds: from the peer's "ready" to
    its acknowledgement; with `check`, this side digests its blocks meanwhile and sends them (checked_shm.py)."""
    cmd = {"cmd": "shm", "pid": os.getpid(), "region": region, "addr": int(data.ctypes.data), "total_bytes": data.nbytes,
           "check": check}

    def go() -> float:
        raw.peer.conn.send(cmd)
        if raw.sock.recv(1) != b"r":
            raise RuntimeError(f"same-host copy refused: {raw.peer.conn.recv(60).get('error')}")
        t0 = time.perf_counter()
        if check:
            checked_shm.send_digests(raw.sock, data.data, check)
        return raw.finish(t0, "same-host copy failed")
    return go


def _shm_rows(peer: PeerProcess, raw: RawTcp, methods: List[str], data: np.ndarray, reps: int, add: Any,
              checksum: str, pairs: bool) -> None:
    """The same-host copy rows (scenario `loopback`: they exist only between processes of one host), from
    `data`'s own shared memory or, for a private source, a shared copy of it made first."""
    src = data
    region = checked_shm.sender_region(data)
    if region is None:
        src = shared_array(data.nbytes)
        src[:] = data
        region = checked_shm.sender_region(src)
        assert region is not None, "shared_array's memory is a shared region"
    for m, check in (("shm_copy", None), ("shm_copy_checked", checksum)):
        if m not in methods:
            continue
        fields = {"scenario": "loopback", "method": m, "checksum": check or "none"}
        if check is not None and check not in checked_tcp.KINDS:
            add({**fields, "skipped": f"no {check} check to price on a plain copy (it takes crc32c or xxh3: --checksum)"})
            continue
        try:
            _raw_row(peer, "loopback", shm_copy(raw, src, region, check), reps, add,
                     {**fields, "provider": "memfd", "path": "same-host copy"}, pair_with=pair(raw, data) if pairs else None)
        except RuntimeError as exc:
            add({**fields, "skipped": str(exc)})


def _other_baselines(peer: PeerProcess, scen: str, methods: List[str], data: np.ndarray, reps: int, add: Any) -> None:
    """gRPC and Mooncake TE over loopback TCP, each against the same payload."""
    nbytes = data.nbytes
    if {"grpc_stream", "grpc_unary"} & set(methods):
        g = grpc_times(peer, data.tobytes(), reps)
        for m in ("grpc_stream", "grpc_unary"):
            if m in methods:
                add({"scenario": scen, "method": m, "window": None, "provider": "grpc", "path": "tcp", "emulated": False,
                     "seconds": round(median(g[m]), 4), "extra_rss_bytes": int(median(g["rss_" + m])),
                     "chunks": -(-nbytes // GRPC_CHUNK) if m == "grpc_stream" else 1},
                    g["cpu_send_" + m], g["cpu_recv_" + m])
    if set(mooncake.METHODS) & set(methods):
        crc = crc32c.crc32c(data.data)
        for m, res in mooncake.measure(methods, peer.host, nbytes, PAYLOAD_SEED, crc, reps, ChannelConfig().chunk_bytes).items():
            add({"scenario": scen, "method": m, "window": None, "provider": "mooncake-te", "path": "tcp", "emulated": False,
                 "extra_rss_bytes": None, **res})
