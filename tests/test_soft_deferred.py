"""Deferred answers in the soft provider (wire.py): requests whose completion nobody waits for are answered
with a later request's answer or after DEFERRED_ACK_S; never under TLS or a link model, or when switched off;
an owed answer goes out before the responder's QP closes; a signaled request is never held by a deferral."""
from __future__ import annotations

import time

import pytest

import easypyverbs as ev
from easypyverbs.providers.soft import responder as respmod, wire

from .test_soft_wire import _spy_answers
from .verbs_pair import close_pair, make_pair


def _outstanding_drains(qp, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while qp.requester.outstanding and time.monotonic() < deadline:
        time.sleep(0.005)
    return qp.requester.outstanding == 0


def test_unsignaled_requests_are_answered_with_a_later_one_or_after_a_while(monkeypatch):
    """Deferred answers (wire.py): SENDs whose completion nobody waits for carry OP_NO_ACK, and their
    responder answers them with the next request's answer (cumulative) rather than one each; a lone one is
    answered once DEFERRED_ACK_S has passed with nothing after it, so the requester's send queue drains
    (QP.close waits for that) and no WR stays in flight; the signaled one completes at once, as before."""
    answers = _spy_answers(monkeypatch)
    a, b = make_pair("soft-tcp", size=1 << 16, cap=ev.QPCap(max_send_wr=16, max_recv_wr=16))
    try:
        assert a.qp.requester._defer_ack and b.qp.responder._defer_ok  # (taken in the HELLO exchange, both ways)
        for k in range(4):
            b.qp.post_recv(b.mr.sge(k * 64, 64), wr_id=k)
        monkeypatch.setattr(respmod, "DEFERRED_ACK_S", 30.0)  # nothing answered for waiting here
        a.qp.post_send(a.mr.sge(0, 10), wr_id=1, signaled=False)
        a.qp.post_send(a.mr.sge(0, 20), wr_id=2, signaled=False)
        assert [wc.byte_len for wc in b.cq.wait_n(2, 10)] == [10, 20]
        assert answers == [] and a.qp.requester.outstanding == 2
        a.qp.post_send(a.mr.sge(0, 30), wr_id=3)  # signaled: answered at once, for all three
        assert [wc.wr_id for wc in a.cq.wait_n(1, 10)] == [3] and b.cq.wait_n(1, 10)[0].byte_len == 30
        assert answers == [wire.ACK] and _outstanding_drains(a.qp)
        monkeypatch.setattr(respmod, "DEFERRED_ACK_S", 0.01)
        real_owed = respmod.Responder.send_owed
        monkeypatch.setattr(respmod.Responder, "send_owed",
                            lambda self: (answers.append("owed") if self._owed_psn is not None else None, real_owed(self)))
        a.qp.post_send(a.mr.sge(0, 40), wr_id=4, signaled=False)  # lone: answered once the window passed
        assert b.cq.wait_n(1, 10)[0].byte_len == 40
        assert _outstanding_drains(a.qp) and answers == [wire.ACK, "owed"]
        assert a.cq.poll() == []  # (unsignaled: no completion)
    finally:
        close_pair([a, b])


@pytest.mark.parametrize("case", ["switched off", "tls", "link model"])
def test_answers_are_not_deferred_when_switched_off_or_under_tls_or_a_link_model(monkeypatch, case):
    if case == "switched off":
        monkeypatch.setenv("EASYPYVERBS_SOFT_DEFER_ACK", "off")
    a, b = make_pair("soft-tls" if case == "tls" else "soft-tcp", **({"link": "rtt=2ms"} if case == "link model" else {}))
    try:
        assert not a.qp.requester._defer_ack and not b.qp.responder._defer_ok and not b.qp.requester._defer_ack
        b.qp.post_recv(b.mr.sge(0, 64), wr_id=1)
        a.qp.post_send(a.mr.sge(0, 10), wr_id=1, signaled=False)
        assert b.cq.wait_n(1, 10)[0].ok and _outstanding_drains(a.qp)
    finally:
        close_pair([a, b])


def test_a_request_that_defers_its_answer_unasked_is_a_protocol_violation(monkeypatch):
    """OP_NO_ACK from a requester whose responder did not take deferred answers in the HELLO: the responder
    fails its QP, naming the violation, rather than leaving the requester without its answer."""
    monkeypatch.setenv("EASYPYVERBS_SOFT_DEFER_ACK", "off")
    a, b = make_pair("soft-tcp")
    try:
        a.qp.requester._defer_ack = True  # (a requester that ignores what the HELLO settled)
        b.qp.post_recv(b.mr.sge(0, 64), wr_id=1)
        a.qp.post_send(a.mr.sge(0, 10), wr_id=7, signaled=False)
        wcs = b.cq.wait_n(1, 10)
        assert wcs[0].status == ev.WCStatus.WR_FLUSH_ERR and "protocol violation" in wcs[0].reason
        assert b.qp.state == ev.QPState.ERR
    finally:
        close_pair([a, b])


def test_an_answer_still_owed_when_the_responder_closes_is_sent_first(monkeypatch):
    """A deferred answer owed when the responder's QP closes goes out before its sockets do: the requester's
    WR, placed, completes as such, not as failed by the closed connection (an error completion for it)."""
    monkeypatch.setattr(respmod, "DEFERRED_ACK_S", 30.0)
    a, b = make_pair("soft-tcp")
    try:
        b.qp.post_recv(b.mr.sge(0, 64), wr_id=1)
        a.qp.post_send(a.mr.sge(0, 10), wr_id=9, signaled=False)
        assert b.cq.wait_n(1, 10)[0].ok and a.qp.requester.outstanding == 1  # placed, its answer owed
        b.qp.close()
        assert _outstanding_drains(a.qp)
        time.sleep(0.2)  # (the closed connection, seen by the requester after the answer)
        assert [wc for wc in a.cq.poll(16) if wc.wr_id == 9] == []
    finally:
        close_pair([a, b])


def test_a_signaled_request_answered_with_the_next_is_not_held_by_its_deferral(monkeypatch):
    """A signaled WRITE whose answer waits for the next request's (that one already arriving), followed by a
    SEND whose answer may wait: the SEND is answered at once, so the WRITE's completion does not wait for a
    deferred answer's timer."""
    monkeypatch.setattr(respmod, "DEFERRED_ACK_S", 30.0)
    answers = _spy_answers(monkeypatch)
    a, b = make_pair("soft-tcp", size=1 << 16)
    try:
        b.qp.post_recv(b.mr.sge(0, 64), wr_id=1)
        with a.qp.batch():  # one write: the SEND's bytes are there when the WRITE is placed
            a.qp.post_write(a.mr.sge(0, 4096), b.mr.remote(), remote_offset=8192, wr_id=5)
            a.qp.post_send(a.mr.sge(0, 10), wr_id=6, signaled=False)
        assert [wc.wr_id for wc in a.cq.wait_n(1, 10)] == [5] and answers == [wire.ACK]
        assert b.cq.wait_n(1, 10)[0].ok and _outstanding_drains(a.qp)
    finally:
        close_pair([a, b])
