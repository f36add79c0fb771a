"""Holds: a process whose Python cannot run for a while (native code keeping the GIL, as FATE's secure
aggregation does for seconds on a large model) must not fail its own transfers for it.

easypyverbs.stalls' clock leaves such holds out, so the channel's deadlines (a receiver dropping a transfer
that sent no chunk for no_progress_timeout_s) and the soft provider's receive-queue wait count only time in
which the process could act; the endpoint counts each hold and says what it did. A peer's hold still counts
against this side's deadline: its no_progress_timeout_s must exceed that (the soft provider's kernel
timeouts follow it)."""
from __future__ import annotations

import ctypes
import time

import crc32c
import numpy as np
import pytest

from easypyverbs import stalls
from fate_rdma.channel import Endpoint
from fate_rdma.config import ChannelConfig

from .test_channel import Peer, cfg_for


def hold_gil(seconds: float) -> None:
    ctypes.PyDLL(None).usleep(int(seconds * 1e6))  # PyDLL: the GIL stays held through the call


def test_the_clock_leaves_out_a_hold_and_reports_it():
    stalls.ensure_watching()
    got = []
    token = stalls.subscribe(lambda s, _t: got.append(s))
    try:
        time.sleep(0.3)
        c0, m0 = stalls.clock(), time.monotonic()
        time.sleep(1.0)  # an idle wait is not a hold
        c1, m1 = stalls.clock(), time.monotonic()
        assert abs((c1 - c0) - (m1 - m0)) < 0.2
        hold_gil(1.6)
        time.sleep(0.3)  # the watchdog's next beat
        c2, m2 = stalls.clock(), time.monotonic()
    finally:
        stalls.unsubscribe(token)
    assert m2 - m1 >= 1.6
    assert (c2 - c1) < (m2 - m1) - 1.0, "the hold was counted as time this process could act"
    assert len(got) == 1 and 1.3 <= got[0] <= 2.5, got


def test_the_soft_nic_waits_for_a_held_peer_as_long_as_the_channel():
    """The soft provider's kernel send/receive timeouts end a QP whose peer reads nothing for that long: they
    follow no_progress_timeout_s, so a held peer gets the channel's whole deadline."""
    cfg = ChannelConfig(provider="soft", no_progress_timeout_s=90)
    with Endpoint(cfg) as ep:
        assert ep.ctx.retry_timeout_s == 90
    with Endpoint(ChannelConfig(provider="soft", no_progress_timeout_s=5)) as ep:
        assert ep.ctx.retry_timeout_s == 30  # (never below the provider's own default)


@pytest.mark.parametrize("mode", ["fedrdma", "fedrdma-e"])
def test_a_held_receiver_keeps_the_transfer_it_was_receiving(mode):
    """The receiver's process is held for 2.5 s in the middle of a transfer, more than twice its own
    no_progress_timeout_s: once it runs again, the transfer it was receiving must go on and arrive whole, not be
    dropped for a silence that was its own. (The sender allows 20 s: the hold is a peer's there.)"""
    # 6 MiB: about 0.5 s on the wire, so the hold falls inside it; FedRDMA-E: a slot it fits in
    link = dict(soft_link="rate=100mbit", slot_bytes=8 << 20)
    peer = Peer(cfg_for(mode, "soft-tcp", no_progress_timeout_s=1.0, **link))
    ep = Endpoint(cfg_for(mode, "soft-tcp", no_progress_timeout_s=20, **link))
    try:
        data = np.random.default_rng(5).integers(0, 255, 6 << 20, dtype=np.uint8)
        ep.send(peer.address, b"warm-up").result(20)
        peer.expect(1)
        peer.proc.cmd({"cmd": "hold", "seconds": 2.5, "after_s": 0.15})
        fut = ep.send(peer.address, data, {"n": 1})
        info = fut.result(30)
        rec = peer.expect(1, timeout_s=30)[-1]
        assert rec["nbytes"] == data.nbytes and rec["crc32c"] == crc32c.crc32c(data)
        assert info["seconds"] >= 2.0, "the hold did not fall inside the transfer: the test proves nothing"
        stats = peer.proc.cmd({"cmd": "stats"})
        assert stats["holds"] == 1 and 2.0 <= stats["longest_hold_s"] <= 4.0, stats
    finally:
        ep.close()
        peer.close()
