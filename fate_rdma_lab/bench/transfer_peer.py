"""The receiving process of `fate-rdma bench transfer`, driven over a bootstrap socket.

Commands: {"cmd": "raw_connect"/"raw"} as in fate_rdma_lab.bench.peer; {"cmd": "shm", "pid", "region", "addr",
"total_bytes", "check"}: copy out of the sender's shared memory (checked_shm.py); {"cmd": "grpc"} starts a gRPC
server (client-stream and unary methods over raw bytes); {"cmd": "endpoint", "config": {...}} opens
a fate-rdma Endpoint (optional "name", "allowed_peers", "party_names"); {"cmd": "stats"} reports its memory, threads and
refusals; {"cmd": "send", "address", "hex"} sends from it; {"cmd": "send_shared", "address", "nbytes", "wait"}
sends `nbytes` (beginning 01 02 03 04) from shared memory, as the FATE wrapper's put copies (tests; "wait": false
answers once the transfer is under way); {"cmd": "mark"} resets the peak-RSS counter before a measured transfer;
{"cmd": "cpu"} answers this process's CPU seconds so far (user + system, every thread; "mark", "peak" and
"expect" answer them too, so the bench takes the receiver's CPU time over each measured transfer);
{"cmd": "expect", "count": n} waits until n fate-rdma messages (each released at once) or gRPC
calls arrived in all, and answers with the peak RSS above the level before the last "mark" and
above the level before the endpoint was made, the endpoint's FedRDMA-E pool bytes (and, with "record": true on the
endpoint, each message's peer, size, crc32c and metadata, for tests); {"cmd": "hold", "seconds": s, "after_s": d}
holds this process's GIL for s seconds, d seconds from now, as native code that keeps the GIL does (tests of
easypyverbs.stalls); {"cmd": "exit"}.
"""
from __future__ import annotations

import argparse
import logging
import sys
import threading
from concurrent import futures
from typing import Any, Dict, List, Optional

import crc32c

import easypyverbs as ev
from easypyverbs.buffers import shared_array

from fate_rdma import metrics
from fate_rdma.channel import Endpoint
from fate_rdma.config import ChannelConfig
from fate_rdma_lab.bench.cpu import cpu_s
from fate_rdma_lab.bench.memory import peak_rss_bytes, reset_peak, rss_bytes
from fate_rdma_lab.bench.checked_shm import Receiver as ShmReceiver
from fate_rdma_lab.bench.peer import _RawReceiver

GRPC_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


class _Counter:
    def __init__(self) -> None:
        self.n = 0
        self.cv = threading.Condition()
        self.bytes: List[int] = []

        self.records: List[Dict[str, Any]] = []

    def hit(self, nbytes: int, record: Optional[Dict[str, Any]] = None) -> None:
        with self.cv:
            self.n += 1
            self.bytes.append(nbytes)
            if record is not None:
                self.records.append(record)
            self.cv.notify_all()

    def wait(self, count: int, timeout: float) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: self.n >= count, timeout)


def _grpc_server(counter: _Counter) -> Any:
    import grpc

    def stream(request_iterator: Any, context: Any) -> bytes:
        total = 0
        for chunk in request_iterator:
            total += len(chunk)
        counter.hit(total)
        return b"ok"

    def unary(request: bytes, context: Any) -> bytes:
        counter.hit(len(request))
        return b"ok"

    ident = lambda b: b  # noqa: E731  raw bytes, no protobuf
    handler = grpc.method_handlers_generic_handler("bench.Bench", {
        "Stream": grpc.stream_unary_rpc_method_handler(stream, ident, ident),
        "Unary": grpc.unary_unary_rpc_method_handler(unary, ident, ident),
    })
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def hold_gil(seconds: float, after_s: float = 0.0) -> None:
    """Keep this process's GIL for `seconds`, `after_s` from now: a PyDLL call does not release it, as native
    code that holds it (FATE's secure aggregation) does not (tests of easypyverbs.stalls)."""
    import ctypes
    import time

    time.sleep(after_s)
    ctypes.PyDLL(None).usleep(int(seconds * 1e6))


def serve(host: str, port: int) -> int:
    conn = ev.connect(host, port, timeout_s=30)
    raw = _RawReceiver()
    shm_rx = ShmReceiver()
    counter = _Counter()
    ep: Optional[Endpoint] = None
    record = False
    server = None
    base_rss = ep_base_rss = rss_bytes()

    def drain(mine: Endpoint) -> None:  # ends when its endpoint is replaced or closed (one drainer each)
        while ep is mine:
            try:
                msg = mine.recv(timeout=0.5)
            except Exception:
                continue
            n = msg.nbytes
            rec = {"peer": msg.peer, "nbytes": n, "crc32c": crc32c.crc32c(msg.view), "metadata": msg.metadata,
                   "mode": msg.mode} if record else None
            msg.release()
            counter.hit(n, rec)

    held: List[Any] = []  # the buffer of a send_shared that did not wait for its transfer
    try:
        while True:
            cmd: Dict[str, Any] = conn.recv(timeout_s=3600)
            op = cmd.get("cmd")
            if op == "raw_connect":
                conn.send(raw.connect(host, int(cmd["port"])))
            elif op == "raw":
                conn.send(raw.receive(cmd))
            elif op == "shm":
                assert raw.sock is not None, "shm before raw_connect"
                conn.send(shm_rx.receive(cmd, raw.sock))
            elif op == "grpc":
                server, gport = _grpc_server(counter)
                conn.send({"ok": True, "port": gport})
            elif op == "endpoint":
                if ep is not None:
                    old, ep = ep, None
                    old.close()
                record = bool(cmd.get("record"))
                ep_base_rss = rss_bytes()
                cfg = ChannelConfig.from_dict(cmd["config"])
                if not cfg.metrics_dir:  # (a bench row with metrics on came before: they stay on otherwise)
                    metrics.disable()
                ep = Endpoint(cfg, host, name=cmd.get("name"),
                              allowed_peers=cmd.get("allowed_peers"), party_names=cmd.get("party_names"))
                threading.Thread(target=drain, args=(ep,), daemon=True).start()
                conn.send({"ok": True, "address": ep.address, "label": ep.label, "emulated": ep.ctx.emulated})
            elif op == "mark":
                base_rss = ep_base_rss = rss_bytes()
                conn.send({"ok": True, "peak_reset": reset_peak(), "count": counter.n, "cpu_s": cpu_s()})
            elif op == "cpu":
                conn.send({"ok": True, "cpu_s": cpu_s()})
            elif op == "peak":
                conn.send({"ok": True, "extra_rss_bytes": max(0, peak_rss_bytes() - base_rss), "cpu_s": cpu_s()})
            elif op == "expect":
                ok = counter.wait(int(cmd["count"]), float(cmd.get("timeout_s", 600)))
                cpu = cpu_s()  # first: what follows is the bench's bookkeeping, not the transfer's
                conn.send({"ok": ok, "cpu_s": cpu, "error": "" if ok else "messages did not arrive in time",
                           "extra_rss_bytes": max(0, peak_rss_bytes() - base_rss), "bytes": counter.bytes[-1:],
                           "endpoint_rss_bytes": max(0, peak_rss_bytes() - ep_base_rss),
                           "pool_bytes": ep.pool_bytes() if ep is not None else 0,
                           "records": counter.records[-int(cmd["count"]):] if record else []})
            elif op == "stats":  # for the adversary tests: what the endpoint holds now
                conn.send({"ok": True, "rss_bytes": rss_bytes(), "threads": threading.active_count(),
                           "refused": ep.refused if ep is not None else 0,
                           "last_refusal": ep.last_refusal if ep is not None else "",
                           "budget_held_bytes": ep.budget.held_bytes if ep is not None else 0,
                           "pool_bytes": ep.pool_bytes() if ep is not None else 0,
                           "windowed_slots": sum(p["windowed_slots"] for p in ep.pool_report()["peers"].values())
                           if ep is not None else 0,
                           "peers": ep.peers() if ep is not None else [], "count": counter.n,
                           "holds": ep.holds if ep is not None else 0,
                           "longest_hold_s": ep.longest_hold_s if ep is not None else 0.0})
            elif op == "hold":
                threading.Thread(target=hold_gil, args=(float(cmd["seconds"]), float(cmd["after_s"])), daemon=True).start()
                conn.send({"ok": True})
            elif op == "send":  # this endpoint sends to `address` (as the victim answering a party)
                try:
                    assert ep is not None, "send before endpoint"
                    info = ep.send(cmd["address"], bytes.fromhex(cmd["hex"]), cmd.get("metadata")).result(30)
                    conn.send({"ok": True, "info": info})
                except Exception as exc:
                    conn.send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            elif op == "send_shared":
                buf = shared_array(int(cmd["nbytes"]))
                buf[:4] = (1, 2, 3, 4)
                assert ep is not None, "send_shared before endpoint"
                fut = ep.send(cmd["address"], buf)
                if not cmd.get("wait", True):
                    held[:] = [buf]  # kept while its transfer may run (the last one only)
                    conn.send({"ok": True})
                    continue
                try:
                    conn.send({"ok": True, "info": fut.result(60)})
                except Exception as exc:
                    conn.send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            elif op == "exit":
                conn.send({"ok": True})
                return 0
            else:
                conn.send({"ok": False, "error": f"unknown command {op!r}"})
    finally:
        raw.close()
        shm_rx.close()
        if server is not None:
            server.stop(0)
        if ep is not None:
            e, ep = ep, None
            e.close()
        conn.close()


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connect", required=True)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="peer %(levelname)s %(name)s: %(message)s")
    host, _, port = a.connect.rpartition(":")
    return serve(host, int(port))


if __name__ == "__main__":
    sys.exit(main())
