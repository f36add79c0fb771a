"""The sans-IO receive pool of FedRDMA-E (protocol/pool.py): slots that grow on the sender's request and
shrink when the receiver is idle. Transition tests for both sides, every peer field checked, the
GROWING state of the sender's machine, and a scheduler that interleaves both directions at random
while checking that a legitimate sender never writes memory the receiver has not registered for it."""
from __future__ import annotations

import collections
import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fate_rdma import errors as E
from fate_rdma import protocol as P
from fate_rdma.protocol.frames import CtrlKind
from fate_rdma.protocol.policy import GROW_GRANULE_BYTES, slot_room

SS, GS = P.SlotState, P.GrantState
MAX = 8 * GROW_GRANULE_BYTES


def ring(n=2, cap=100):
    return P.SlotRing(n, [cap] * n, MAX, [10 + i for i in range(n)])


def credit(slot, rkey, capacity):
    return P.Ctrl(CtrlKind.CREDIT, capacity, slot, rkey)


# -- the sender's side ------------------------------------------------------------------------------------
def test_ring_takes_the_best_fitting_free_slot():
    r = P.SlotRing(3, [100, 5000, 1000], MAX)
    assert r.acquire(900) == 2  # the smallest with room
    assert r.acquire(50) == 0
    r.credit(0)
    r.credit(2)
    assert r.acquire(20000) == 1  # none has room: the largest grows least
    assert r.acquire() == 2 and r.acquire() == 0 and r.acquire() is None  # ring order without a size


def test_ring_can_wait_for_a_slot_in_use_that_has_room():
    """Back-to-back transfers of one size: the next waits for the slot the last one used (its memory is
    faulted in) instead of growing the other, when the caller asks; without room anywhere it grows."""
    r = P.SlotRing(2, [5000, 100], MAX)
    assert r.acquire(4000) == 0
    assert r.acquire(4000, wait_for_room=True) is None  # slot 0 has room and comes back
    assert r.acquire(4000) == 1  # the caller stopped waiting: slot 1 grows
    r.credit(0)
    assert r.acquire(4000, wait_for_room=True) == 0
    assert r.acquire(9000, wait_for_room=True) is None  # no free slot at all
    r.credit(0)
    assert r.acquire(9000, wait_for_room=True) == 0  # none has room: the largest free grows


def test_ring_grows_a_slot_before_writing():
    r = ring()
    s = r.acquire()
    assert (s, r.state[s]) == (0, SS.BUSY)
    grow = r.grow(s, 7, 5000)
    assert grow == P.Ctrl(CtrlKind.GROW, 7, 0, 5000) and r.state[0] is SS.GROWING and r.growing(7)
    assert r.on_credit(credit(0, 99, slot_room(5000, MAX))) == 7  # the answer to transfer 7's GROW
    assert (r.state[0], r.rkey[0], r.capacity[0]) == (SS.BUSY, 99, GROW_GRANULE_BYTES)
    assert r.on_credit(credit(0, 98, GROW_GRANULE_BYTES)) is None  # the transfer arrived, the slot is free again
    assert r.state[0] is SS.FREE and r.rkey[0] == 98


def test_ring_refused_grow_keeps_the_old_grant():
    r = ring()
    r.acquire()
    r.grow(0, 7, 5000)
    assert r.on_refused(8) is None and r.state[0] is SS.GROWING  # another transfer's ERROR
    assert r.on_refused(7) is None and r.state[0] is SS.BUSY
    assert r.give_back(0) is None and (r.state[0], r.rkey[0], r.capacity[0]) == (SS.FREE, 10, 100)


def test_ring_grow_of_a_transfer_that_ended_waits_for_its_answer():
    r = ring(1)
    r.acquire()
    r.grow(0, 7, 5000)
    assert r.give_back(0) is None and r.state[0] is SS.GROWING  # cancelled: the slot may be changing
    assert r.acquire() is None
    assert r.on_credit(credit(0, 99, GROW_GRANULE_BYTES)) is None  # no transfer goes on ...
    assert r.state[0] is SS.FREE and r.capacity[0] == GROW_GRANULE_BYTES  # ... but the room is ours
    assert r.acquire() == 0


def test_ring_returns_a_free_slot_at_once_and_a_busy_one_when_it_ends():
    r = ring()
    assert r.on_reclaim(P.Ctrl(CtrlKind.RECLAIM, 0, 1, 11)) == P.Ctrl(CtrlKind.RETURN, 0, 1, 11)
    assert r.state[1] is SS.RETURNED
    assert r.acquire() == 0 and r.acquire() is None  # slot 1 is not ours until its CREDIT
    assert r.on_reclaim(P.Ctrl(CtrlKind.RECLAIM, 0, 0, 10)) is None  # in use: later
    assert r.give_back(0) == P.Ctrl(CtrlKind.RETURN, 0, 0, 10) and r.state[0] is SS.RETURNED
    r.on_credit(credit(1, 21, 100))
    assert r.state[1] is SS.FREE and r.rkey[1] == 21


def test_ring_reclaim_is_void_once_the_slot_is_granted_again():
    r = ring(1)
    r.acquire()
    r.on_reclaim(P.Ctrl(CtrlKind.RECLAIM, 0, 0, 10))  # crossed our transfer's header on the wire
    r.on_credit(credit(0, 11, 100))  # the receiver took the transfer and granted the slot again
    assert r.acquire() == 0
    assert r.give_back(0) is None and r.state[0] is SS.FREE  # nothing is owed any more


@pytest.mark.parametrize("frame,match", [
    (credit(5, 1, 100), "field 'value'"),
    (credit(0, 1 << 32, 100), "field 'aux' \\(rkey\\)"),
    (credit(0, 1, MAX + 1), "field 'transfer_id' \\(capacity\\)"),
    (credit(1, 1, 100), "not in use"),
    (P.Ctrl(CtrlKind.RECLAIM, 0, 0, 77), "field 'aux' \\(rkey\\) = 77"),
    (P.Ctrl(CtrlKind.RECLAIM, 0, 9, 10), "field 'value'"),
])
def test_ring_refuses_forged_fields(frame, match):
    r = ring()
    r.acquire()
    with pytest.raises(E.RemoteProtocolError, match=match):
        (r.on_credit if frame.kind is CtrlKind.CREDIT else r.on_reclaim)(frame)


def test_ring_refuses_a_grant_smaller_than_asked_and_a_second_reclaim():
    r = ring()
    r.acquire()
    r.grow(0, 7, 5000)
    with pytest.raises(E.RemoteProtocolError, match="less than the 5000 bytes its GROW asked for"):
        r.on_credit(credit(0, 99, 4999))
    r2 = ring()
    r2.on_reclaim(P.Ctrl(CtrlKind.RECLAIM, 0, 1, 11))
    with pytest.raises(E.RemoteProtocolError, match="returned already"):
        r2.on_reclaim(P.Ctrl(CtrlKind.RECLAIM, 0, 1, 11))


def test_ring_transition_table_is_closed():
    r = ring()
    with pytest.raises(E.LocalProtocolError, match="'grow' not allowed in state free"):
        r.grow(0, 1, 5000)
    r.acquire()
    with pytest.raises(E.LocalProtocolError, match="no GROW"):
        r.grow(0, 1, 50)  # fits already
    with pytest.raises(E.LocalProtocolError, match="no GROW"):
        r.grow(0, 1, MAX + 1)
    for state in SS:
        for event in P.pool.SlotEvent:
            if (state, event) not in r.TRANSITIONS:
                r.state[0] = state
                with pytest.raises(E.LocalProtocolError):
                    r._move(0, event)


# -- the receiver's side ----------------------------------------------------------------------------------
def pool(idle_s=5.0):
    return P.ReceivePool(2, MAX, 100, idle_s, 0.0, [10, 11])


def test_pool_grants_grows_and_shrinks_when_idle():
    p = pool()
    grow = P.Ctrl(CtrlKind.GROW, 7, 0, 5000)
    cap = p.room_for(grow)
    assert cap == GROW_GRANULE_BYTES and p.capacity[0] == 100  # nothing changes before `grown`
    assert p.grown(0, 20, cap, 1.0) == credit(0, 20, cap)
    assert p.idle(5.9) == []  # not idle long enough
    assert p.idle(6.1) == [P.Ctrl(CtrlKind.RECLAIM, 0, 0, 20)]  # slot 1 never grew: nothing to give back
    assert p.state[0] is GS.RECLAIMING and p.idle(100.0) == []  # asked once
    assert p.on_return(P.Ctrl(CtrlKind.RETURN, 0, 0, 20)) == 100
    assert p.granted(0, 21, 100) == credit(0, 21, 100) and p.state[0] is GS.GRANTED


def test_pool_arrival_voids_a_reclaim_and_release_grants_again():
    p = pool()
    p.grown(0, 20, p.room_for(P.Ctrl(CtrlKind.GROW, 7, 0, 5000)), 0.0)
    p.idle(10.0)
    p.arrive(0, 10.5)  # the peer's transfer crossed the RECLAIM
    assert p.held == [0]
    with pytest.raises(E.RemoteProtocolError, match="still held"):
        p.arrive(0, 11.0)
    with pytest.raises(E.RemoteProtocolError, match="held by the consumer"):
        p.room_for(P.Ctrl(CtrlKind.GROW, 8, 0, 2 * GROW_GRANULE_BYTES))
    with pytest.raises(E.RemoteProtocolError, match="did not ask back"):
        p.on_return(P.Ctrl(CtrlKind.RETURN, 0, 0, 20))
    p.release(0, 12.0)
    p.granted(0, 22, p.capacity[0])
    with pytest.raises(E.LocalProtocolError, match="released twice"):
        p.release(0, 12.0)
    assert p.idle(16.9) == [] and p.idle(17.1) == [P.Ctrl(CtrlKind.RECLAIM, 0, 0, 22)]


@pytest.mark.parametrize("frame,match", [
    (P.Ctrl(CtrlKind.GROW, 1, 2, 5000), "field 'value' \\(slot\\) = 2"),
    (P.Ctrl(CtrlKind.GROW, 1, 0, MAX + 1), "field 'aux' \\(payload bytes\\) = .* exceeds the slot's maximum"),
    (P.Ctrl(CtrlKind.GROW, 1, 0, 100), "field 'aux' \\(payload bytes\\) = 100, slot 0 has room"),
    (P.Ctrl(CtrlKind.RETURN, 0, 0, 10), "did not ask back"),
    (P.Ctrl(CtrlKind.RETURN, 0, 5, 10), "field 'value'"),
])
def test_pool_refuses_forged_fields(frame, match):
    p = pool()
    with pytest.raises(E.RemoteProtocolError, match=match):
        (p.room_for if frame.kind is CtrlKind.GROW else p.on_return)(frame)
    assert p.capacity == [100, 100] and p.state == [GS.GRANTED, GS.GRANTED]


def test_pool_never_shrinks_with_idle_zero_and_its_table_is_closed():
    p = pool(idle_s=0.0)
    p.grown(0, 20, GROW_GRANULE_BYTES, 0.0)
    assert p.idle(1e9) == []
    with pytest.raises(E.LocalProtocolError, match="'return' not allowed in state granted"):
        p._move(0, P.pool.GrantEvent.RETURN)
    p.arrive(0, 1.0)
    with pytest.raises(E.LocalProtocolError, match="granted in state held"):
        p.granted(0, 1, 100)


def test_receiver_checks_the_header_against_the_slots_room_now():
    rx = P.FedRdmaEReceiver(1, MAX, meta_cap=0, verify_crc=False, initial_payload_bytes=100)
    hdr = P.encode_header(P.Header(P.HeaderKind.SLOT, 1, 0, 1, 0, 101, 0, 101))
    with pytest.raises(E.RemoteProtocolError, match="the slot holds 100"):
        rx.on_write_imm(0, memoryview(hdr))  # the maximum is larger; the grant is not
    rx.pool.grown(0, 5, GROW_GRANULE_BYTES, 0.0)
    hdr = P.encode_header(P.Header(P.HeaderKind.SLOT, 2, 0, 1, 0, 101, 0, 101))
    assert rx.on_write_imm(0, memoryview(hdr)).header.total == 101 and rx.held == {0}


# -- the sender's machine waits in GROWING ------------------------------------------------------------------
def test_sender_grows_then_sends():
    s = P.FedRdmaESender(3, 3, 0, 50, 10, 4, 0.0, slot_payload_bytes=100, room_bytes=20, no_progress_s=5)
    assert s.state is P.fedrdma.SendState.GROWING and not s.finished and s.next_chunks() == []
    with pytest.raises(E.RemoteProtocolError, match="grew to 40 bytes"):
        s.on_room(40, 1.0)
    s.on_room(64, 1.0)
    assert s.state is P.fedrdma.SendState.SENDING and len(s.next_chunks()) == 4
    assert P.FedRdmaESender(4, 4, 0, 20, 10, 4, 0.0, slot_payload_bytes=100, room_bytes=20).state \
        is P.fedrdma.SendState.SENDING  # fits: no GROW


def test_sender_unanswered_grow_times_out_and_can_be_cancelled():
    s = P.FedRdmaESender(3, 3, 0, 50, 10, 4, 0.0, slot_payload_bytes=100, room_bytes=20, no_progress_s=5)
    s.tick(4.0)
    with pytest.raises(E.TransferTimeout, match="did not answer its GROW"):
        s.tick(6.0)
    assert s.state is P.fedrdma.SendState.FAILED and s.settled and not s.header_posted
    c = P.FedRdmaESender(3, 3, 0, 50, 10, 4, 0.0, slot_payload_bytes=100, room_bytes=20)
    c.cancel()
    assert c.state is P.fedrdma.SendState.CANCELLED
    with pytest.raises(E.LocalProtocolError):
        c.on_room(64, 1.0)


# -- both sides over an adversarial schedule ------------------------------------------------------------------
class Pair:
    """A sender's SlotRing and a receiver's ReceivePool joined by two in-order queues (QP 0 in each
    direction), with the receiver's registrations and memory budget. Writes are checked against the
    registration the receiver holds when they arrive: a legitimate sender must never meet a remote
    access error."""

    def __init__(self, rng: random.Random, nslots: int = 2, initial: int = 100, budget: int = 3 * GROW_GRANULE_BYTES,
                 idle_s: float = 1.0) -> None:
        self.rng, self.now, self.budget = rng, 0.0, budget
        self.keys = itertools.count(1000)
        self.mr = {s: (next(self.keys), initial) for s in range(nslots)}  # slot -> (rkey, capacity) registered
        self.ring = P.SlotRing(nslots, [initial] * nslots, MAX, [self.mr[s][0] for s in range(nslots)])
        self.pool = P.ReceivePool(nslots, MAX, initial, idle_s, 0.0, [self.mr[s][0] for s in range(nslots)])
        self.used = nslots * initial
        self.s2r: collections.deque = collections.deque()
        self.r2s: collections.deque = collections.deque()
        self.active = None  # (transfer id, slot, size) waiting for room
        self.held = []
        self.tids = itertools.count(1)
        self.outcome = collections.Counter()

    # sender
    def start(self, size: int) -> None:
        slot = self.ring.acquire(size)
        if slot is None:
            return
        tid = next(self.tids)
        if size > self.ring.capacity[slot]:
            self.s2r.append(self.ring.grow(slot, tid, size))
            self.active = (tid, slot, size)
        else:
            self.s2r.append(("write", slot, self.ring.rkey[slot], size))

    def cancel(self) -> None:
        tid, slot, _ = self.active
        self.active = None
        self.outcome["cancelled"] += 1
        self._send(self.ring.give_back(slot))

    def _send(self, c) -> None:
        if c is not None:
            self.s2r.append(c)

    def sender_gets(self, c: P.Ctrl) -> None:
        if c.kind is CtrlKind.CREDIT:
            tid = self.ring.on_credit(c)
            if tid is not None:
                assert self.active is not None and self.active[0] == tid
                _, slot, size = self.active
                self.active = None
                self.s2r.append(("write", slot, self.ring.rkey[slot], size))
        elif c.kind is CtrlKind.RECLAIM:
            self._send(self.ring.on_reclaim(c))
        else:  # ERROR: a refused GROW
            self._send(self.ring.on_refused(c.transfer_id))
            if self.active is not None and self.active[0] == c.transfer_id:
                self.outcome["refused"] += 1
                _, slot, _ = self.active
                self.active = None
                self._send(self.ring.give_back(slot))

    # receiver
    def receiver_gets(self, c) -> None:
        if isinstance(c, tuple):
            _, slot, rkey, size = c
            assert self.mr[slot] is not None and self.mr[slot][0] == rkey and size <= self.mr[slot][1], \
                f"remote access error: slot {slot} written under rkey {rkey} with {size} bytes, registered {self.mr[slot]}"
            self.pool.arrive(slot, self.now)
            self.mr[slot] = None  # revoked while held
            self.held.append(slot)
            self.outcome["delivered"] += 1
        elif c.kind is CtrlKind.GROW:
            slot, cap = c.value, self.pool.room_for(c)  # a legitimate sender's GROW is always valid
            more = cap - self.pool.capacity[slot]
            if self.used + more > self.budget:
                self.r2s.append(P.Ctrl(CtrlKind.ERROR, c.transfer_id, 2))
                return
            self.used += more
            self.outcome["grown"] += 1
            self.mr[slot] = (next(self.keys), cap)
            self.r2s.append(self.pool.grown(slot, self.mr[slot][0], cap, self.now))
        else:  # RETURN
            slot, cap = c.value, self.pool.on_return(c)
            self.used -= self.pool.capacity[slot] - cap
            self.outcome["returned"] += 1
            self.mr[slot] = (next(self.keys), cap)
            self.r2s.append(self.pool.granted(slot, self.mr[slot][0], cap))

    def release(self) -> None:
        slot = self.held.pop(self.rng.randrange(len(self.held)))
        self.pool.release(slot, self.now)
        self.mr[slot] = (next(self.keys), self.pool.capacity[slot])
        self.r2s.append(self.pool.granted(slot, self.mr[slot][0], self.pool.capacity[slot]))

    def step(self, may_start: bool) -> bool:
        acts = []
        if may_start and self.active is None:
            acts.append(lambda: self.start(self.rng.choice([5, 100, 3000, GROW_GRANULE_BYTES + 1, 2 * GROW_GRANULE_BYTES,
                                                            4 * GROW_GRANULE_BYTES])))
        if self.active is not None and may_start:
            acts.append(self.cancel)
        if self.s2r:
            acts.append(lambda: self.receiver_gets(self.s2r.popleft()))
        if self.r2s:
            acts.append(lambda: self.sender_gets(self.r2s.popleft()))
        if self.held:
            acts.append(self.release)
        if may_start:
            acts.append(self._idle)
        if not acts:
            return False
        self.rng.choice(acts)()
        return True

    def _idle(self) -> None:
        self.now += self.rng.random()
        self.r2s.extend(self.pool.idle(self.now))


def run_pair(seed: int, steps: int = 400) -> Pair:
    pair = Pair(random.Random(seed))
    for _ in range(steps):
        pair.step(may_start=True)
    while pair.step(may_start=False):  # drain: every frame delivered, every slot released
        pass
    assert pair.active is None and not pair.held
    assert pair.ring.state == [SS.FREE] * 2 and pair.pool.state == [GS.GRANTED] * 2
    assert pair.ring.capacity == pair.pool.capacity == [pair.mr[s][1] for s in range(2)]
    assert pair.ring.rkey == pair.pool.rkey == [pair.mr[s][0] for s in range(2)]
    assert pair.used == sum(pair.pool.capacity) <= pair.budget
    return pair


@pytest.mark.parametrize("seed", range(30))
def test_grow_reclaim_and_return_under_any_interleaving(seed):
    pair = run_pair(seed)
    assert pair.outcome["delivered"] > 0


def test_the_schedules_reach_every_path():
    total = collections.Counter()
    for seed in range(30):
        total.update(run_pair(seed).outcome)
    print(dict(total))
    assert all(total[k] for k in ("delivered", "grown", "refused", "cancelled", "returned"))


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32))
def test_fuzz_interleavings(seed):
    run_pair(seed, steps=200)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([CtrlKind.CREDIT, CtrlKind.RECLAIM, CtrlKind.GROW, CtrlKind.RETURN]),
                          st.integers(0, 1 << 40), st.integers(0, 3), st.integers(0, 1 << 33)), max_size=30))
def test_fuzz_forged_frames_only_protocol_errors_escape(frames):
    r, p = ring(), pool()
    r.acquire()
    for kind, tid, value, aux in frames:
        c = P.Ctrl(kind, tid, value, aux)
        try:
            if kind is CtrlKind.CREDIT:
                r.on_credit(c)
            elif kind is CtrlKind.RECLAIM:
                r.on_reclaim(c)
            elif kind is CtrlKind.GROW:
                p.grown(value, aux & 0xFFFFFFFF, p.room_for(c), 0.0)
            else:
                p.on_return(c)
        except E.RemoteProtocolError:
            pass
        assert all(0 <= cap <= MAX for cap in r.capacity + p.capacity)
