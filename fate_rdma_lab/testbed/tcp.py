"""The WAN testbed's network probes, run inside its sites by `fate_rdma_lab.testbed.probe`: the seeded
payloads both ends can name, the TCP sink (a stream per transfer, answered after the sender shuts its
side, or a kept stream of length-framed transfers, each answered), the UDP echo RTT probe and the TCP
stream sender. The standard library and crc32c only."""
from __future__ import annotations

import json
import random
import socket
import statistics
import struct
import time
from typing import Any, Dict, List, Optional, Tuple

import crc32c

STREAM_BUF_BYTES = 1 << 20   # send/receive granularity of the TCP stream (a multiple of any MSS)
ECHO_MAGIC = b"FRWP"          # UDP probes: magic, sequence, send time; stray datagrams are ignored


def payload(nbytes: int, seed: int) -> bytes:
    """Deterministic test bytes (not all-zero, so a dropped or misplaced chunk changes the crc32c)."""
    return random.Random(seed).randbytes(nbytes)


KEEP_MAGIC = b"FRKEEP01"      # a kept stream's first bytes: then transfers framed as 8-byte length + bytes
_LEN = struct.Struct("!Q")


def _sink_kept(conn: socket.socket, buf: bytearray) -> None:
    """One kept connection, many transfers: a JSON line after each (framed by length)."""
    while True:
        head = conn.recv(_LEN.size, socket.MSG_WAITALL)
        if len(head) < _LEN.size:
            return
        (left,), total, crc, t0 = _LEN.unpack(head), 0, 0, time.perf_counter()
        while left:
            n = conn.recv_into(buf, min(left, len(buf)))
            if not n:
                return
            crc, total, left = crc32c.crc32c(memoryview(buf)[:n], crc), total + n, left - n
        conn.sendall(json.dumps({"bytes": total, "crc32c": crc, "seconds": time.perf_counter() - t0}).encode() + b"\n")


def sink(conn: socket.socket, idle_timeout_s: float) -> None:
    conn.settimeout(idle_timeout_s)
    buf = bytearray(STREAM_BUF_BYTES)
    try:
        if conn.recv(len(KEEP_MAGIC), socket.MSG_PEEK | socket.MSG_WAITALL) == KEEP_MAGIC:
            conn.recv(len(KEEP_MAGIC), socket.MSG_WAITALL)
            _sink_kept(conn, buf)
            conn.close()
            return
    except OSError:
        conn.close()
        return
    total, crc, t0 = 0, 0, None
    try:
        while True:
            n = conn.recv_into(buf)
            if not n:
                break
            if t0 is None:
                t0 = time.perf_counter()
            total += n
            crc = crc32c.crc32c(memoryview(buf)[:n], crc)
        dt = time.perf_counter() - t0 if t0 is not None else 0.0
        conn.sendall(json.dumps({"bytes": total, "crc32c": crc, "seconds": dt}).encode() + b"\n")
    except OSError:
        pass  # the sender's side reports the failure; a sink must not die of one stream
    finally:
        conn.close()


def rtt_probe(to: Tuple[str, int], count: int, timeout_s: float) -> Dict[str, Any]:
    """`count` UDP echoes, one in flight at a time; RTTs in ms, and how many got no answer in time."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect(to)
    rtts: List[float] = []
    lost = 0
    try:
        for seq in range(count):
            t0 = time.perf_counter()
            s.send(ECHO_MAGIC + struct.pack("!Id", seq, t0))
            deadline = t0 + timeout_s
            while True:
                left = deadline - time.perf_counter()
                if left <= 0:
                    lost += 1
                    break
                s.settimeout(left)
                try:
                    data = s.recv(2048)
                except (socket.timeout, ConnectionRefusedError):
                    lost += 1
                    break
                if data[:4] == ECHO_MAGIC and struct.unpack("!I", data[4:8])[0] == seq:
                    rtts.append((time.perf_counter() - t0) * 1e3)
                    break
            time.sleep(0.02)  # ping's spirit: probes apart, not a burst through the queue
    finally:
        s.close()
    out: Dict[str, Any] = {"probes": count, "lost": lost}
    if rtts:
        out.update(min_ms=min(rtts), median_ms=statistics.median(rtts), max_ms=max(rtts))
    return out


def tcp_kept(conn: socket.socket, data: bytes) -> Dict[str, Any]:
    """One transfer over a kept connection (KEEP_MAGIC already sent); the sink's report back."""
    t0 = time.perf_counter()
    conn.sendall(_LEN.pack(len(data)))
    _send_all(conn, data)
    return _result(len(data), crc32c.crc32c(data), time.perf_counter() - t0, _report(conn))


def _send_all(s: socket.socket, data: bytes) -> None:
    mv = memoryview(data)
    for off in range(0, len(data), STREAM_BUF_BYTES):
        s.sendall(mv[off:off + STREAM_BUF_BYTES])


def _report(s: socket.socket) -> Dict[str, Any]:
    """The sink's JSON line."""
    reply = b""
    while not reply.endswith(b"\n"):
        part = s.recv(4096)
        if not part:
            raise ConnectionError("the TCP sink closed without a report")
        reply += part
    return json.loads(reply)


def _result(total: int, crc: int, dt: float, sink: Dict[str, Any]) -> Dict[str, Any]:
    return {"bytes": total, "crc32c": crc, "seconds": dt, "bps": total * 8 / dt if dt > 0 else 0.0,
            "sink": sink, "ok": sink["bytes"] == total and sink["crc32c"] == crc}


def tcp_stream(to: Tuple[str, int], data: Optional[bytes], seconds: float, timeout_s: float) -> Dict[str, Any]:
    """Send `data` (or a repeated buffer for `seconds`) over one TCP connection; the sink's report back.

    Throughput is bytes / (first send .. the sink's report), so bytes still queued count fully."""
    crc, total = 0, 0
    chunk = data if data is not None else payload(STREAM_BUF_BYTES, 7)
    with socket.create_connection(to, timeout=timeout_s) as s:
        s.settimeout(timeout_s)
        t0 = time.perf_counter()
        if data is not None:
            _send_all(s, data)
            total, crc = len(data), crc32c.crc32c(data)
        else:
            while time.perf_counter() - t0 < seconds:
                s.sendall(chunk)
                total += len(chunk)
                crc = crc32c.crc32c(chunk, crc)
        s.shutdown(socket.SHUT_WR)
        sink = _report(s)
        dt = time.perf_counter() - t0
    return _result(total, crc, dt, sink)
