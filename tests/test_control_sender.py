"""The channel's control sender (channel/control.py): which SENDs ask for a completion, buffers freed by a
later completion, the backlog, and frames held for an engine turn's batch. A fake QP records the posts."""
from __future__ import annotations

import pytest

from fate_rdma import protocol as P
from fate_rdma.channel.control import ControlSender
from fate_rdma.protocol.frames import CtrlKind


class FakeMem:
    def __init__(self, n: int) -> None:
        self.ctrl_free = list(range(n - 1, -1, -1))
        self.frames = {}

    def put_ctrl(self, idx: int, raw: bytes) -> int:
        self.frames[idx] = raw
        return idx  # (the SGE: the fake QP only records it)


class FakeQP:
    def __init__(self) -> None:
        self.posts = []  # (buffer index, wr_id, signaled)

    def post_send(self, sge, wr_id=0, signaled=True):
        self.posts.append((sge, wr_id, signaled))


def _sender(nbufs: int):
    mem, qp = FakeMem(nbufs), FakeQP()
    return ControlSender(mem, lambda: qp, lambda idx: 1000 + idx), mem, qp  # type: ignore[arg-type]


def _done(tid: int) -> P.Ctrl:
    return P.Ctrl(CtrlKind.DONE, tid)


def test_one_send_in_signal_every_asks_for_a_completion_which_frees_every_buffer_before_it():
    cs, mem, qp = _sender(256)
    every = ControlSender.SIGNAL_EVERY
    for t in range(3 * every):
        cs.send(_done(t))
    signaled = [i for i, (_, _, sig) in enumerate(qp.posts) if sig]
    assert signaled == [every - 1, 2 * every - 1, 3 * every - 1]
    assert all(wr_id == 0 for _, wr_id, sig in qp.posts if not sig)  # no completion: nothing to look up
    assert len(mem.ctrl_free) == 256 - 3 * every
    idx, wr_id, _ = qp.posts[every - 1]
    assert wr_id == 1000 + idx
    cs.on_complete(idx)  # the first signaled SEND completed, and every SEND before it
    assert len(mem.ctrl_free) == 256 - 2 * every
    free = set(mem.ctrl_free)
    assert {p[0] for p in qp.posts[:every]} <= free and not {p[0] for p in qp.posts[every:]} & free
    assert [P.decode_ctrl(mem.frames[p[0]]).transfer_id for p in qp.posts[:3]] == [0, 1, 2]


def test_short_of_buffers_every_send_is_signaled_and_the_backlog_waits_in_order():
    n = ControlSender.SIGNAL_EVERY + 2
    cs, mem, qp = _sender(n)
    for t in range(n + 3):
        cs.send(_done(t))
    assert len(qp.posts) == n and not mem.ctrl_free  # three wait in the backlog
    assert [sig for _, _, sig in qp.posts][-ControlSender.SIGNAL_EVERY:] == [True] * ControlSender.SIGNAL_EVERY
    cs.on_complete(qp.posts[2][0])  # frees the first three: the backlog goes, in order
    assert [P.decode_ctrl(mem.frames[p[0]]).transfer_id for p in qp.posts[n:]] == [n, n + 1, n + 2]
    assert all(sig for _, _, sig in qp.posts[n:])


def test_frames_held_for_a_turn_leave_at_flush_or_at_its_end_and_not_after_an_error():
    cs, mem, qp = _sender(64)
    with cs.held():
        cs.send(_done(1))
        assert qp.posts == []
        cs.flush()  # (inside the turn's batch of WRITEs)
        assert len(qp.posts) == 1
        cs.send(_done(2))
        assert len(qp.posts) == 1
    assert [P.decode_ctrl(mem.frames[p[0]]).transfer_id for p in qp.posts] == [1, 2]
    with pytest.raises(RuntimeError):
        with cs.held():
            cs.send(_done(3))
            raise RuntimeError("the engine fails mid-turn")
    assert len(qp.posts) == 2  # the connection is going down: the held frame is dropped
    cs.send(_done(4))  # and nothing is held any more
    assert len(qp.posts) == 3
