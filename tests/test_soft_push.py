"""The soft provider's push on the same-host path (wire.py): a large WRITE into a peer's FedRDMA-E slot, which
lies in shared memory where the peer is a process of this host, is copied in by the sender itself and
digested by the receiver piece by piece as the sender's PLACED notes say it landed. Switched off
(EASYPYVERBS_SOFT_PUSH=off) the receiver reads it as before; notes that run past the WRITE fail the
receiver's QP; a PUSH_AT naming this process, one of its regions, or a pid without the proof is declined."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import types

import crc32c
import numpy as np
import pytest

import easypyverbs as ev
from easypyverbs.providers.soft import requester as R
from easypyverbs.providers.soft import samehost, shm, wire
from fate_rdma import errors as E
from fate_rdma.channel import Endpoint

from .test_same_host import SAME_HOST, cfg, peer

pytestmark = [pytest.mark.skipif(not shm.self_test()[0], reason=f"shared memory unusable: {shm.self_test()[1]}"),
              pytest.mark.skipif(not samehost.available()[0], reason=f"same-host path not available: {samehost.available()[1]}")]


@pytest.fixture
def targets(monkeypatch):
    """Each PUSH_AT this process answered: True where it copied the WRITE in, False where it declined."""
    seen = []
    real = R.Requester._push_target

    def spy(self, wr, body):
        got = real(self, wr, body)
        seen.append(got is not None)
        return got

    monkeypatch.setattr(R.Requester, "_push_target", spy)
    return seen


@pytest.mark.parametrize("switch", ["always", "auto", "off"])
def test_a_large_write_into_a_peer_on_this_host_is_pushed_and_verified(monkeypatch, targets, switch):
    """always: the receiver takes every push; auto (the default): only while it copies another WRITE, so
    these WRITEs, one at a time, are each declined for themselves ("not this one") and read by the receiver,
    the sender offering the next again; off: none offered."""
    monkeypatch.setenv("EASYPYVERBS_SOFT_PUSH", switch)  # (the peer, spawned after, inherits it)
    monkeypatch.setattr(R, "PUSH_PIECE_BYTES", 3 << 20)  # pieces that do not fall on the 4 MiB digest blocks
    c = cfg("fedrdma-e")
    assert c.checksum != "none"  # the receiver digests what the sender placed, and checks it
    p, addr = peer(c)
    try:
        with Endpoint(c) as ep:
            data = np.random.default_rng(5).integers(0, 256, (40 << 20) + 7, dtype=np.uint8)
            for _ in range(2):
                ep.send(addr, [data[:1000], data[1000:]], {"n": 1}).result(60)
                rec = p.cmd({"cmd": "expect", "count": 1, "timeout_s": 60})["records"][0]
                assert rec["nbytes"] == data.nbytes and rec["crc32c"] == crc32c.crc32c(data)
            assert all(rc.qp.data_path == SAME_HOST for rc in ep.connect(addr).rcs)
            qp = ep.connect(addr).rcs[0].qp
            if switch == "always":  # three WRITEs of at most 16 MiB per transfer, each copied in by this side
                assert len(targets) == 6 and all(targets)
            else:
                assert targets == []
            assert qp.requester._push is (switch != "off") and not qp.requester._no_push_rkeys  # auto: still offered
    finally:
        p.close()


def test_writes_into_private_memory_are_answered_no_push_once_per_rkey(targets):
    """FedRDMA's staging buffers are private: the responder answers the first large WRITE into them "no push
    here" at once and reads it itself; the sender offers no push for that rkey again (its WRITEs stream)."""
    c = cfg("fedrdma")
    p, addr = peer(c)
    try:
        with Endpoint(c) as ep:
            data = np.random.default_rng(6).integers(0, 256, 12 << 20, dtype=np.uint8)
            ep.send(addr, data).result(60)
            assert p.cmd({"cmd": "expect", "count": 1, "timeout_s": 60})["records"][0]["crc32c"] == crc32c.crc32c(data)
            qp = ep.connect(addr).rcs[0].qp
            assert targets == [] and qp.requester._push and len(qp.requester._no_push_rkeys) == 1
    finally:
        p.close()


def test_placed_notes_past_the_write_fail_the_receivers_qp(monkeypatch, caplog):
    """A sender whose PLACED notes claim more than the WRITE holds: the receiver's QP fails naming the
    violation, so the transfer fails here instead of being taken as placed."""
    real = R.Requester._push_target

    def lying(self, wr, body):
        got = real(self, wr, body)
        return None if got is None else (got[0], got[1] + got[1][:1], got[2])  # one note too many

    monkeypatch.setattr(R.Requester, "_push_target", lying)
    monkeypatch.setenv("EASYPYVERBS_SOFT_PUSH", "always")  # (the peer, spawned after, takes every push)
    c = cfg("fedrdma-e", no_progress_timeout_s=5)
    p, addr = peer(c)
    try:
        with Endpoint(c) as ep, pytest.raises(E.FateRdmaError):
            ep.send(addr, np.ones(8 << 20, dtype=np.uint8)).result(60)
        assert p.cmd({"cmd": "stats"})["ok"]  # the receiving process is fine
    finally:
        p.close()


def test_a_push_at_naming_us_or_a_pid_that_is_not_the_peer_is_declined(caplog):
    """A responder's PUSH_AT may name only the process at the other end of the QP's connection: not this one
    (our own regions, our slots among them), not a third process (one whose memory holds our probe bytes,
    which a peer can plant there through that process's own receive slot, proves nothing)."""
    ctx = ev.open_device(provider="soft")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        buf = np.zeros(2 << 20, dtype=np.uint8)
        mr = ctx.alloc_pd().reg_mr(buf, ev.Access.LOCAL_WRITE)
        q = R.Requester(types.SimpleNamespace(qpn=1), 0)  # (a QP port with only what a push's checks read)
        q._push = True
        wr = R._WR(7, "write", [mr.sge(0, buf.nbytes)], 0x10000, 1, None, True)
        ours = ev.buffers.shared_array(4 << 20)
        fd, ino, base, size = shm.region_of([(int(ours.ctypes.data), 1)])
        assert q._push_target(wr, (fd, ino, base, size, os.getpid())) is None  # this process
        assert q._push_target(wr, (fd, ino, base, size, other.pid)) is None  # one of our regions, another pid
        with caplog.at_level(logging.WARNING, logger="easypyverbs.soft"):
            assert q._push_target(wr, (3, ino + 1, 0x10000, 1 << 30, other.pid)) is None  # not the peer
        assert not q._push and "does not hold its end" in caplog.text  # this QP pushes no more
        mr.close()
    finally:
        other.kill()
        other.wait()
        ctx.close()


def test_peer_owns_finds_the_process_at_the_other_end_of_a_connection():
    import socket

    with socket.create_server(("127.0.0.1", 0)) as srv:
        with socket.create_connection(srv.getsockname()) as c:
            a, _ = srv.accept()
            other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
            try:
                assert samehost.peer_owns(os.getpid(), c) and samehost.peer_owns(os.getpid(), a)
                assert not samehost.peer_owns(other.pid, c)
            finally:
                other.kill()
                other.wait()
                a.close()


def test_the_wire_keeps_push_out_of_the_opcode():
    assert wire.OP_PUSH & wire.OP_MASK == 0 and wire.OP_PULL & wire.OP_MASK == 0
    assert {wire.OP_SEND, wire.OP_WRITE, wire.OP_READ, wire.OP_PLACED} <= set(range(wire.OP_MASK + 1))


def test_doctor_says_whether_push_is_on(monkeypatch):
    from easypyverbs import doctor

    assert doctor._same_host()["push"] is True
    monkeypatch.setenv("EASYPYVERBS_SOFT_PUSH", "off")
    assert doctor._same_host()["push"] is False
    assert "push (the sender copies WRITEs of 1 MiB and more" in doctor.render(doctor.report())


def test_a_receiver_takes_a_push_only_while_it_copies_another_write(monkeypatch):
    monkeypatch.delenv("EASYPYVERBS_SOFT_PUSH", raising=False)
    with shm.placing() as others:
        assert others == 0 and not shm.take_push(others)  # nothing else to copy: it reads the WRITE itself
        with shm.placing() as more:
            assert more == 1 and shm.take_push(more)  # busy copying another: the sender copies this one in
    with shm.placing() as others:
        assert others == 0  # the count went back down
    monkeypatch.setenv("EASYPYVERBS_SOFT_PUSH", "always")
    assert shm.take_push(0)
