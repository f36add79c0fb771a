"""Resume, don't restart (channel/resume.py): a connection cut mid-transfer, at a random point, in both modes;
the transfer is delivered once, its bytes verified, and FedRDMA sends again at most the chunks in flight at
the cut plus one. Cuts: the sender's or the receiver's bootstrap connection reset, a data connection of the
soft provider closed, a QP put in error. Also: what waits behind a cut transfer, a peer that restarts (it
starts over), a peer that does not come back, what a receiver holds and lets go of, forged answers."""
from __future__ import annotations

import random
import socket
import time

import numpy as np
import pytest

import easypyverbs as ev
from fate_rdma import errors as E
from fate_rdma.channel import Endpoint
from fate_rdma.channel.holding import RESUME_KEY, resume_field
from fate_rdma.config import ChannelConfig
from fate_rdma.protocol.frames import CtrlKind, ResumeState
from fate_rdma.protocol import Ctrl

from .test_channel import cfg_for, keyed_secret, slow_transfer, wait_for
from .verbs_pair import require

CHUNK = 64 * 1024
WINDOW = 4
SIZE = 6 << 20
CUTS = ["sender-bootstrap", "receiver-bootstrap", "data-socket", "qp-error"]


def cfg(mode: str, **kw) -> ChannelConfig:
    """Two endpoints of this process over the soft provider's TCP path, slowed by its link model so that a cut
    lands mid-transfer; authenticated, so that the resume frames are sealed."""
    base = dict(mode=mode, chunk_bytes=CHUNK, slot_bytes=8 << 20, slot_initial_bytes=CHUNK, provider="soft",
                same_host=False, window=WINDOW, soft_link="rate=100mbit", no_progress_timeout_s=10,
                connect_timeout_s=5, tcp_chunk_bytes=0, resume_window_s=10, secret_file=keyed_secret())
    base.update(kw)
    return ChannelConfig(**base)


def payload(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def cut(ep: Endpoint, peer: str, how: str) -> None:
    """Break `ep`'s connection to `peer` as the path would."""
    conn = ep._conns[peer]
    if how.endswith("bootstrap"):
        conn.boot.sock.shutdown(socket.SHUT_RDWR)  # (a reset on the path: both ends see it end)
    elif how == "data-socket":
        conn.rcs[0].qp.requester.sock.shutdown(socket.SHUT_RDWR)
    else:
        conn.rcs[0].qp.to_error("the test put the QP in error")


def cut_at_a_third(rx: Endpoint, tx: Endpoint, data: np.ndarray) -> dict:
    """Send `data`, cut the sender's bootstrap a third of the way through; the transfer's result, once the
    receiver has it once, verified."""
    fut = tx.send(rx.address, data)
    wait_for(lambda: fut.progress_bytes > data.nbytes // 3, 30, "a third of the transfer")
    cut(tx, rx.address, "sender-bootstrap")
    r = fut.result(30)
    msg = rx.recv(10)
    assert bytes(msg.view) == data.tobytes()
    msg.release()
    no_more(rx)
    return r


def no_more(ep: Endpoint, within_s: float = 0.5) -> None:
    with pytest.raises(E.TransferTimeout):
        extra = ep.recv(within_s)
        pytest.fail(f"a second message arrived: transfer {extra.transfer_id}")


@pytest.mark.parametrize("how", CUTS)
@pytest.mark.parametrize("mode", ["fedrdma", "fedrdma-e"])
def test_a_cut_transfer_is_resumed_and_delivered_once(mode, how):
    seed = random.randrange(1 << 30)
    at = random.Random(seed).uniform(0.1, 0.6)  # where it is cut: a fraction through (0.2 s or more left)
    c = cfg(mode)
    with Endpoint(c) as rx, Endpoint(c) as tx:
        data = payload(SIZE, seed)
        fut = tx.send(rx.address, data, {"round": 7})
        wait_for(lambda: fut.progress_bytes >= at * SIZE or fut.done(), 30, f"{at:.0%} of the transfer (seed {seed})")
        done_before = fut.done()
        if how.startswith("receiver"):
            cut(rx, tx.address, how)
        else:
            cut(tx, rx.address, how)
        r = fut.result(30)
        msg = rx.recv(10)
        assert (msg.transfer_id, msg.metadata, msg.nbytes) == (fut.transfer_id, {"round": 7}, SIZE), seed
        assert bytes(msg.view) == data.tobytes(), f"bytes differ (seed {seed})"
        msg.release()
        no_more(rx)
        assert r["bytes"] == SIZE
        assert r["resumes"] == (0 if done_before else 1), (r, seed)
        # what is sent again: the chunks in flight at the cut, and one (FedRDMA-E: back to front, chunk 0 last)
        assert r["resent_bytes"] <= (WINDOW + 1) * CHUNK, (r, seed)
        assert tx.send(rx.address, b"after").result(10)["resumes"] == 0  # the new connection carries on
        assert bytes(rx.recv(10).view) == b"after"
        assert rx.resumer.held_bytes == 0 and rx.budget.held_bytes >= 0


@pytest.mark.parametrize("mode", ["fedrdma", "fedrdma-e"])
def test_with_several_queue_pairs_what_is_sent_again_is_at_most_the_window_on_each(mode):
    """Chunks complete out of order across queue pairs; the receiver holds what lies beyond (FedRDMA-E) or before
    (FedRDMA) the first one missing, so up to the window on each queue pair is sent again."""
    qps, window = 4, 16
    c = cfg(mode, qps_per_peer=qps, window=window, slot_bytes=16 << 20)
    with Endpoint(c) as rx, Endpoint(c) as tx:
        r = cut_at_a_third(rx, tx, payload(12 << 20, 17))
        assert r["resumes"] == 1 and 0 < r["resent_bytes"] <= (window * qps + 1) * CHUNK, r


@pytest.mark.parametrize("mode", ["fedrdma", "fedrdma-e"])
@pytest.mark.parametrize("provider", ["soft-tcp", "pyverbs"])
def test_a_qp_in_error_is_resumed_on_new_queue_pairs(provider, mode, monkeypatch):
    """Both providers (pyverbs: rxe0 in the VM leg): the sender's QP is put in error mid-transfer (a QP in
    error cannot be used again); the connection is made again with new QPs and memory keys, and the transfer
    resumed and delivered once."""
    require(provider)
    c = cfg_for(mode, provider, **slow_transfer(provider, monkeypatch, window=2, slot_bytes=8 << 20,
                                                resume_window_s=10, secret_file=keyed_secret()))
    with Endpoint(c) as rx, Endpoint(c) as tx:
        data = payload(3 << 20, 9)
        fut = tx.send(rx.address, data)
        wait_for(lambda: fut.progress_bytes > (1 << 20), 30, "a third of the transfer")
        old = tx._conns[rx.address]
        old.rcs[0].qp.to_error("the test put the QP in error")
        assert fut.result(60)["resumes"] == 1
        msg = rx.recv(10)
        assert bytes(msg.view) == data.tobytes()
        msg.release()
        no_more(rx)
        new = tx._conns[rx.address]
        assert new is not old and all(rc.qp.state is ev.QPState.RTS for rc in new.rcs)
        key = "staging" if mode == "fedrdma" else "slot0"  # (memory granted anew, under new keys)
        assert new.remote[key].rkey != old.remote[key].rkey


@pytest.mark.parametrize("mode", ["fedrdma", "fedrdma-e"])
def test_a_transfer_cut_twice_is_put_together_from_three_connections(mode):
    """Cut once, resumed, and cut again while its rest arrives: FedRDMA puts what arrived of the rest behind
    what was held and the second resume sends only what is still missing; FedRDMA-E sends the part before the
    suffix it held again. The transfer arrives once."""
    c = cfg(mode)
    with Endpoint(c) as rx, Endpoint(c) as tx:
        data = payload(SIZE, 11)
        fut = tx.send(rx.address, data)
        wait_for(lambda: fut.progress_bytes > SIZE // 4, 30, "a quarter of the transfer")
        first = tx._conns[rx.address]
        cut(tx, rx.address, "sender-bootstrap")
        wait_for(lambda: rx.address in tx._conns and tx._conns[rx.address] is not first
                 and fut.progress_bytes > SIZE * 5 // 8, 30, "the rest under way on a new connection")
        cut(tx, rx.address, "data-socket")
        r = fut.result(30)
        assert r["resumes"] == 2, r
        if mode == "fedrdma":
            assert r["resent_bytes"] <= 2 * (WINDOW + 1) * CHUNK, r
        msg = rx.recv(10)
        assert bytes(msg.view) == data.tobytes()
        msg.release()
        no_more(rx)
        tx.send(rx.address, b"next").result(10)  # (slots nobody claimed are let go of once a new transfer comes)
        rx.recv(10).release()
        assert rx.resumer.held_bytes == 0


def test_a_kept_slot_whose_bytes_changed_is_not_trusted(monkeypatch, caplog):
    """FedRDMA-E: the bytes kept in the slot differ from the sender's (its claim's digest): nothing of the slot is
    used, the transfer is sent whole again and arrives as it was sent."""
    from fate_rdma.channel import holding as H

    real = H.Holdings.keep_slot

    def altered(self, peer, slot, area, nbytes):
        if area.size >= SIZE:  # (the transfer's last byte: placed first, back to front)
            area[SIZE - 1] ^= 0xFF
        real(self, peer, slot, area, nbytes)

    monkeypatch.setattr(H.Holdings, "keep_slot", altered)
    c = cfg("fedrdma-e")
    with Endpoint(c) as rx, Endpoint(c) as tx:
        r = cut_at_a_third(rx, tx, payload(SIZE, 13))
        assert r["resumes"] == 1 and r["resent_bytes"] > SIZE // 3, r
        assert "their digest differs" in caplog.text


def test_a_verdict_lost_with_its_connection_is_not_sent_again(monkeypatch):
    """FedRDMA-E: the receiver delivers the transfer, and its connection breaks before the verdict (DONE) leaves:
    the sender asks on the new connection, hears it was delivered, and sends nothing again."""
    from fate_rdma.channel.engine import Engine

    real = Engine.send_ctrl
    cut_once = []

    def lose_the_verdict(self, frame):
        if frame.kind is CtrlKind.DONE and not cut_once:
            cut_once.append(frame.transfer_id)
            self.wire.rcs[0].qp.to_error("the test lost the verdict with the connection")
            return
        real(self, frame)

    monkeypatch.setattr(Engine, "send_ctrl", lose_the_verdict)
    c = cfg("fedrdma-e", soft_link=None)
    with Endpoint(c) as rx, Endpoint(c) as tx:
        data = payload(1 << 20, 12)
        r = tx.send(rx.address, data).result(30)
        assert cut_once and r["resumes"] == 1 and r["resent_bytes"] == 0, r
        msg = rx.recv(10)
        assert bytes(msg.view) == data.tobytes()
        msg.release()
        no_more(rx)


def test_transfers_queued_behind_a_cut_one_wait_and_go_in_order():
    c = cfg("fedrdma")
    with Endpoint(c) as rx, Endpoint(c) as tx:
        datas = [payload(SIZE, i) for i in range(3)]
        futs = [tx.send(rx.address, d, {"i": i}) for i, d in enumerate(datas)]
        wait_for(lambda: futs[0].progress_bytes > SIZE // 3, 30, "a third of the first transfer")
        cut(tx, rx.address, "sender-bootstrap")
        for f in futs:
            f.result(60)
        got = [rx.recv(10) for _ in futs]
        assert [m.metadata["i"] for m in got] == [0, 1, 2]
        assert all(bytes(m.view) == d.tobytes() for m, d in zip(got, datas))
        no_more(rx)
        assert futs[0].result()["resumes"] == 1


def test_a_peer_that_restarts_starts_over_and_sends_meanwhile_wait():
    """The receiving endpoint closes mid-transfer and opens again at its address within the window: it holds
    nothing of the transfer (a restarted process starts over), which is sent to it whole, once; a send made
    while it was away waits behind it."""
    c = cfg("fedrdma")
    rx = Endpoint(c)
    host, port = rx.address.rsplit(":", 1)
    with Endpoint(c) as tx:
        data = payload(SIZE, 1)
        fut = tx.send(rx.address, data)
        wait_for(lambda: fut.progress_bytes > SIZE // 4, 30, "a quarter of the transfer")
        rx.close()
        wait_for(lambda: tx.resumer._outages, 10, "the sender noticing")
        later = tx.send(rx.address, b"meanwhile")
        assert not later.done()
        time.sleep(0.5)
        with Endpoint(c, host=host, port=int(port)) as rx2:
            assert fut.result(30)["resumes"] == 1 and later.result(30)
            first, second = rx2.recv(10), rx2.recv(10)
            assert bytes(first.view) == data.tobytes() and bytes(second.view) == b"meanwhile"
            no_more(rx2)


def test_a_send_after_an_idle_connection_broke_waits_for_the_peer():
    """The connection broke while idle and the peer is not back yet: a send does not fail at its dial but
    waits for the peer within the window, and goes once it is back."""
    c = cfg("fedrdma", connect_timeout_s=1)
    rx = Endpoint(c)
    host, port = rx.address.rsplit(":", 1)
    with Endpoint(c) as tx:
        tx.send(rx.address, b"first").result(10)
        rx.recv(10).release()
        rx.close()
        wait_for(lambda: rx.address in tx.resumer._broken, 10, "the sender noticing the break")
        fut = tx.send(rx.address, b"second")  # (its dial fails within connect_timeout_s: it waits)
        assert not fut.done()
        with Endpoint(c, host=host, port=int(port)) as rx2:
            fut.result(30)
            assert bytes(rx2.recv(10).view) == b"second"
            no_more(rx2)
    c = cfg("fedrdma", connect_timeout_s=1)  # a peer never seen fails at its dial, as before
    with Endpoint(c) as tx, pytest.raises(E.PeerUnreachable, match="cannot connect"):
        tx.send("127.0.0.1:1", b"x")


@pytest.mark.parametrize("mode", ["fedrdma", "fedrdma-e"])
def test_a_sender_that_is_gone_is_held_for_the_window_one_that_said_goodbye_not_at_all(mode, monkeypatch):
    """A sender whose process ended without a word (as a crash, or a path that stays down): the receiver holds what
    arrived for the window, within the memory budget, then lets go of it. One whose endpoint closed said goodbye on
    the bootstrap connection: nothing of it is held."""
    from fate_rdma.channel import connection

    c = cfg(mode, resume_window_s=1)
    with Endpoint(c) as rx:
        for goodbye in (False, True):
            tx = Endpoint(c)
            fut = tx.send(rx.address, payload(SIZE, 2))
            wait_for(lambda: fut.progress_bytes > SIZE // 3, 30, "a third of the transfer")
            with monkeypatch.context() as m:
                if not goodbye:
                    m.setattr(connection, "say_bye", lambda boot: None)
                tx.close()
            if goodbye:
                wait_for(lambda: not rx._conns, 10, "the receiver seeing the sender leave")
                assert rx.resumer.held_bytes == 0 and rx.budget.held_by(tx.address) == 0
                continue
            wait_for(lambda: rx.resumer.held_bytes >= SIZE, 10, "the receiver holding the transfer")
            assert rx.budget.held_by(tx.address) >= SIZE  # (held bytes count against the memory budget)
            wait_for(lambda: rx.resumer.held_bytes == 0, 10, "the receiver letting go after the window")
            assert rx.budget.held_by(tx.address) == 0


def test_a_receiver_that_does_not_come_back_fails_the_transfer_naming_the_window():
    c = cfg("fedrdma-e", resume_window_s=1)
    rx = Endpoint(c)
    with Endpoint(c) as tx:
        fut = tx.send(rx.address, payload(SIZE, 3))
        wait_for(lambda: fut.progress_bytes > 0, 30, "progress")
        rx.close()
        with pytest.raises(E.PeerUnreachable, match=r"not back within resume_window_s \(1 s\)"):
            fut.result(30)


def test_off_a_cut_fails_the_transfer_at_once():
    c = cfg("fedrdma", resume_window_s=0)
    with Endpoint(c) as rx, Endpoint(c) as tx:
        assert rx.resumer is None
        fut = tx.send(rx.address, payload(SIZE, 4))
        wait_for(lambda: fut.progress_bytes > SIZE // 4, 30, "a quarter of the transfer")
        cut(tx, rx.address, "sender-bootstrap")
        with pytest.raises(E.PeerUnreachable):
            fut.result(10)
    from fate_rdma.channel.posture import posture

    assert any("NOT resumed" in line for level, line in posture(c, "127.0.0.1") if level == "warning")


@pytest.mark.parametrize("frame, why", [
    (Ctrl(CtrlKind.RESUMED, 99, int(ResumeState.DELIVERED), 0), "did not ask about"),
])
def test_an_answer_nobody_asked_for_ends_the_connection_and_is_not_resumed(frame, why, caplog):
    c = cfg("fedrdma")
    with Endpoint(c) as rx, Endpoint(c) as tx:
        tx.send(rx.address, b"x").result(10)
        rx.recv(10)
        rx._conns[tx.address].send_ctrl(frame)
        conn = tx._conns[rx.address]
        wait_for(lambda: conn.dead is not None, 10, "the connection ending")
        assert isinstance(conn.dead, E.RemoteProtocolError) and why in str(conn.dead)
        assert not tx.resumer._outages


def test_a_forged_progress_answer_is_refused(monkeypatch):
    """The receiver's answer claims more than the transfer holds: the sender's connection ends naming it, and
    the transfer is not taken as delivered."""
    from fate_rdma.channel import holding as H

    real = H.Holdings.query

    def lying(self, peer, tid, total, claim=None):
        state, held = real(self, peer, tid, total, claim)
        return (ResumeState.PARTIAL, total) if state is ResumeState.PARTIAL else (state, held)

    monkeypatch.setattr(H.Holdings, "query", lying)
    c = cfg("fedrdma", resume_window_s=3)
    with Endpoint(c) as rx, Endpoint(c) as tx:
        fut = tx.send(rx.address, payload(SIZE, 5))
        wait_for(lambda: fut.progress_bytes > SIZE // 3, 30, "a third of the transfer")
        cut(tx, rx.address, "sender-bootstrap")
        with pytest.raises(E.FateRdmaError):
            fut.result(30)
        no_more(rx)


def test_the_resume_field_read_from_the_wire_is_checked():
    assert resume_field([5, 10, 10], 5) == (5, 10, 10) and resume_field([0, 4, 10], None) == (0, 4, 10)
    for bad in ([5, 10], [10, 10, 10], [-1, 10, 10], [0, 11, 10], ["5", 10, 10], [True, 10, 10], {"a": 1}, None,
                [5, 10.0, 10]):
        assert resume_field(bad, None) is None, bad
    assert resume_field([5, 10, 10], 4) is None  # bytes 5 to 10 are 5 bytes
    with pytest.raises(E.FateRdmaError, match=RESUME_KEY):
        with Endpoint(cfg("fedrdma")) as ep:
            ep.send("127.0.0.1:1", b"x", {RESUME_KEY: [0, 1, 1]})


def test_a_resume_claim_read_from_the_wire_is_checked():
    from fate_rdma.protocol.packing import SuffixClaim, decode_resume, encode_resume

    claim = SuffixClaim(1, 100, bytes(range(32)))
    c = encode_resume(7, 1000, claim)
    assert decode_resume(c) == (1000, claim) and decode_resume(encode_resume(7, 1000, None)) == (1000, None)
    for bad, why in [(Ctrl(CtrlKind.RESUME, 7, 1000, 0, "ab"), "digest without a claim"),
                     (Ctrl(CtrlKind.RESUME, 7, 1000, 1000, c.reason), "aux"),
                     (Ctrl(CtrlKind.RESUME, 7, 1000, c.aux, c.reason[:-2]), "64 hex"),
                     (Ctrl(CtrlKind.RESUME, 7, 1000, c.aux, "zz" * 32), "64 hex")]:
        with pytest.raises(E.RemoteProtocolError, match=why):
            decode_resume(bad)
