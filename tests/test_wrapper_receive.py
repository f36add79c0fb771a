"""The federation wrapper's receive loop: if it fails, every waiting get fails at once with the cause."""
from __future__ import annotations

import logging
import threading
import time

import pytest

from fate_rdma import errors as E
from fate_rdma.channel.buffers import RecvBuffers
from fate_rdma.federation.config import RdmaFederationConfig
from fate_rdma.federation.store import Store
from fate_rdma.federation.wrapper import RdmaFederation


class BrokenEndpoint:
    """An endpoint whose receive fails after a short while, as a broken channel would."""

    def __init__(self, after_s: float) -> None:
        self.fail_at = time.monotonic() + after_s

    def recv(self, timeout=None):
        time.sleep(min(timeout or 0.05, 0.05))
        if time.monotonic() >= self.fail_at:
            raise MemoryError("cannot allocate the reassembly buffer")
        raise E.TransferTimeout("nothing yet")


def loop_over(endpoint) -> RdmaFederation:
    """Only what the receive loop uses; the rest of the wrapper needs FATE (test_federation.py)."""
    fed = object.__new__(RdmaFederation)
    fed.endpoint, fed._store, fed._stop, fed.local = endpoint, Store(), False, ("arbiter", "10000")
    fed.announce = False  # descriptors: fate (the announced path: test_federation.py)
    fed.cfg = RdmaFederationConfig(endpoints={"arbiter:10000": "127.0.0.1:1"})  # (its channel's pool_idle_s)
    fed.put_copies = RecvBuffers(1 << 20)  # trimmed by the loop while idle
    return fed


def test_failed_receive_loop_fails_waiting_gets_with_the_cause(caplog):
    fed = loop_over(BrokenEndpoint(after_s=0.3))
    rx = threading.Thread(target=fed._receive, daemon=True)
    rx.start()
    t0 = time.monotonic()
    with pytest.raises(E.PeerUnreachable, match="receive loop failed.*reassembly buffer"):
        fed._store.take("payload-1", timeout_s=60)
    assert time.monotonic() - t0 < 5, "the get waited for its timeout instead of failing at once"
    rx.join(5)
    assert not rx.is_alive()
    with pytest.raises(E.PeerUnreachable, match="receive loop failed"):  # later gets too
        fed._store.take("payload-2", timeout_s=60)
    assert [r for r in caplog.records if "receive loop" in r.getMessage() and r.levelname == "ERROR"]


def test_payloads_that_arrived_before_the_failure_are_still_delivered():
    store = Store()
    store.put("early", b"x")
    store.fail(RuntimeError("boom"))
    assert store.take("early", 1) == b"x"



def test_the_store_drops_what_nobody_asks_for_and_what_comes_after_its_get_gave_up(caplog):
    """A peer cannot make a party hold memory without end: an object unclaimed for keep_s after its
    arrival is dropped, and one that arrives after its get timed out is not kept at all; each is logged."""
    store = Store(keep_s=0.3)
    key = ("obj", "s", "w", "t", "host:1")
    with pytest.raises(E.TransferTimeout, match="did not arrive within 0.05 s"):
        store.take(key, 0.05)
    with caplog.at_level(logging.WARNING, logger="fate_rdma.federation"):
        store.put(key, b"late")
        assert len(store) == 0 and store.dropped == 1
        store.put("unclaimed", b"x" * 100)
        time.sleep(0.4)
        store.put("fresh", b"y")  # the next arrival sweeps what has waited too long (the late key is forgotten too)
        assert len(store) == 1 and store.dropped == 2
        store.put(key, b"again")  # the given-up key has expired: a new round may use the name again
    assert store.take(key, 1) == b"again" and store.take("fresh", 1) == b"y"
    # a get that asks again for a key whose earlier get gave up takes what arrives now
    with pytest.raises(E.TransferTimeout):
        store.take("retried", 0.05)
    threading.Timer(0.2, store.put, ("retried", b"now")).start()
    assert store.take("retried", 5) == b"now"
    assert "'w' (tag 't') from party host:1: it arrived after its get gave up" in caplog.text
    assert "payload unclaimed: no get asked for it within 0.3 s" in caplog.text

class OneMessageEndpoint:
    """Delivers one payload, then nothing (as a quiet channel between rounds)."""

    def __init__(self, msg) -> None:
        self.msg, self.recvs = msg, 0

    def recv(self, timeout=None):
        self.recvs += 1
        msg, self.msg = self.msg, None
        if msg is None:
            time.sleep(min(timeout or 0.05, 0.05))
            raise E.TransferTimeout("nothing yet")
        return msg


def test_the_receive_loop_holds_no_payload_while_it_waits_for_the_next():
    """Once FATE has taken a payload and let go of it, its reassembly buffer must be free for the next
    round's payload (recycled memory is already faulted in), not held by the loop's local names."""
    import sys

    import numpy as np

    from fate_rdma.channel.transfer import Message

    buf = np.zeros(4096, dtype=np.uint8)
    ep = OneMessageEndpoint(Message("p", 1, {"id": "payload-1"}, memoryview(buf).cast("B"), "fedrdma"))
    fed = loop_over(ep)
    rx = threading.Thread(target=fed._receive, daemon=True)
    rx.start()
    try:
        got = fed._store.take("payload-1", timeout_s=10)
        deadline = time.monotonic() + 5
        while ep.recvs < 3 and time.monotonic() < deadline:  # the loop is waiting for the next one
            time.sleep(0.01)
        del got
        assert sys.getrefcount(buf) == 2, "something still refers to the delivered payload's buffer"
    finally:
        fed._stop = True
        rx.join(5)


class _Msg:
    """What the wrapper's take reads of a channel Message; `lent`: detach lends it in place (no copy)."""

    def __init__(self, nbytes, md, lent=False):
        self.nbytes, self.metadata, self.lent, self.peer, self.transfer_id = nbytes, md, lent, "127.0.0.1:2", 7
        self.released = False

    def detach(self, copy_up_to=None):
        if not self.lent and copy_up_to is not None and self.nbytes > copy_up_to:
            return None  # (Message.detach: a copy larger than allowed is not made)
        self.released = not self.lent
        return memoryview(bytes(self.nbytes))

    def release(self):
        self.released = True


def test_messages_are_stored_by_the_thread_that_completes_them_unless_a_large_copy_is_needed():
    """Endpoint.on_message: a message reaches the store without the receive loop (no hand-off between threads),
    lent in place whatever its size; one that would need a copy of more than INLINE_COPY_BYTES is left to the
    loop (the completing thread must not wait for it)."""
    from fate_rdma.federation.receiving import INLINE_COPY_BYTES

    fed = loop_over(BrokenEndpoint(after_s=3600))
    fed.stats = {"lent_bytes": 0}
    assert fed._take_inline(_Msg(1000, {"id": "small"})) is True
    assert bytes(fed._store.take("small", 1)) == bytes(1000)
    assert fed._take_inline(_Msg(INLINE_COPY_BYTES + 1, {"id": "copied"})) is False and len(fed._store) == 0
    lent = _Msg(4 * INLINE_COPY_BYTES, {"id": "lent"}, lent=True)
    assert fed._take_inline(lent) is True and fed._store.take("lent", 1).nbytes == lent.nbytes
    assert fed.stats["lent_bytes"] == lent.nbytes
    odd = _Msg(10, {"id": "x", "announce": True})  # descriptors differ: said, let go, nothing stored
    fed._party_at, fed.fed = {}, type("Fed", (), {"session_id": "job-1"})()
    assert fed._take_inline(odd) is True and odd.released and len(fed._store) == 0
    fed._stop = True  # closing: nothing more is taken inline
    assert fed._take_inline(_Msg(10, {"id": "late"})) is False


def test_a_take_that_fails_fails_the_gets_as_the_loop_would_and_gives_the_slot_back():
    fed = loop_over(BrokenEndpoint(after_s=3600))
    fed.stats = {"lent_bytes": 0}
    bad = _Msg(10, {"id": "p"})
    bad.detach = lambda copy_up_to=None: (_ for _ in ()).throw(MemoryError("no room for the copy"))
    assert fed._take_inline(bad) is True and bad.released
    with pytest.raises(E.PeerUnreachable, match="no room for the copy"):
        fed._store.take("p", timeout_s=5)


def test_endpoint_offers_each_message_to_its_taker_before_the_inbox(caplog):
    """A taker that takes a message keeps it out of the inbox; one that declines or raises leaves it there."""
    import numpy as np

    from fate_rdma.channel import Endpoint
    from fate_rdma.config import ChannelConfig

    cfg = ChannelConfig(mode="fedrdma-e", provider="soft")
    rx, tx = Endpoint(cfg), Endpoint(cfg)
    with rx, tx:
        taken = []

        def take(msg):
            if msg.metadata["do"] == "raise":
                raise RuntimeError("taker broke")
            if msg.metadata["do"] == "take":
                taken.append((threading.current_thread().name, bytes(msg.detach())))
                return True
            return False

        rx.on_message(take)
        data = np.arange(100, dtype=np.uint8)
        tx.send(rx.address, data, {"do": "take"}).result(30)
        with pytest.raises(E.TransferTimeout):
            rx.recv(timeout=0.3)
        assert [t[1] for t in taken] == [data.tobytes()] and taken[0][0] != threading.current_thread().name
        for do in ("decline", "raise"):
            tx.send(rx.address, data, {"do": do}).result(30)
            msg = rx.recv(timeout=30)
            assert msg.metadata["do"] == do and bytes(msg.detach()) == data.tobytes()
        assert any("taker failed" in r.getMessage() for r in caplog.records)
        rx.on_message(None)
        tx.send(rx.address, data, {"do": "take"}).result(30)
        assert rx.recv(timeout=30).metadata["do"] == "take" and len(taken) == 1


def test_detach_makes_no_copy_larger_than_asked_and_leaves_the_message_as_it_was():
    import numpy as np

    from fate_rdma.channel.transfer import Message

    released = []
    payload = np.arange(3000, dtype=np.uint8)
    msg = Message("peer", 1, {}, memoryview(payload), "fedrdma-e", lambda: released.append(1), None, None)
    assert msg.detach(copy_up_to=1000) is None and released == [] and msg.nbytes == 3000
    got = msg.detach(copy_up_to=3000)
    assert bytes(got) == payload.tobytes() and released == [1]
