"""One site's side of tests/test_resume_wan.py, run in the site's network namespace (`ip netns exec`):

    python -m tests.resume_site receive CONFIG_JSON ADDRESS COUNT TIMEOUT_S
    python -m tests.resume_site send CONFIG_JSON ADDRESS PEER COUNT MAX_BYTES SEED

The receiver prints one JSON line per message ({"i", "bytes", "ok": its bytes are the ones the sender made,
"tid"}), then {"end": ..., "held_bytes"} once COUNT arrived or TIMEOUT_S passed. The sender sends COUNT
payloads of random sizes up to MAX_BYTES, each made from its index and SEED (so the receiver can check them),
and prints one JSON line per result ({"i", "bytes", "resumes", "resent_bytes"} or {"i", "error"})."""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from fate_rdma.channel import Endpoint
from fate_rdma.config import ChannelConfig
from fate_rdma.errors import FateRdmaError, TransferTimeout


def data(i: int, seed: int, max_bytes: int) -> np.ndarray:
    rng = np.random.default_rng([seed, i])
    n = int(rng.integers(1, max_bytes + 1))
    return rng.integers(0, 256, n, dtype=np.uint8)


def out(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def receive(cfg: ChannelConfig, address: str, count: int, timeout_s: float) -> None:
    host, port = address.rsplit(":", 1)
    with Endpoint(cfg, host=host, port=int(port), name=address) as ep:
        out({"listening": address})
        deadline, got = time.monotonic() + timeout_s, 0
        while got < count:
            try:
                m = ep.recv(max(0.1, deadline - time.monotonic()))
            except TransferTimeout:
                break
            md = m.metadata
            want = data(md["i"], md["seed"], md["max"])
            out({"i": md["i"], "bytes": m.nbytes, "tid": m.transfer_id, "ok": bytes(m.view) == want.tobytes()})
            m.release()
            got += 1
        time.sleep(1.0)  # (anything delivered twice would come now)
        while True:
            try:
                m = ep.recv(0.1)
            except TransferTimeout:
                break
            out({"i": m.metadata.get("i"), "bytes": m.nbytes, "tid": m.transfer_id, "ok": False, "extra": True})
        out({"end": got, "held_bytes": ep.resumer.held_bytes if ep.resumer else 0})


def send(cfg: ChannelConfig, address: str, peer: str, count: int, max_bytes: int, seed: int) -> None:
    host, port = address.rsplit(":", 1)
    with Endpoint(cfg, host=host, port=int(port), name=address) as ep:
        futs = [ep.send(peer, data(i, seed, max_bytes), {"i": i, "seed": seed, "max": max_bytes})
                for i in range(count)]
        out({"sent": count})
        for i, f in enumerate(futs):
            try:
                r = f.result(600)
                out({"i": i, "bytes": r["bytes"], "resumes": r["resumes"], "resent_bytes": r["resent_bytes"],
                     "seconds": r["seconds"]})
            except FateRdmaError as exc:
                out({"i": i, "error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    role, conf, *rest = sys.argv[1:]
    c = ChannelConfig(**json.loads(conf))
    if role == "receive":
        receive(c, rest[0], int(rest[1]), float(rest[2]))
    else:
        send(c, rest[0], rest[1], int(rest[2]), int(rest[3]), int(rest[4]))
