"""The soft provider's link model: parsing, determinism, and that rate and delay are really applied."""
from __future__ import annotations

import time

import pytest

import easypyverbs as ev
from easypyverbs.providers.soft.link import Link, LinkModel

from .verbs_pair import close_pair, make_pair


def test_parse():
    m = LinkModel.parse("rate=10gbit, rtt=20ms, loss=0.1%, seed=3")
    assert (m.rate_bps, m.delay_s, m.loss, m.seed) == (10e9, 0.01, 0.001, 3)
    assert LinkModel.parse("delay=5ms").rtt_s == pytest.approx(0.01)
    assert not LinkModel.parse("").active
    for bad, match in (("rate=fast", "bad rate"), ("jitter=1", "unknown key"), ("loss=2", "loss"), ("rtt", "key=value")):
        with pytest.raises(ValueError, match=match):
            LinkModel.parse(bad)


def test_serialization_time_and_shared_link():
    link = Link(LinkModel(rate_bps=8e6))  # 1 MB/s
    t1 = link.reserve(500_000, now=100.0)
    t2 = link.reserve(500_000, now=100.0)  # queued behind the first
    assert t1 == pytest.approx(100.5) and t2 == pytest.approx(101.0)


def test_loss_is_deterministic_and_costs_time():
    m = LinkModel(rate_bps=1e9, delay_s=0.01, loss=0.01, seed=7)
    a, b = Link(m), Link(m)
    ta = [a.reserve(1 << 20, 0.0) for _ in range(5)]
    tb = [b.reserve(1 << 20, 0.0) for _ in range(5)]
    assert ta == tb and a.losses == b.losses > 0
    clean = Link(LinkModel(rate_bps=1e9)).reserve(5 << 20, 0.0)
    assert ta[-1] > clean + a.losses * m.rtt_s * 0.99


def test_rtt_delays_completions():
    sides = make_pair("soft", link="rtt=100ms")
    a, b = sides
    try:
        t0 = time.monotonic()
        a.qp.post_write(a.mr.sge(0, 64), b.mr.remote(), wr_id=1)
        assert a.cq.wait(5)[0].ok
        assert time.monotonic() - t0 >= 0.099  # data one way, ACK back
    finally:
        close_pair(sides)


def test_rate_paces_writes():
    sides = make_pair("soft", size=1 << 20, link="rate=40mbit")
    a, b = sides
    try:
        t0 = time.monotonic()
        for i in range(4):
            a.qp.post_write(a.mr.sge(0, 1 << 20), b.mr.remote(), wr_id=i)  # 4 MiB at 5 MB/s
        a.cq.wait_n(4, 10)
        assert time.monotonic() - t0 >= 0.8
    finally:
        close_pair(sides)


def test_env_configures_link(monkeypatch):
    monkeypatch.setenv("EASYPYVERBS_SOFT_LINK", "rate=1gbit,rtt=2ms")
    with ev.open_device(provider="soft") as ctx:
        assert ctx.link_model.rate_bps == 1e9 and "emulated" in ctx.query().notes + ctx.label
