"""Where a connection's work runs: a user's send or release is taken in the caller's thread when no turn is
running (engine.Engine._request), and the soft provider's NIC threads hand their completions to the connection
in their own thread (SoftCQ.on_arrival). Fewer thread hand-offs a message; the same protocol under one lock.
These tests pin where the work runs and that a failure in a borrowed thread ends the connection as the
engine's own failure would: the transfers fail with a clear error, no caller is hung or interrupted by it."""
from __future__ import annotations

import threading

import pytest

import easypyverbs as ev
from fate_rdma import errors as E
from fate_rdma.channel import Endpoint
from fate_rdma.channel.engine import Engine

from .test_channel import cfg_for
from .verbs_pair import close_pair, make_pair

KiB = 1024


def _threads_of(monkeypatch, cls, name):
    """Record the name of each thread that calls `cls.name`."""
    seen = []
    orig = getattr(cls, name)

    def spy(*a, **k):
        seen.append(threading.current_thread().name)
        return orig(*a, **k)

    monkeypatch.setattr(cls, name, spy)
    return seen


# -- the soft CQ's arrival hook ----------------------------------------------------------------------
@pytest.mark.parametrize("handled", [True, False])
def test_the_soft_nics_thread_calls_on_arrival_after_queueing_its_completions(handled):
    a, b = make_pair("soft-tcp")
    try:
        got, threads = [], []

        def hook():
            threads.append(threading.current_thread().name)
            if handled:
                got.extend(b.cq.poll(16))
            return handled

        b.cq.on_arrival = hook
        b.qp.post_recv(b.mr.sge(0, 64), wr_id=7)
        a.buf[:5] = b"hello"
        a.qp.post_send(a.mr.sge(0, 5), wr_id=1)
        a.cq.wait_n(1, 10)
        if handled:
            for _ in range(200):  # (the hook runs just after the answer left: a moment after the sender's ACK)
                if got:
                    break
                threading.Event().wait(0.01)
            assert [wc.wr_id for wc in got] == [7] and got[0].byte_len == 5
            with pytest.raises(ev.PollTimeout):
                b.cq.wait(0.2)  # taken by the hook: nothing left to wake a waiter for
        else:
            wcs = b.cq.wait(10)  # not handled: the waiter is woken and finds it
            assert [wc.wr_id for wc in wcs] == [7]
            for _ in range(200):  # (queued before the answer left, the hook called after: it may come a moment later)
                if threads:
                    break
                threading.Event().wait(0.01)
        assert threads and all(t.startswith("soft-qp") for t in threads), threads
    finally:
        close_pair([a, b])


def test_on_arrival_sees_the_senders_write_completions_in_the_ack_thread():
    a, b = make_pair("soft-tcp")
    try:
        threads = []
        a.cq.on_arrival = lambda: threads.append(threading.current_thread().name) or False
        a.qp.post_write(a.mr.sge(0, 4 * KiB), b.mr.remote(), wr_id=3)
        assert [wc.wr_id for wc in a.cq.wait_n(1, 10)] == [3]
        assert threads and all(t.endswith("-acks") for t in threads), threads
    finally:
        close_pair([a, b])


# -- a connection's turns in borrowed threads --------------------------------------------------------
@pytest.mark.parametrize("mode", ["fedrdma-e", "fedrdma"])
def test_sends_start_in_the_callers_thread_and_completions_are_handled_in_the_nics(monkeypatch, mode):
    pumps = _threads_of(monkeypatch, Engine, "_pump")
    wcs = _threads_of(monkeypatch, Engine, "_on_recv")
    cfg = cfg_for(mode, "soft-tcp")
    with Endpoint(cfg) as rx, Endpoint(cfg) as tx:
        for i in range(20):  # (each place is a matter of timing for one message; over 20, both show)
            fut = tx.send(rx.address, bytes([i]) * (64 * KiB))
            msg = rx.recv(timeout=20)
            assert bytes(msg.view[:1]) == bytes([i]) and fut.result(20)["bytes"] == 64 * KiB
            msg.release()
    me = threading.current_thread().name
    assert me in pumps, f"no send was started in the caller's thread: {sorted(set(pumps))}"
    assert any(t.startswith("soft-qp") for t in wcs), f"no completion was handled where it landed: {sorted(set(wcs))}"


def test_a_failure_in_the_callers_turn_ends_the_connection_not_the_call(monkeypatch):
    cfg = cfg_for("fedrdma-e", "soft-tcp")
    with Endpoint(cfg) as rx, Endpoint(cfg) as tx:
        tx.send(rx.address, b"warm").result(20)
        rx.recv(timeout=20).release()
        pump = Engine._pump

        def broken(self):
            if threading.current_thread() is threading.main_thread():
                raise RuntimeError("a bug in a turn")
            return pump(self)

        monkeypatch.setattr(Engine, "_pump", broken)
        fut = tx.send(rx.address, b"x" * 1000)  # the call itself returns: its turn's failure is the engine's to report
        with pytest.raises(E.PeerUnreachable, match="a bug in a turn"):
            fut.result(20)
        monkeypatch.setattr(Engine, "_pump", pump)
        tx.send(rx.address, b"y").result(20)  # the endpoint connects anew; nothing of the failed one arrived
        msg = rx.recv(timeout=20)
        assert bytes(msg.view) == b"y"
        msg.release()


def test_an_interrupt_in_the_callers_turn_reaches_the_caller_and_ends_the_connection(monkeypatch):
    cfg = cfg_for("fedrdma-e", "soft-tcp")
    with Endpoint(cfg) as rx, Endpoint(cfg) as tx:
        tx.send(rx.address, b"warm").result(20)
        rx.recv(timeout=20).release()
        conn = tx.connect(rx.address)

        def interrupted(self):
            if threading.current_thread() is threading.main_thread():
                raise KeyboardInterrupt
            return None

        monkeypatch.setattr(Engine, "_pump", interrupted)
        with pytest.raises(KeyboardInterrupt):
            conn.send(b"x" * 1000)
        conn.engine.thread.join(10)
        assert not conn.engine.thread.is_alive() and isinstance(conn.dead, KeyboardInterrupt)


class _PatientLock:
    """A turn lock whose try-acquire waits (up to 2 s) in the NIC's threads: a completion that lands while another
    thread's turn holds the lock is still handled where it landed, so the test does not depend on timing."""

    def __init__(self, lock, engine) -> None:
        self._lock, self._engine = lock, engine

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        nic = threading.current_thread() not in (self._engine.thread, threading.main_thread())
        if not blocking and nic:
            return self._lock.acquire(timeout=2.0)
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def test_a_failure_in_the_nics_thread_ends_the_connection(monkeypatch):
    """A completion handled where it landed (the soft NIC's thread) that raises ends the connection: the
    transfer fails naming the error, as if the engine's thread had raised it."""
    cfg = cfg_for("fedrdma-e", "soft-tcp")
    with Endpoint(cfg) as rx, Endpoint(cfg) as tx:
        tx.send(rx.address, b"warm").result(20)
        rx.recv(timeout=20).release()
        real = Engine._on_wc
        engine = tx.connect(rx.address).engine
        nic_calls = []

        def broken(self, wc):  # (the NIC threads' path only: not the engine's own thread)
            if self is engine and threading.current_thread() not in (self.thread, threading.main_thread()):
                nic_calls.append(threading.current_thread().name)
                raise RuntimeError("a bug in a completion")
            return real(self, wc)

        monkeypatch.setattr(Engine, "_on_wc", broken)
        monkeypatch.setattr(engine, "_turn_lock", _PatientLock(engine._turn_lock, engine))
        fut = tx.send(rx.address, b"z" * 1000)  # its verdict comes back as a control frame: a receive at tx
        with pytest.raises(E.PeerUnreachable, match="a bug in a completion"):
            fut.result(20)
        assert nic_calls, "the failure did not come from a NIC thread"
