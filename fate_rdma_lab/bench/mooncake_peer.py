"""One side of the Mooncake Transfer Engine rows of `fate-rdma bench transfer`, driven over a bootstrap socket.

    python -m fate_rdma_lab.bench.mooncake_peer --connect HOST:PORT

Mooncake TE (PyPI `mooncake-transfer-engine-non-cuda`, the `mooncake` extra) with its TCP transport and
P2PHANDSHAKE metadata (the engines exchange segment descriptors themselves: no etcd, no metadata
server). Each side is its own process, so neither Mooncake's threads nor its CPU time mix with the
other methods' processes.

Commands (JSON):
- {"cmd": "open", "role": "recv"|"send", "host", "nbytes", "seed"}: start an engine on `host`, register
  `nbytes`: the receiver a touched destination buffer, the sender the bench's payload (regenerated
  from `seed` exactly as the driver makes it). Answers the engine's session name ("host:rpc_port"),
  the buffer's address and the package version; {"ok": false, "error"} where Mooncake cannot start.
- {"cmd": "write", "target", "dst_addr", "nbytes", "chunk_bytes"}: sender: chunk_bytes 0 is one
  transfer_sync_write of the whole payload; otherwise one batch_transfer_async_write of chunk_bytes
  pieces, then get_batch_transfer_status (waits for all). Answers seconds and this process's CPU
  seconds over the call.
- {"cmd": "cpu"}: this process's CPU seconds so far.
- {"cmd": "fill", "value"}: receiver: overwrite the buffer (so a write that moved nothing cannot pass).
- {"cmd": "crc", "nbytes"}: crc32c of the buffer's first nbytes.
- {"cmd": "exit"}
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import time
from typing import Any, Dict, Iterator, List, Optional

import crc32c
import numpy as np

import easypyverbs as ev

from fate_rdma_lab.bench.cpu import cpu_s

#: the PyPI distributions that install `mooncake.engine` (the first is the one the extra names)
DISTRIBUTIONS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")


def version() -> str:
    from importlib import metadata

    for dist in DISTRIBUTIONS:
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "mooncake (version unknown)"


@contextlib.contextmanager
def _stderr_captured() -> Iterator[io.StringIO]:
    """Collect what native code writes to fd 2 meanwhile (Mooncake's glog lines) instead of printing it.

    With P2PHANDSHAKE every engine logs an ERROR at start ("Local segment descriptor not found": its own
    segment, not yet published), which says nothing about the run; its return code does.
    """
    out = io.StringIO()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        try:
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            out.write(f.read().decode(errors="replace"))


class _Side:
    def __init__(self, role: str, host: str, nbytes: int, seed: int) -> None:
        from mooncake.engine import TransferEngine  # the optional extra: imported only when asked for

        self.engine = TransferEngine()
        with _stderr_captured() as log:  # its start-up lines, shown only if it fails
            rc = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"TransferEngine.initialize({host!r}, 'P2PHANDSHAKE', 'tcp', '') returned {rc}: "
                               + " | ".join(log.getvalue().strip().splitlines()[-5:]))
        if role == "send":  # the same bytes as the driver's payload, from the same seed
            self.buf = np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8)
        else:
            self.buf = np.ones(nbytes, dtype=np.uint8)  # touched, like the raw TCP receiver's buffer
        self.addr = int(self.buf.ctypes.data)
        rc = self.engine.register_memory(self.addr, nbytes)
        if rc != 0:
            raise RuntimeError(f"TransferEngine.register_memory of {nbytes} bytes returned {rc}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"

    def write(self, target: str, dst_addr: int, nbytes: int, chunk_bytes: int) -> Dict[str, Any]:
        c0, t0 = cpu_s(), time.perf_counter()
        if chunk_bytes <= 0:
            rc = self.engine.transfer_sync_write(target, self.addr, dst_addr, nbytes)
        else:
            offs: List[int] = list(range(0, nbytes, chunk_bytes))
            bid = self.engine.batch_transfer_async_write(target, [self.addr + o for o in offs], [dst_addr + o for o in offs],
                                                         [min(chunk_bytes, nbytes - o) for o in offs])
            rc = self.engine.get_batch_transfer_status([bid]) if bid else -1
        seconds, cpu = time.perf_counter() - t0, cpu_s() - c0
        if rc != 0:
            return {"ok": False, "error": f"Mooncake write to {target} returned {rc}"}
        return {"ok": True, "seconds": seconds, "cpu_s": cpu}


def stdin_side(role: str, host: str, nbytes: int, seed: int, emit: Any) -> int:
    """One side's engine commanded by JSON lines on stdin, its answers through `emit` (a WAN testbed
    site, `python -m fate_rdma_lab.testbed.probe mooncake`: a namespace cannot reach a bootstrap socket in the
    host namespace). Runs until the parent closes stdin."""
    import json

    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # a dozen INFO lines per transfer otherwise
    side = _Side(role, host, nbytes, seed)
    emit({"ready": True, "session": side.session, "addr": side.addr, "version": version(),
          "crc32c": crc32c.crc32c(side.buf.data) if role == "send" else None})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.get("cmd")
        if op == "write":
            r = side.write(cmd["target"], int(cmd["dst_addr"]), int(cmd["nbytes"]), int(cmd.get("chunk_bytes", 0)))
            emit(r if r.get("ok") else {"error": r.get("error", "write failed")})
        elif op == "fill":
            side.buf.fill(int(cmd.get("value", 0)))
            emit({"ok": True})
        elif op == "crc":
            emit({"crc32c": crc32c.crc32c(side.buf[:int(cmd["nbytes"])].data)})
        else:
            emit({"error": f"unknown command {op!r}"})
    return 0


def serve(host: str, port: int) -> int:
    conn = ev.connect(host, port, timeout_s=30)
    side: Optional[_Side] = None
    try:
        while True:
            cmd: Dict[str, Any] = conn.recv(timeout_s=3600)
            op = cmd.get("cmd")
            if op == "open":
                try:
                    side = _Side(cmd["role"], cmd["host"], int(cmd["nbytes"]), int(cmd.get("seed", 0)))
                except Exception as exc:  # ImportError (extra not installed), an engine that cannot start
                    conn.send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                    continue
                conn.send({"ok": True, "session": side.session, "addr": side.addr, "version": version()})
            elif op == "write" and side is not None:
                conn.send(side.write(cmd["target"], int(cmd["dst_addr"]), int(cmd["nbytes"]), int(cmd.get("chunk_bytes", 0))))
            elif op == "cpu":
                conn.send({"ok": True, "cpu_s": cpu_s()})
            elif op == "fill" and side is not None:
                side.buf.fill(int(cmd.get("value", 0)))
                conn.send({"ok": True})
            elif op == "crc" and side is not None:
                conn.send({"ok": True, "crc32c": crc32c.crc32c(side.buf[:int(cmd["nbytes"])].data)})
            elif op == "exit":
                conn.send({"ok": True})
                return 0
            else:
                conn.send({"ok": False, "error": f"unknown command {op!r}" if side is not None or op == "open"
                           else f"{op!r} before open"})
    finally:
        conn.close()


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connect", required=True)
    a = p.parse_args(argv)
    # Mooncake logs at INFO to stderr by default, a dozen lines per engine and transfer; its return codes are
    # checked instead. MC_LOG_LEVEL=INFO in the environment brings the lines back.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    host, _, port = a.connect.rpartition(":")
    return serve(host, int(port))


if __name__ == "__main__":
    sys.exit(main())
