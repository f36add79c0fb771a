"""One site's side of `fate-rdma eval faults` (and tests/test_resume_wan.py), run in the site's network namespace:

    python -m fate_rdma_lab.eval.faults_site receive CONFIG_JSON ADDRESS COUNT TIMEOUT_S
    python -m fate_rdma_lab.eval.faults_site send CONFIG_JSON ADDRESS PEER COUNT MAX_BYTES SEED [IN_FLIGHT]

The receiver prints {"listening", "pid"}, then one JSON line per message ({"i", "bytes", "ok": its bytes are
the ones the sender made, "tid", "at"}), and {"end": messages, "held_bytes"} once COUNT arrived or TIMEOUT_S
passed (after a second more, for a message that would come twice: {"extra": true} lines). The sender sends COUNT
payloads of random sizes up to MAX_BYTES, made from their index and SEED (the receiver makes them again to check
them), at most IN_FLIGHT (4) queued at once, and prints {"sent"} at the end and one line per result: {"i",
"bytes", "resumes", "resent_bytes", "resume_wait_s", "window", "chunks", "qps", "seconds", "at"} or {"i", "error"}. `at`: seconds on the monotonic clock.
"""
from __future__ import annotations

import collections
import json
import os
import sys
import time
from typing import Any, Deque, Dict, Tuple

import numpy as np

from fate_rdma.channel import Endpoint, TransferFuture
from fate_rdma.config import ChannelConfig
from fate_rdma.errors import FateRdmaError, TransferTimeout


def payload(i: int, seed: int, max_bytes: int) -> np.ndarray:
    rng = np.random.default_rng([seed, i])
    n = int(rng.integers(1, max_bytes + 1))
    return rng.integers(0, 256, n, dtype=np.uint8)


def out(obj: Dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def receive(cfg: ChannelConfig, address: str, count: int, timeout_s: float) -> None:
    host, port = address.rsplit(":", 1)
    with Endpoint(cfg, host=host, port=int(port), name=address) as ep:
        out({"listening": address, "pid": os.getpid()})
        deadline, got = time.monotonic() + timeout_s, 0
        while got < count:
            try:
                m = ep.recv(max(0.1, deadline - time.monotonic()))
            except TransferTimeout:
                break
            md = m.metadata
            want = payload(md["i"], md["seed"], md["max"])
            out({"i": md["i"], "bytes": m.nbytes, "tid": m.transfer_id, "ok": bytes(m.view) == want.tobytes(),
                 "at": time.monotonic()})
            m.release()
            got += 1
        time.sleep(1.0)  # (a message delivered twice would come now)
        while True:
            try:
                m = ep.recv(0.1)
            except TransferTimeout:
                break
            out({"i": m.metadata.get("i"), "bytes": m.nbytes, "tid": m.transfer_id, "ok": False, "extra": True})
            m.release()
        out({"end": got, "held_bytes": ep.resumer.held_bytes if ep.resumer else 0})


def send(cfg: ChannelConfig, address: str, peer: str, count: int, max_bytes: int, seed: int, in_flight: int) -> None:
    host, port = address.rsplit(":", 1)
    queued: Deque[Tuple[int, TransferFuture]] = collections.deque()

    def settle(i: int, f: TransferFuture) -> None:
        try:
            r = f.result(3600)
            out({"i": i, "bytes": r["bytes"], "resumes": r["resumes"], "resent_bytes": r["resent_bytes"],
                 "resume_wait_s": r["resume_wait_s"], "window": r["window"], "chunks": r["chunks"], "chunk_bytes": r["chunk_bytes"],
                 "qps": r["qps"], "seconds": r["seconds"],
                 "at": time.monotonic()})
        except FateRdmaError as exc:
            out({"i": i, "error": f"{type(exc).__name__}: {exc}", "at": time.monotonic()})

    with Endpoint(cfg, host=host, port=int(port), name=address) as ep:
        for i in range(count):
            if len(queued) >= in_flight:
                settle(*queued.popleft())
            queued.append((i, ep.send(peer, payload(i, seed, max_bytes), {"i": i, "seed": seed, "max": max_bytes})))
        while queued:
            settle(*queued.popleft())
        out({"sent": count})


if __name__ == "__main__":
    role, conf, *rest = sys.argv[1:]
    c = ChannelConfig(**json.loads(conf))
    if role == "receive":
        receive(c, rest[0], int(rest[1]), float(rest[2]))
    elif role == "send":
        send(c, rest[0], rest[1], int(rest[2]), int(rest[3]), int(rest[4]), int(rest[5]) if len(rest) > 5 else 4)
    else:
        sys.exit(f"faults_site: unknown role {role!r} (receive or send)")
