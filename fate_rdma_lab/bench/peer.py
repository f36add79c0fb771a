"""The far end of the verbs benchmark and the verbs demo: a separate process driven over a bootstrap socket.

    python -m fate_rdma_lab.bench.peer --connect HOST:PORT

Commands (JSON over the bootstrap connection):
- {"cmd": "raw_connect", "port"}: open the raw TCP baseline's connection (kept for all runs).
- {"cmd": "raw", "msg_bytes", "total_bytes", "buf_bytes"[, "check"]}: receive `total_bytes` on it with
  recv_into (the raw TCP baseline), then answer one byte; with "check" (crc32c, xxh3) each piece
  digested as it lands and the sender's digests compared (checked_tcp.py).
- {"cmd": "verbs", "provider", "link", "mr_bytes", "recvs"}: open a device, register `mr_bytes`
  for REMOTE_WRITE, connect an RC QP (establish), post `recvs` zero-length receives for WRITE_WITH_IMM.
- {"cmd": "verify", "nbytes", "timeout_s"}: wait for one WRITE_WITH_IMM completion, then answer the
  crc32c of the first `nbytes` of the MR.
- {"cmd": "exit"}
"""
from __future__ import annotations

import argparse
import logging
import socket
import sys
import time
from typing import Any, Dict, Optional

import crc32c
import numpy as np

import easypyverbs as ev

from fate_rdma_lab.bench import checked_tcp


class _RawReceiver:
    """The raw TCP baseline's receiving end: one persistent connection, a pre-touched buffer."""

    def __init__(self) -> None:
        self.sock: Optional[socket.socket] = None
        self.buf = memoryview(b"")

    def connect(self, host: str, port: int) -> Dict[str, Any]:
        self.sock = socket.create_connection((host, port), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(None)  # blocking, as the soft provider's sockets: no poll() per recv
        return {"ok": True}

    def receive(self, cmd: Dict[str, Any]) -> Dict[str, Any]:
        """Receive like the verbs path does: into a buffer of `buf_bytes` at wrapping offsets."""
        assert self.sock is not None, "raw before raw_connect"
        size = int(cmd["buf_bytes"])
        if cmd.get("check") and int(cmd["total_bytes"]) > size:
            return {"ok": False, "error": f"a checked transfer of {cmd['total_bytes']} bytes into {size}"}
        if self.buf.nbytes != size:
            self.buf = np.ones(size, dtype=np.uint8).data.cast("B")
        msg, total = int(cmd["msg_bytes"]), int(cmd["total_bytes"])
        self.sock.sendall(b"r")  # ready: the sender starts its clock after this
        if cmd.get("check"):
            error = checked_tcp.receive(self.sock, self.buf[:total], str(cmd["check"]))
            self.sock.sendall(b"x" if error else b"k")
            return {"ok": False, "error": error} if error else {"ok": True}
        off = 0
        while off < total:
            n = min(msg, total - off)
            r_off = off % (size - n + 1)
            view = self.buf[r_off : r_off + n]
            pos = 0
            while pos < n:
                got = self.sock.recv_into(view[pos:])
                if not got:
                    return {"ok": False, "error": f"sender closed with {total - off - pos} bytes missing"}
                pos += got
            off += n
        self.sock.sendall(b"k")
        return {"ok": True}

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


def serve(host: str, port: int) -> int:
    conn = ev.connect(host, port, timeout_s=30)
    ctx: Optional[ev.Context] = None
    rc: Optional[ev.RCConnection] = None
    mr: Optional[ev.MR] = None
    raw = _RawReceiver()
    try:
        while True:
            cmd = conn.recv(timeout_s=600)
            op = cmd.get("cmd")
            if op == "raw_connect":
                conn.send(raw.connect(host, int(cmd["port"])))
            elif op == "raw":
                conn.send(raw.receive(cmd))
            elif op == "verbs":
                ctx = ev.open_device(provider=cmd.get("provider") or "auto", link=cmd.get("link") or None)
                buf = np.ones(int(cmd["mr_bytes"]), dtype=np.uint8)  # touched, like the raw TCP buffer
                pd = ctx.alloc_pd()
                mr = pd.reg_mr(buf, ev.Access.all_rdma())
                rc = ev.establish(ctx, conn, mrs={"dst": mr}, pd=pd, extra={"label": ctx.label}, owns_bootstrap=False)
                for i in range(int(cmd.get("recvs", 1))):
                    rc.qp.post_recv([], wr_id=i)
            elif op == "verify":
                assert rc is not None and mr is not None, "verify before verbs"
                t0 = time.monotonic()
                (wc,) = rc.recv_cq.wait(float(cmd.get("timeout_s", 60)), max_entries=1)
                if not wc.ok:
                    conn.send({"ok": False, "error": f"completion {wc.status.name}"})
                    continue
                crc = crc32c.crc32c(mr.view(0, int(cmd["nbytes"])))
                conn.send({"ok": True, "crc32c": crc, "imm": wc.imm_data, "wait_s": time.monotonic() - t0})
            elif op == "exit":
                conn.send({"ok": True})
                return 0
            else:
                conn.send({"ok": False, "error": f"unknown command {op!r}"})
    finally:
        raw.close()
        if rc is not None:
            rc.close()
        if ctx is not None:
            ctx.close()
        conn.close()


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connect", required=True, help="HOST:PORT of the driving process")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="peer %(levelname)s %(name)s: %(message)s")
    host, _, port = a.connect.rpartition(":")
    return serve(host, int(port))


if __name__ == "__main__":
    sys.exit(main())
