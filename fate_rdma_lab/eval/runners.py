"""Timed, verified transfers between two sites of a WAN testbed, one function per kind of transport.

Each `run_*` starts the receiving side in the destination site and the sender in the source site
(fate_rdma_lab.testbed.probe), does one untimed warm-up, then `reps` timed transfers, and returns a `Result`:
per-run seconds, whether the receiver's byte count and crc32c matched the sender's, and how many
bytes crossed the source site's shaped link. A failure (timeout, refused, corrupted) is recorded in
`Result.error`, never raised: a stress study must say what broke and go on. `Result.check()` raises.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from fate_rdma_lab.testbed import bed as wan
from fate_rdma_lab.bench import mooncake
from fate_rdma_lab.testbed.run import SiteProcess, link_rx_bytes


@dataclass(frozen=True)
class Transport:
    name: str
    kind: str                      # "tcp", "grpc", "channel" or "mooncake"
    mode: str = ""                 # channel: fedrdma | fedrdma-e; mooncake: sync | batch
    window: str = ""               # channel: a number or "auto"
    qps: Union[int, str] = 1       # channel: qps_per_peer (soft provider: one TCP stream per QP), or "auto"
    link_enable: str = "auto"      # channel: true | false | auto

    @property
    def provider(self) -> str:
        return {"channel": "soft (emulated verbs over TCP, not RDMA)", "mooncake": "Mooncake TE TCP transport",
                "grpc": "gRPC over kernel TCP"}.get(self.kind, "kernel TCP")

    @property
    def chunked(self) -> bool:
        return self.kind in ("grpc", "channel") or (self.kind == "mooncake" and self.mode == "batch")


@dataclass
class Result:
    transport: Transport
    nbytes: int
    runs: List[Dict[str, Any]] = field(default_factory=list)   # {"seconds", "ok", ...} per timed transfer
    link_bytes: int = 0
    error: Optional[str] = None
    skipped: Optional[str] = None

    @property
    def verified(self) -> bool:
        return bool(self.runs) and all(r["ok"] for r in self.runs) and self.error is None

    @property
    def failures(self) -> List[str]:
        bad = [f"rep {i}: received {r.get('received_bytes')} B crc32c {r.get('received_crc32c')}, sent "
               f"{self.nbytes} B crc32c {r.get('crc32c')}" for i, r in enumerate(self.runs) if not r["ok"]]
        return bad + ([self.error] if self.error else [])

    def check(self) -> "Result":
        if self.skipped is None and not self.verified:
            raise wan.WanError(f"{self.transport.name}: {'; '.join(self.failures) or 'no transfer'}")
        return self


def tell(proc: SiteProcess, obj: Dict[str, Any]) -> None:
    """One JSON line to a site process's stdin (wan_probe's mooncake and --wait-go commands)."""
    proc.stdin.write((json.dumps(obj) + "\n").encode())
    proc.stdin.flush()


def run(tb: wan.Testbed, t: Transport, nbytes: int, chunk: Optional[int], reps: int, timeout_s: float,
        secret: str, rate_mbit: float = 0.0, src: int = 0, dst: int = 1) -> Result:
    res = Result(t, nbytes)
    if t.kind == "mooncake":
        res.skipped = mooncake.missing()
        if res.skipped:
            return res
    before = link_rx_bytes(tb, src)
    try:
        if t.kind == "tcp":
            _tcp(tb, res, reps, timeout_s, src, dst)
        elif t.kind == "grpc":
            _grpc(tb, res, chunk or 1 << 20, reps, timeout_s, src, dst)
        elif t.kind == "mooncake":
            _mooncake(tb, res, chunk or 0, reps, timeout_s, src, dst)
        else:
            _channel(tb, res, chunk or 1 << 20, reps, timeout_s, secret, rate_mbit, src, dst)
    except wan.WanError as exc:
        res.error = str(exc)
    res.link_bytes = link_rx_bytes(tb, src) - before
    if res.error is None and res.link_bytes < nbytes * len(res.runs):
        # e.g. a same-host shortcut between the namespaces' processes: the figure would not be the link's
        res.error = f"only {res.link_bytes} B crossed the link for {len(res.runs)} x {nbytes} B"
    return res


def _tcp(tb: wan.Testbed, res: Result, reps: int, timeout_s: float, src: int, dst: int) -> None:
    with SiteProcess(tb, dst, ["serve", "--host", tb.site_addr(dst), "--deadline-s", str(timeout_s * (reps + 2))]) as srv:
        addr = srv.line(30)["address"]
        # one connection per transfer (handshake and slow start included), the first a dropped warm-up
        with SiteProcess(tb, src, ["tcp-send", "--to", addr, "--bytes", str(res.nbytes), "--reps", str(reps + 1),
                                   "--timeout-s", str(timeout_s)]) as tx:
            for i in range(reps + 1):
                r = tx.line(timeout_s + 30)
                if i:
                    res.runs.append({"seconds": r["seconds"], "ok": r["ok"], "crc32c": r["crc32c"],
                                     "received_bytes": r["sink"]["bytes"], "received_crc32c": r["sink"]["crc32c"]})


def _grpc(tb: wan.Testbed, res: Result, chunk: int, reps: int, timeout_s: float, src: int, dst: int) -> None:
    deadline = str(timeout_s * (reps + 2))
    with SiteProcess(tb, dst, ["grpc-serve", "--host", tb.site_addr(dst), "--deadline-s", deadline]) as srv:
        addr = srv.line(60)["address"]
        with SiteProcess(tb, src, ["grpc-send", "--to", addr, "--bytes", str(res.nbytes), "--chunk-bytes", str(chunk),
                                   "--reps", str(reps), "--timeout-s", str(timeout_s)]) as tx:
            for _ in range(reps):
                r = tx.line(timeout_s + 60)
                res.runs.append({"seconds": r["seconds"], "ok": r["ok"], "crc32c": r["crc32c"],
                                 "received_bytes": r["sink"]["bytes"], "received_crc32c": r["sink"]["crc32c"]})


def channel_args(t: Transport, nbytes: int, chunk: int, timeout_s: float, secret: str, rate_mbit: float) -> List[str]:
    return ["--secret", secret, "--mode", t.mode, "--window", t.window or "auto", "--chunk-bytes", str(chunk),
            "--slot-bytes", str(max(nbytes, chunk)), "--timeout-s", str(timeout_s), "--qps", str(t.qps),
            "--link-enable", t.link_enable, "--link-rate-mbit", str(rate_mbit)]


def _channel(tb: wan.Testbed, res: Result, chunk: int, reps: int, timeout_s: float, secret: str, rate_mbit: float,
             src: int, dst: int) -> None:
    common = channel_args(res.transport, res.nbytes, chunk, timeout_s, secret, rate_mbit)
    with SiteProcess(tb, dst, ["channel-recv", "--host", tb.site_addr(dst), "--count", str(reps + 1), *common]) as rx:
        addr = rx.line(60)["address"]
        with SiteProcess(tb, src, ["channel-send", "--host", tb.site_addr(src), "--to", addr, "--bytes",
                                   str(res.nbytes), "--reps", str(reps), "--warmup", *common]) as tx:
            sent = [tx.line(timeout_s + 60) for _ in range(reps)]
        got = [rx.line(30) for _ in range(reps + 1)][1:]
    for s, g in zip(sent, got):
        info = s.get("info")
        if not isinstance(info, dict):
            info = {}
        res.runs.append({"seconds": s["seconds"], "crc32c": s["crc32c"], "received_bytes": g["nbytes"],
                         "received_crc32c": g["crc32c"], "ok": g["nbytes"] == res.nbytes and g["crc32c"] == s["crc32c"],
                         "window": info.get("window"), "label": s.get("label")})


def _mooncake(tb: wan.Testbed, res: Result, chunk: int, reps: int, timeout_s: float, src: int, dst: int) -> None:
    n = str(res.nbytes)
    with SiteProcess(tb, dst, ["mooncake", "--role", "recv", "--host", tb.site_addr(dst), "--bytes", n]) as rx, \
            SiteProcess(tb, src, ["mooncake", "--role", "send", "--host", tb.site_addr(src), "--bytes", n]) as tx:
        r, s = rx.line(60), tx.line(60)
        write = {"cmd": "write", "target": r["session"], "dst_addr": r["addr"], "nbytes": res.nbytes,
                 "chunk_bytes": chunk if res.transport.mode == "batch" else 0}
        tell(tx, write)  # warm-up: the segment, its connections, the pages
        tx.line(timeout_s + 30)
        for _ in range(reps):
            tell(rx, {"cmd": "fill", "value": 1})  # a write that moved nothing cannot pass
            rx.line(30)
            tell(tx, write)
            w = tx.line(timeout_s + 30)
            tell(rx, {"cmd": "crc", "nbytes": res.nbytes})
            c = rx.line(30)["crc32c"]
            res.runs.append({"seconds": w["seconds"], "crc32c": s["crc32c"], "received_bytes": res.nbytes,
                             "received_crc32c": c, "ok": c == s["crc32c"], "cpu_send_s": w["cpu_s"],
                             "label": s["version"]})
