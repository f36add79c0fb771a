"""A connection's path as the protocol's policy sizes transfers for it: its measured round trip (the RTT probe),
its kind as the provider reports it (easypyverbs.DataPath: a NIC, TCP streams, an emulated link, a copy on one
host) and its QPs give the chunk, the window and the QPs in use (protocol/policy.py)."""
from __future__ import annotations

from typing import Tuple

import easypyverbs as ev

from ..config import ChannelConfig
from ..protocol.policy import path_rate_bps, qps_in_use, short_tcp_path, slot_chunk_bytes, window_for
from .control import RttProbe


class Path:
    """`nqps`: the connection's QPs; `kind`: how its data QPs move payloads (posting.connection_path)."""

    def __init__(self, cfg: ChannelConfig, probe: RttProbe, ctx: ev.Context, nqps: int, kind: ev.DataPath) -> None:
        self.cfg, self.probe, self.ctx, self.nqps, self.kind = cfg, probe, ctx, nqps, kind

    def rate_bps(self) -> float:
        return path_rate_bps(self.cfg.link_rate_bps, self.ctx.link_rate_bps)

    def slot_chunk(self) -> int:
        """FedRDMA-E's chunk on this path (policy.slot_chunk_bytes)."""
        cfg = self.cfg
        return slot_chunk_bytes(cfg.chunk_bytes, cfg.same_host_chunk_bytes, self.kind.same_host,
                                cfg.tcp_chunk_bytes, short_tcp_path(self.kind.paced_by_tcp, self.probe.rtt_s))

    def window(self, fedrdma_e: bool) -> Tuple[int, int]:
        """(chunks in flight, chunk bytes) for a transfer in FedRDMA-E (`fedrdma_e`) or FedRDMA: the automatic
        window holds the same bytes whatever the chunk."""
        cfg = self.cfg
        chunk = self.slot_chunk() if fedrdma_e else cfg.chunk_bytes
        return window_for(cfg.window, self.rate_bps(), self.probe.rtt_s or 0.0, chunk, cfg.min_auto_window,
                          cfg.max_window, self.kind), chunk

    @property
    def active_qps(self) -> int:
        """The QPs chunks are striped over now (policy.qps_in_use)."""
        return qps_in_use(self.cfg.qps_per_peer, self.probe.rtt_s, self.nqps)
