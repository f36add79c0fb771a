"""FedRDMA-E receive slots that follow the traffic, across two processes on each provider (as
test_channel.py runs them): a payload far larger than the initial slot grows it and arrives intact, an
idle pool shrinks (pool_bytes, the budget and the receiver's RSS drop) and grows again, growth beyond
the memory budget is refused before anything is allocated, forged GROW and RETURN frames are refused
naming the field, and the endpoint reports what its pools hold."""
from __future__ import annotations

import logging
import os
import time
from typing import Optional

import crc32c
import numpy as np
import pytest

import easypyverbs as ev
from fate_rdma import errors as E
from fate_rdma.channel import Endpoint, transfer
from fate_rdma.config import ChannelConfig

from .test_channel import PROVIDERS, Peer, cfg_for, wait_for
from .conftest import require_same_host
from .verbs_pair import require


@pytest.fixture(params=PROVIDERS)
def provider(request):
    require(request.param)  # pyverbs: skipped, with the reason, where no RDMA device is usable
    if request.param == "soft":
        require_same_host()
    return request.param

#: a slot's extent beyond its payload room: header and metadata area
SLOT_AREA = 64 + 65536


def grow_cfg(provider: str, **kw) -> ChannelConfig:
    return cfg_for("fedrdma-e", provider, **dict(dict(slot_initial_bytes=4096, slot_bytes=32 << 20, chunk_bytes=1 << 20,
                                                     window=8), **kw))


def stats(peer: Peer) -> dict:
    return peer.proc.cmd({"cmd": "stats"})


def connect(ep: Endpoint, peer: Peer) -> None:
    """Connected, on both sides (the peer's endpoint lists the connection a moment after ours)."""
    ep.connect(peer.address)
    wait_for(lambda: stats(peer)["pool_bytes"] > 0, 10, "the peer's side of the connection")


def test_payload_much_larger_than_the_initial_slot_grows_it(provider, windows: Optional[int] = None):
    """(`windows`: how many of the peer's slots must be granted through memory windows, before and after)"""
    cfg = grow_cfg(provider)
    peer = Peer(cfg)
    try:
        with Endpoint(cfg) as ep:
            connect(ep, peer)
            idle = stats(peer)
            assert idle["pool_bytes"] == 2 * (SLOT_AREA + 4096) == idle["budget_held_bytes"]
            _windowed_slots(peer, windows)
            data = np.random.default_rng(7).integers(0, 256, (24 << 20) + 5, dtype=np.uint8)  # 6000 x the slot
            info = ep.send(peer.address, data, {"big": 1}).result(60)
            (rec,) = peer.expect(timeout_s=60)
            assert info["mode"] == "fedrdma-e" and rec["mode"] == "fedrdma-e"
            assert rec["nbytes"] == data.nbytes and rec["crc32c"] == crc32c.crc32c(data)
            grown = stats(peer)
            assert grown["pool_bytes"] == SLOT_AREA + 4096 + SLOT_AREA + (25 << 20)  # one slot, rounded to 1 MiB
            assert grown["budget_held_bytes"] == grown["pool_bytes"]
            for i in range(3):  # small ones after it, in the grown slot and the other one
                ep.send(peer.address, b"x" * 100, {"i": i}).result(30)
            assert [r["metadata"]["i"] for r in peer.expect(3)[-3:]] == [0, 1, 2]
            _windowed_slots(peer, windows)
    finally:
        peer.close()


def test_pyverbs_slots_grow_through_memory_windows_and_without(monkeypatch):
    """The test above on pyverbs, the peer's slots granted through memory windows (the default where the device
    has them: easypyverbs pyverbs_windows), then with EASYPYVERBS_MEMORY_WINDOWS=off (registered anew)."""
    require("pyverbs")
    monkeypatch.delenv("EASYPYVERBS_MEMORY_WINDOWS", raising=False)
    with ev.open_device(provider="pyverbs") as ctx:
        has = bool(ctx.query().max_mw)
    test_payload_much_larger_than_the_initial_slot_grows_it("pyverbs", windows=2 if has else 0)
    monkeypatch.setenv("EASYPYVERBS_MEMORY_WINDOWS", "off")
    test_payload_much_larger_than_the_initial_slot_grows_it("pyverbs", windows=0)


def _windowed_slots(peer: Peer, want: Optional[int]) -> None:
    if want is not None:
        assert stats(peer)["windowed_slots"] == want


@pytest.mark.system  # waits out pool_idle_s twice in a peer process
def test_pool_shrinks_when_idle_and_grows_again(provider):
    cfg = grow_cfg(provider, pool_idle_s=2.0)  # long enough to read the grown pool first, even in a TCG VM
    peer = Peer(cfg)
    try:
        with Endpoint(cfg) as ep:
            small = 2 * (SLOT_AREA + 4096)
            for rnd in range(2):  # a transfer after a shrink grows the slot again and arrives intact
                data = np.random.default_rng(rnd).integers(0, 256, 12 << 20, dtype=np.uint8)
                ep.send(peer.address, data, {"round": rnd}).result(60)
                rec = peer.expect(timeout_s=60)[-1]
                assert rec["metadata"] == {"round": rnd} and rec["crc32c"] == crc32c.crc32c(data)
                grown = stats(peer)
                assert grown["pool_bytes"] > 12 << 20
                # registered and reserved both drop (the budget a moment after the slot: released once freed)
                wait_for(lambda: {stats(peer)[k] for k in ("pool_bytes", "budget_held_bytes")} == {small}, 20,
                         "the idle pool shrinking")
                shrunk = stats(peer)
                print(f"\nreceiver RSS {grown['rss_bytes'] / 2**20:.1f} MiB grown, {shrunk['rss_bytes'] / 2**20:.1f} "
                      f"MiB after {cfg.pool_idle_s} s idle")
                assert shrunk["rss_bytes"] < grown["rss_bytes"] - (8 << 20)  # the pages went back
            ring = ep.connect(peer.address).slot_sender.ring
            wait_for(lambda: ring.capacity == [4096, 4096], 10, "the sender learning of the shrink (CREDIT)")
    finally:
        peer.close()


def test_growth_beyond_the_memory_budget_is_refused_before_allocating(provider):
    cfg = grow_cfg(provider, slot_bytes=64 << 20, memory_budget_bytes=8 << 20)
    peer = Peer(cfg)
    try:
        with Endpoint(cfg) as ep:
            connect(ep, peer)
            before = stats(peer)
            with pytest.raises(E.PayloadTooLarge, match="growing receive slot 0 to 16777216 bytes exceeds the "
                                                        "receiver's limit for this peer"):
                ep.send(peer.address, bytes(16 << 20)).result(30)
            after = stats(peer)
            assert after["pool_bytes"] == before["pool_bytes"] and after["budget_held_bytes"] == before["budget_held_bytes"]
            assert after["rss_bytes"] < before["rss_bytes"] + (4 << 20)  # nothing was allocated for it
            data = os.urandom(3 << 20)  # within this peer's half of the budget: the same slot grows and takes it
            ep.send(peer.address, data).result(30)
            assert peer.expect()[-1]["crc32c"] == crc32c.crc32c(data)
    finally:
        peer.close()


def test_forged_grow_and_return_are_refused_naming_the_field(provider, caplog):
    """A peer's GROW with a field out of range is refused (ERROR to the sender, logged) before anything
    is allocated, and the connection goes on; a RETURN nobody asked for ends the connection."""
    import logging

    from fate_rdma import protocol as P

    cfg = grow_cfg(provider)
    with Endpoint(cfg, name="victim") as victim, Endpoint(cfg, name="client") as client:
        conn = client.connect(victim.address)
        def send_and_check(data: bytes) -> bool:
            client.send(victim.address, data).result(30)
            ok = bytes(victim.recv(timeout=30).detach()) == data
            wait_for(lambda: set(client.connect(victim.address).slot_sender.ring.state) == {P.SlotState.FREE}, 10,
                     "the slot's CREDIT")  # released and granted again: a GROW would be refused while it is held
            return ok

        assert send_and_check(b"first")
        held = victim.pool_bytes(), victim.budget.held_bytes
        caplog.set_level(logging.WARNING, logger="fate_rdma.channel")
        for forged, field in ((P.Ctrl(P.CtrlKind.GROW, 901, 0, 1 << 50), "field 'aux' (payload bytes) = 1125899906842624 "
                                                                          "exceeds the slot's maximum"),
                              (P.Ctrl(P.CtrlKind.GROW, 902, 7, 1 << 20), "field 'value' (slot) = 7"),
                              (P.Ctrl(P.CtrlKind.GROW, 903, 1, 100), "field 'aux' (payload bytes) = 100, slot 1 has room")):
            conn.send_ctrl(forged)
            wait_for(lambda: field in caplog.text, 10, f"the refusal naming {field!r}")
        assert (victim.pool_bytes(), victim.budget.held_bytes) == held  # nothing allocated, nothing changed
        assert send_and_check(os.urandom(5 << 20))  # the connection goes on, and grows for real
        caplog.set_level(logging.INFO, logger="fate_rdma.channel")  # a peer lost while idle is logged as info
        conn.send_ctrl(P.Ctrl(P.CtrlKind.RETURN, 0, 0, 12345))
        wait_for(lambda: "RETURN for slot 0 under rkey 12345 (field 'aux'), which this side did not ask back"
                 in caplog.text, 10, "the victim ending the connection, naming the field")
        wait_for(lambda: conn.dead is not None, 10, "the connection ending at the client")
        assert send_and_check(b"after")  # a new connection


def test_pool_report_says_what_the_pools_hold(caplog):
    from fate_rdma.channel.slots import describe, pool_policy

    cfg = grow_cfg("soft")
    caplog.set_level(logging.INFO, logger="fate_rdma.channel")
    with Endpoint(cfg, name="rx") as rx, Endpoint(cfg, name="tx") as tx:
        rx.name = rx.address
        tx.send(rx.address, os.urandom(3 << 20)).result(30)
        msg = rx.recv(timeout=30)
        rep = rx.pool_report()
        (peer,) = rep["peers"].values()
        assert [s["state"] for s in peer["slots"]] == ["held", "granted"]
        assert [s["payload_bytes"] for s in peer["slots"]] == [3 << 20, 4096]
        assert rep["reserved_bytes"] == rx.pool_bytes() == 2 * SLOT_AREA + (3 << 20) + 4096 == rep["budget_held_bytes"]
        assert 3 << 20 <= rep["resident_bytes"] <= rep["reserved_bytes"] + 4096  # written pages only (soft)
        lines = describe(pool_policy(cfg), rep)
        assert "up to 64.1 MiB under load" in lines[0] and "let go of once unused for 30 s" in lines[1]
        assert "registered" in lines[2] and "buffers now" in lines[3] and "3.0 MiB held" in lines[4]
        msg.release()
        rx.close()  # its close logs what its pools hold (a FATE task's log shows it)
    closing = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"fate-rdma endpoint {rx.address} at close")]
    assert len(closing) == 1 and "pools now: " in closing[0] and "for 1 peer(s)" in closing[0]
    assert "3.0 MiB granted" in closing[0]  # (the slot keeps its room until it has been idle pool_idle_s)


@pytest.mark.system  # waits out pool_idle_s
@pytest.mark.parametrize("mode", ["fedrdma", "fedrdma-e"])
def test_reassembly_and_copy_buffers_are_let_go_of_when_idle(mode):
    """FedRDMA's reassembly buffers (and FedRDMA-E's copies of small messages) are kept for the next transfer, and
    let go of once unused for pool_idle_s, as idle slots shrink; the endpoint's report says what it keeps."""
    cfg = cfg_for(mode, "soft", pool_idle_s=0.5, chunk_bytes=1 << 20, slot_bytes=8 << 20)
    with Endpoint(cfg, name="rx") as rx, Endpoint(cfg, name="tx") as tx:
        # (FedRDMA-E copies a payload out of its slot below LEND_MIN_BYTES only; FedRDMA reassembles them all)
        payload = os.urandom(3 << 20 if mode == "fedrdma" else 300_000)
        tx.send(rx.address, payload).result(30)
        msg = rx.recv(timeout=30)
        data = msg.detach()
        assert bytes(data) == payload and rx.recv_buffers.held_bytes >= len(payload)
        time.sleep(1.5)  # idle, but `data` still refers to its buffer: kept
        assert rx.recv_buffers.held_bytes >= len(payload) and rx.pool_report()["recycled_bytes"] >= len(payload)
        del msg, data
        wait_for(lambda: rx.recv_buffers.held_bytes == 0, 10, "the unused buffer let go of")
        rep = rx.pool_report()
        assert rep["recycled_bytes"] == 0 and rep["recycled_trimmed_bytes"] >= len(payload)
        tx.send(rx.address, payload).result(30)  # the next transfer takes a new buffer
        assert bytes(rx.recv(timeout=30).detach()) == payload


def test_without_a_checksum_a_lent_slot_is_cleared_before_it_is_granted_again(monkeypatch):
    """checksum: none proves nothing about which bytes a transfer wrote. A message's view of its slot is
    read-only, so a slot released without being lent holds only what its peer wrote; a lent slot may hold
    what the application made of the payload in place, so it is cleared over what its transfer announced
    before its CREDIT: bytes a later transfer does not write read as zeros, never as the application's
    (fedrdma_e.SlotReceiver.release; in-process, soft provider)."""
    monkeypatch.setattr(transfer, "LEND_MIN_BYTES", 0)
    cfg = grow_cfg("soft", checksum="none")
    with Endpoint(cfg, name="rx") as rx, Endpoint(cfg, name="tx") as tx:
        rx.name = rx.address
        conn = tx.connect(rx.address)
        data = np.full((3 << 20) + 7, 0xA5, dtype=np.uint8)
        tx.send(rx.address, data).result(30)
        msg = rx.recv(timeout=30)
        assert bytes(msg.view) == data.tobytes()
        with pytest.raises(TypeError):
            msg.view[:1] = b"x"  # the slot itself: read-only until lent
        wait_for(lambda: rx._conns, 10, "the accepting side filing its end")  # (a moment after delivering)
        (rconn,) = [c for c in rx._conns.values() if c.slot_receiver is not None]
        slot = next(i for i, n in enumerate(rconn.mem.slots.capacity) if n >= data.nbytes)
        old_rkey = conn.slot_sender.slot_mrs[slot].rkey
        view = msg.detach()
        assert msg.lent
        view[:] = b"\x5a" * view.nbytes  # the application works in place
        del view
        wait_for(lambda: conn.slot_sender.slot_mrs[slot].rkey != old_rkey, 10, "the slot's CREDIT")
        after = np.frombuffer(rconn.mem.slots.view(slot), dtype=np.uint8)
        assert after.nbytes >= data.nbytes and not after.any(), "the returned slot still holds the application's bytes"
        tx.send(rx.address, b"next").result(30)  # and the slot takes the next transfer
        assert bytes(rx.recv(timeout=30).detach()) == b"next"


def test_a_detached_payload_is_lent_in_place_and_its_slot_returns_when_the_last_view_goes():
    """Message.detach lends a FedRDMA-E slot to the application without a copy while the peer's pool
    keeps another slot circulating: the slot is granted again (new rkey) only once the last object made
    from the view is gone, a payload arriving meanwhile is copied (the last slot keeps circulating),
    and the lent bytes never change under later transfers (in-process, soft provider)."""
    cfg = grow_cfg("soft")
    rng = np.random.default_rng(11)
    with Endpoint(cfg, name="rx") as rx, Endpoint(cfg, name="tx") as tx:
        rx.name = rx.address
        conn = tx.connect(rx.address)
        first = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
        tx.send(rx.address, first).result(30)
        view = rx.recv(timeout=30).detach()
        wait_for(lambda: rx._conns, 10, "the accepting side filing its end")  # (a moment after delivering)
        (rconn,) = [c for c in rx._conns.values() if c.slot_receiver is not None]
        slots = rconn.mem.slots

        def slot_of(v):
            addr = np.frombuffer(v, dtype=np.uint8).ctypes.data
            for i in range(len(slots.capacity)):
                base = np.frombuffer(slots.view(i), dtype=np.uint8).ctypes.data
                if base <= addr < base + slots.slot_bytes(i):
                    return i
            return None

        lent = slot_of(view)
        assert lent is not None, "the payload was copied, not lent"
        (report,) = rx.pool_report()["peers"].values()
        assert report["slots"][lent]["state"] == "lent"  # what doctor and pool_report say it holds
        rkey = conn.slot_sender.slot_mrs[lent].rkey
        arr = np.frombuffer(view, dtype=np.uint8)
        arrays = [arr[:4096].reshape(64, 64), arr[4096:]]
        del view, arr
        for _ in range(3):  # the other slot carries these; each is copied out, the slot goes back at once
            more = rng.integers(0, 256, (2 << 20) + 3, dtype=np.uint8)
            tx.send(rx.address, more).result(30)
            got = rx.recv(timeout=30).detach()
            assert bytes(got) == more.tobytes() and slot_of(got) is None
        assert np.array_equal(np.concatenate([a.reshape(-1) for a in arrays]), first)
        assert conn.slot_sender.slot_mrs[lent].rkey == rkey, "a lent slot was granted to the sender again"
        del arrays[0]
        assert conn.slot_sender.slot_mrs[lent].rkey == rkey
        arrays.clear()
        wait_for(lambda: conn.slot_sender.slot_mrs[lent].rkey != rkey, 10, "the lent slot's CREDIT")
