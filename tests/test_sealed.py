"""Everything after the proof is authenticated: on a connection with a session key (a secret, or TLS) the
control frames are sealed with their number (protocol/frames.py), so one that is altered, forged,
replayed or sent unsealed on the way fails the connection on the side that reads it, naming it, and a
transfer it concerned is not reported done. Endpoints of this process on the soft provider; the frames
are put on the wire below the channel's ControlSender, as a relay in the data path would."""
from __future__ import annotations

import os
import time

import pytest

from fate_rdma import protocol as P
from fate_rdma.channel import Endpoint
from fate_rdma.channel.auth import write_secret
from fate_rdma.config import ChannelConfig


@pytest.fixture
def pair(tmp_path):
    write_secret(str(tmp_path / "s"))
    cfg = ChannelConfig(provider="soft", secret_file=str(tmp_path / "s"), chunk_bytes=64 << 10, connect_timeout_s=5,
                        no_progress_timeout_s=10)
    with Endpoint(cfg, name="a") as a, Endpoint(cfg) as b:
        a.send(b.address, os.urandom(1000)).result(10)  # (connected, one transfer through)
        b.recv(10).release()
        deadline = time.monotonic() + 10  # (b files its end after the connection's first message may be delivered)
        while not b._conns:
            assert time.monotonic() < deadline, "b never filed its end of the connection"
            time.sleep(0.01)
        yield a, b, a.connect(b.address)


def _dead(conn, timeout_s: float = 10.0) -> BaseException:
    deadline = time.monotonic() + timeout_s
    while conn.dead is None:
        assert time.monotonic() < deadline, "the connection is still up"
        time.sleep(0.02)
    return conn.dead


def _flip_last(frame: bytes) -> bytes:
    return frame[:-1] + bytes([frame[-1] ^ 1])


def _raw_frame(conn, frame: bytes) -> None:
    """`frame` on the control QP as it is, below the sealing (what a relay on the data path injects)."""
    conn.engine.wire.control._send_raw(frame)


@pytest.mark.parametrize("kind", list(P.CtrlKind), ids=lambda k: k.name)
@pytest.mark.parametrize("attack", ["unsealed", "replayed", "altered", "other direction's key", "one dropped before"])
def test_a_control_frame_not_sealed_in_its_place_fails_the_connection(pair, attack, kind):
    """Each kind of control frame, forged unsealed, replayed, altered, sealed with the other direction's key or
    arriving after one was dropped, fails the connection at the reader naming the MAC."""
    a, b, conn = pair
    (victim,) = b._conns.values()  # (b's end of the connection)
    sender = conn.engine.wire.control
    assert conn.engine.wire._ctrl_key and sender._key  # (a secret: both directions sealed)
    ctrl = P.Ctrl(kind, 12345, reason="forged" if kind is P.CtrlKind.ERROR else "")
    with conn.engine._turn_lock:  # (the engine sends nothing meanwhile: `_number` is the next frame's)
        n = sender._number
        frame = {"unsealed": lambda: P.encode_ctrl(ctrl),
                 "replayed": lambda: P.encode_ctrl(ctrl, sender._key, 0),  # number 0 was used at connect (PROBE)
                 "altered": lambda: _flip_last(P.encode_ctrl(ctrl, sender._key, n)),
                 "other direction's key": lambda: P.encode_ctrl(ctrl, conn.engine.wire._ctrl_key, n),
                 "one dropped before": lambda: P.encode_ctrl(ctrl, sender._key, n + 1),
                 }[attack]()
        _raw_frame(conn, frame)
    why = str(_dead(victim))
    assert "control frame" in why and ("MAC" in why), why


def test_sealed_control_frames_carry_a_real_exchange(pair):
    """Many transfers both ways: every control frame (PROBE, CREDIT, DONE, GROW, ...) is sealed and opened in
    order on both sides; nothing is refused."""
    a, b, conn = pair
    for n in (1, 70_000, 300_000):
        data = os.urandom(n)
        a.send(b.address, data).result(10)
        msg = b.recv(10)
        assert bytes(msg.view) == data
        msg.release()
    assert conn.dead is None and conn.engine.wire.control._number > 3
