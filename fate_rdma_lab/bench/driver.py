"""Driving a peer process (fate_rdma_lab.bench.peer) and streaming RDMA WRITEs to it."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Any, Dict, Optional

import easypyverbs as ev

from fate_rdma_lab.bench import checked_tcp


class PeerProcess:
    """A `fate_rdma_lab.bench.peer` child process and its bootstrap connection."""

    def __init__(self, host: str = "127.0.0.1", timeout_s: float = 60.0, module: str = "fate_rdma_lab.bench.peer") -> None:
        self.host = host
        self._listener = ev.Listener(host, 0)
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "--connect", f"{host}:{self._listener.address[1]}"], env=env)
        try:
            self.conn = self._listener.accept(timeout_s)
        except ev.BootstrapError:
            self.proc.kill()
            raise
        finally:
            self._listener.close()

    def cmd(self, obj: Dict[str, Any], timeout_s: float = 600.0) -> Dict[str, Any]:
        self.conn.send(obj)
        reply = self.conn.recv(timeout_s)
        if not reply.get("ok", False):
            raise RuntimeError(f"peer failed {obj.get('cmd')}: {reply.get('error')}")
        return reply

    def close(self) -> None:
        try:
            self.cmd({"cmd": "exit"}, timeout_s=30)
        except Exception:
            pass
        self.conn.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "PeerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect_verbs(peer: PeerProcess, provider: str, link: Optional[str], mr_bytes: int, src: ev.MR,
                  recvs: int = 1) -> ev.RCConnection:
    """Have the peer register `mr_bytes` and connect an RC QP to it from `src`'s context."""
    peer.conn.send({"cmd": "verbs", "provider": provider, "link": link, "mr_bytes": mr_bytes, "recvs": recvs})
    return ev.establish(src.pd.ctx, peer.conn, pd=src.pd, timeout_s=60, owns_bootstrap=False)


def stream_writes(rc: ev.RCConnection, src: ev.MR, remote: ev.RemoteMR, total_bytes: int, msg_bytes: int,
                  window: int = 32, imm: Optional[int] = None, timeout_s: float = 120.0,
                  src_offset_wraps: bool = True) -> float:
    """WRITE `total_bytes` in `msg_bytes` messages, `window` in flight; returns seconds until the last completion.

    Offsets wrap around both MRs (so a benchmark can move more than it registers). With `imm`, the
    last message is a WRITE_WITH_IMM, which the peer sees as a completion after all the data.
    """
    count = -(-total_bytes // msg_bytes) if total_bytes else 0
    window = max(1, min(window, rc.qp.cap.max_send_wr))
    posted = done = 0
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    while done < count:
        while posted < count and posted - done < window:
            off = posted * msg_bytes
            n = min(msg_bytes, total_bytes - off)
            s_off = off % (src.length - n + 1) if src_offset_wraps else off
            r_off = off % (remote.length - n + 1)
            if imm is not None and posted == count - 1:
                rc.qp.post_write_with_imm(src.sge(s_off, n), remote, imm, remote_offset=r_off, wr_id=posted)
            else:
                rc.qp.post_write(src.sge(s_off, n), remote, remote_offset=r_off, wr_id=posted)
            posted += 1
        for wc in rc.send_cq.wait(max(0.0, deadline - time.monotonic()), max_entries=window):
            if not wc.ok:
                raise ev.CompletionError(wc)
            done += 1
    return time.perf_counter() - t0


class RawTcp:
    """The baseline: sendall/recv_into over one persistent TCP connection to the peer process."""

    def __init__(self, peer: PeerProcess) -> None:
        self.peer = peer
        with socket.create_server((peer.host, 0)) as srv:
            srv.settimeout(60)
            peer.conn.send({"cmd": "raw_connect", "port": srv.getsockname()[1]})
            self.sock, _ = srv.accept()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(None)  # blocking sends, the fastest Python TCP path; the peer's replies bound the wait
        if not peer.conn.recv(60).get("ok"):
            raise RuntimeError("raw TCP peer failed to connect")

    def stream(self, payload: memoryview, msg_bytes: int, total_bytes: int, peer_buf_bytes: int,
               check: Optional[str] = None) -> float:
        """Seconds to move `total_bytes` in `msg_bytes` sendalls until the peer acknowledges.

        Offsets wrap through `payload` and the peer's `peer_buf_bytes` buffer exactly as
        `stream_writes` wraps through the MRs, so both touch the same memory. With `check` (crc32c,
        xxh3): `payload` once, each piece digested on both sides and compared (checked_tcp.py).
        """
        self.peer.conn.send({"cmd": "raw", "msg_bytes": msg_bytes, "total_bytes": total_bytes, "buf_bytes": peer_buf_bytes,
                             "check": check})
        if self.sock.recv(1) != b"r":
            raise RuntimeError("raw TCP peer not ready")
        t0 = time.perf_counter()
        if check:
            checked_tcp.send(self.sock, payload[:total_bytes], check)
        else:
            off = 0
            while off < total_bytes:
                n = min(msg_bytes, total_bytes - off)
                s_off = off % (payload.nbytes - n + 1)
                self.sock.sendall(payload[s_off : s_off + n])
                off += n
        return self.finish(t0, "raw TCP peer failed")

    def finish(self, t0: float, failed: str) -> float:
        """Seconds since `t0` until the peer's acknowledgement on this connection; its command's answer
        checked (a failure raised as `failed`: the peer's error)."""
        ack = self.sock.recv(1)
        dt = time.perf_counter() - t0
        reply = self.peer.conn.recv(60)
        if ack != b"k" or not reply.get("ok"):
            raise RuntimeError(f"{failed}: {reply.get('error') or 'no acknowledgement'}")
        return dt

    def close(self) -> None:
        self.sock.close()
