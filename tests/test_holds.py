"""Holds: a process whose Python cannot run for a while (native code keeping the GIL, as FATE's secure
aggregation does for seconds on a large model) must not fail its own transfers for it.

easypyverbs.stalls' clock leaves such holds out, so the channel's deadlines (a receiver dropping a transfer
that sent no chunk for no_progress_timeout_s) and the soft provider's receive-queue wait count only time in
which the process could act; the endpoint counts each hold and says what it did. A peer's hold still counts
against this side's deadline: its no_progress_timeout_s must exceed that (the soft provider's kernel
timeouts follow it)."""
from __future__ import annotations

import threading
import time

import crc32c
import numpy as np
import pytest

from easypyverbs import stalls
from fate_rdma.bench.transfer_peer import hold_gil
from fate_rdma.channel import Endpoint
from fate_rdma.config import ChannelConfig

from .test_channel import Peer, cfg_for


def test_the_clock_leaves_out_a_hold_and_reports_it():
    stalls.ensure_watching()
    got = []
    token = stalls.subscribe(lambda s, _t: got.append(s))
    try:
        time.sleep(0.3)
        c0, m0 = stalls.clock(), time.monotonic()
        time.sleep(1.0)  # an idle wait is not a hold
        c1, m1 = stalls.clock(), time.monotonic()
        assert abs((c1 - c0) - (m1 - m0)) < 0.3
        hold_gil(1.6)
        c2, m2 = stalls.clock(), time.monotonic()  # the first thing to run after it: the hold is left out at once
        time.sleep(0.3)  # the watchdog's next beat tells the subscriber
    finally:
        stalls.unsubscribe(token)
    assert m2 - m1 >= 1.6
    assert (c2 - c1) < (m2 - m1) - 1.0, "the hold was counted as time this process could act"
    assert got and 1.3 <= max(got) <= 2.5, got


def test_the_clock_never_runs_backwards_across_holds():
    """Threads reading the clock while the process is held now and then, each read after the one before."""
    stalls.ensure_watching()
    stop, backwards, reads = [False], [0.0], [0]

    def reader() -> None:
        last = stalls.clock()
        while not stop[0]:
            now = stalls.clock()
            backwards[0] = max(backwards[0], last - now)
            last = now
            reads[0] += 1

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(3):
            time.sleep(0.2)
            hold_gil(0.6)
    finally:
        stop[0] = True
        for t in threads:
            t.join()
    assert reads[0] > 1000 and backwards[0] == 0.0, (reads[0], backwards[0])


def test_the_soft_nic_waits_for_a_held_peer_as_long_as_the_channel():
    """The soft provider's kernel send/receive timeouts end a QP whose peer reads nothing for that long: they
    follow no_progress_timeout_s, so a held peer gets the channel's whole deadline."""
    cfg = ChannelConfig(provider="soft", no_progress_timeout_s=90)
    with Endpoint(cfg) as ep:
        assert ep.ctx.retry_timeout_s == 90
    with Endpoint(ChannelConfig(provider="soft", no_progress_timeout_s=5)) as ep:
        assert ep.ctx.retry_timeout_s == 30  # (never below the provider's own default)


def test_the_no_progress_default_stays_within_a_shorter_total():
    """A configuration that shortens transfer_timeout_s below the default no-progress deadline (valid when that
    default was 30 s) still loads: the total bounds it. One that sets both the wrong way round is refused."""
    assert ChannelConfig(transfer_timeout_s=60).no_progress_timeout_s == 60
    with pytest.raises(Exception, match="no_progress_timeout_s exceeds transfer_timeout_s"):
        ChannelConfig(transfer_timeout_s=60, no_progress_timeout_s=90)


@pytest.mark.parametrize("mode", ["fedrdma", "fedrdma-e"])
def test_a_held_receiver_keeps_the_transfer_it_was_receiving(mode):
    """The receiver's process is held for 3 s in the middle of a transfer, more than twice its own
    no_progress_timeout_s: once it runs again, the transfer it was receiving must go on and arrive whole, not be
    dropped for a silence that was its own (FedRDMA: its staged receiver drops a transfer that sent no chunk for
    that long; before easypyverbs.stalls it did so here, "no chunk for 1.2 s"). FedRDMA-E's receiver keeps no
    such deadline: there the test shows that a hold mid-transfer breaks nothing. The sender allows 30 s: the
    hold is a peer's there."""
    # 16 MiB: about 1.3 s on the wire, so the hold falls inside it; FedRDMA-E: a slot it fits in
    link = dict(soft_link="rate=100mbit", slot_bytes=16 << 20)
    peer = Peer(cfg_for(mode, "soft-tcp", no_progress_timeout_s=1.2, **link))
    ep = Endpoint(cfg_for(mode, "soft-tcp", no_progress_timeout_s=30, **link))
    try:
        data = np.random.default_rng(5).integers(0, 255, 16 << 20, dtype=np.uint8)
        ep.send(peer.address, b"warm-up").result(30)
        peer.expect(1)
        fut = ep.send(peer.address, data, {"n": 1})
        deadline = time.monotonic() + 30
        while fut.progress_bytes < 1 << 20:  # the receiver holds part of it
            assert not fut.done() and time.monotonic() < deadline, "the transfer ended or stalled before the hold"
            time.sleep(0.005)
        at_hold = fut.progress_bytes
        peer.proc.cmd({"cmd": "hold", "seconds": 3.0, "after_s": 0})
        info = fut.result(60)
        rec = peer.expect(1, timeout_s=60)[-1]
        assert at_hold < data.nbytes
        assert rec["nbytes"] == data.nbytes and rec["crc32c"] == crc32c.crc32c(data)
        assert info["seconds"] >= 3.0
        stats = peer.proc.cmd({"cmd": "stats"})
        assert stats["holds"] >= 1 and 2.5 <= stats["longest_hold_s"] <= 5.0, stats
    finally:
        ep.close()
        peer.close()
