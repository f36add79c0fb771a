"""A process with two endpoints that writes Prometheus metrics (metrics_dir) for tests/test_metrics.py:
transfers of known sizes from `a` to `b`, one that `b` refuses (too large), and a dial with the wrong secret.
Prints one JSON line: b's address and the payload bytes `b` accepted."""
from __future__ import annotations

import json
import sys

from fate_rdma import errors as E
from fate_rdma.channel import Endpoint
from fate_rdma.config import ChannelConfig


def main(metrics_dir: str, secret: str, other_secret: str) -> None:
    base = dict(provider="soft", mode="fedrdma-e", chunk_bytes=64 << 10, slot_bytes=1 << 20, connect_timeout_s=5,
                no_progress_timeout_s=10, metrics_dir=metrics_dir)
    sizes = [300_000, 1 << 20, 5]
    with Endpoint(ChannelConfig(secret_file=secret, **base), name="a") as a, \
            Endpoint(ChannelConfig(secret_file=secret, max_payload_bytes=2 << 20, **base)) as b:
        for n in sizes:
            a.send(b.address, b"w" * n).result(20)
            b.recv(20).release()
        try:
            a.send(b.address, b"x" * (3 << 20)).result(20)
            raise SystemExit("a 3 MiB payload passed a receiver that takes at most 2 MiB")
        except E.PayloadTooLarge:
            pass
        with Endpoint(ChannelConfig(secret_file=other_secret, **base), name="stranger") as s:
            try:
                s.send(b.address, b"y").result(10)
                raise SystemExit("a dial with another secret got through")
            except E.AuthenticationError:
                pass
        print(json.dumps({"b": b.address, "a": "a", "bytes": sum(sizes), "transfers": len(sizes)}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
