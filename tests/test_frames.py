"""Array frames (fate_rdma.federation.frames): objects of containers, scalars, numpy arrays and CPU
torch tensors survive exactly, arrays are views of the received buffer, anything else is refused
(FATE's own path), and damaged frames are clear errors."""
from __future__ import annotations

import pickle
import threading
import time

import numpy as np
import pytest

from fate_rdma.errors import IntegrityError
from fate_rdma.federation import frames


class PlainUnpickler(pickle.Unpickler):
    """Stands in for FATE's TableRemotePersistentUnpickler(ctx, federation, name, tag, party, f)."""

    def __init__(self, ctx, fed, name, tag, party, f):
        super().__init__(f)


def roundtrip(value, min_bytes=0):
    out = frames.encode(value, min_bytes)
    assert out is not None
    wire = bytearray(b"".join(bytes(memoryview(b).cast("B")) for b in out.buffers))
    assert len(wire) == out.nbytes and frames.is_frame(wire)
    return frames.decode(frames.InFrame(memoryview(wire)), PlainUnpickler, None, None, "n", "t", ("guest", "1")), wire


def test_mixed_arrays_roundtrip_bitwise_and_aligned():
    rng = np.random.default_rng(1)
    value = ([(rng.standard_normal((31, 7)), rng.standard_normal(5)) for _ in range(3)], 0.5,
             {"k": np.arange(10, dtype=np.int32), "b": np.array([True, False]), "e": np.empty((0, 3))},
             np.asfortranarray(rng.standard_normal((4, 6))), rng.standard_normal(9)[::2], "tag", None)
    got, wire = roundtrip(value)
    base = np.frombuffer(wire, dtype=np.uint8).ctypes.data
    for (a, b), (c, d) in zip(value[0], got[0]):
        assert a.tobytes() == c.tobytes() and b.tobytes() == d.tobytes() and c.shape == a.shape
        assert (c.ctypes.data - base) % frames.ALIGN == 0
    assert got[1] == 0.5 and got[5:] == ("tag", None)
    for k in ("k", "b", "e"):
        assert got[2][k].dtype == value[2][k].dtype and np.array_equal(got[2][k], value[2][k])
    assert np.array_equal(got[3], value[3]) and np.array_equal(got[4], value[4])


def test_arrays_are_views_of_the_received_buffer():
    got, wire = roundtrip([np.ones(1000)])
    wire[-8 - 8 - 8000:-16] = b"\x00" * 8000  # the array's bytes (before the offsets table) are zeroed
    assert not got[0].any()


def test_torch_tensors_keep_dtype_and_values():
    torch = pytest.importorskip("torch")
    ts = [torch.randn(3, 4), torch.randn(5, dtype=torch.float64), torch.arange(6).reshape(2, 3),
          torch.randn(8).to(torch.bfloat16), torch.randn(4, requires_grad=True)]
    got, _ = roundtrip(ts)
    for a, b in zip(ts, got):
        assert isinstance(b, torch.Tensor) and b.dtype == a.dtype and b.shape == a.shape
        assert torch.equal(a.detach(), b)


def test_small_or_unframable_objects_take_fates_path():
    assert frames.encode([np.ones(10)], min_array_bytes=1 << 20) is None
    assert frames.encode({"x": 1}, 0) is None  # no arrays at all: nothing to gain
    assert frames.encode([np.array([object()], dtype=object)], 0) is None
    assert frames.encode([np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")])], 0) is None


def test_damaged_frames_are_clear_errors():
    _, wire = roundtrip([np.ones(100)])
    with pytest.raises(IntegrityError, match="malformed array frame"):
        frames.decode(frames.InFrame(memoryview(wire[:20])), PlainUnpickler, None, None, "n", "t", None)
    bad = bytearray(wire)
    bad[-8:] = (10**6).to_bytes(8, "little")  # claims a million arrays
    with pytest.raises(IntegrityError, match="malformed array frame"):
        frames.decode(frames.InFrame(memoryview(bad)), PlainUnpickler, None, None, "n", "t", None)
    bad = bytearray(wire)
    bad[-16:-8] = (len(wire)).to_bytes(8, "little")  # the array's offset points past the end
    with pytest.raises(IntegrityError, match="outside"):
        frames.decode(frames.InFrame(memoryview(bad)), PlainUnpickler, None, None, "n", "t", None)


@pytest.mark.parametrize("idx, dtype, shape, kind, error", [
    (0, "|O", (4,), "np", "names dtype '|O', not a dtype's str"),  # an object array: never a frame's
    (0, "|V8", (4,), "np", "names dtype"),
    (0, "not a dtype", (4,), "np", "names dtype 'not a dtype'"),
    (0, ["<f8"], (4,), "np", "names dtype"),  # (unhashable: a dictionary lookup of it raised TypeError)
    (0, "<f8", (-1,), "np", "names shape"),
    (0, "<f8", (4, "4"), "np", "names shape"),
    (0, "<f8", (1 << 62, 1 << 62), "np", "outside"),  # (a product that wraps in int64 must not pass the bound check)
    ("0", "<f8", (4,), "np", "names array '0'"),
    (True, "<f8", (4,), "np", "names array True"),
    (0, "<f8", (4,), "pandas", "of kind 'pandas'"),
])
def test_forged_array_references_are_clear_errors(monkeypatch, idx, dtype, shape, kind, error):
    """A frame's header names each array's index, dtype, shape and kind; a peer's forged ones are refused."""
    real = frames._FramePickler._add

    def forge(self, arr, kind_):
        pid = real(self, arr, kind_)
        return (pid[0], idx, dtype, shape, kind)

    monkeypatch.setattr(frames._FramePickler, "_add", forge)
    out = frames.encode([np.ones(4)], 0)
    wire = bytearray(b"".join(bytes(memoryview(b).cast("B")) for b in out.buffers))
    with pytest.raises(IntegrityError, match=error):
        frames.decode(frames.InFrame(memoryview(wire)), PlainUnpickler, None, None, "n", "t", None)


def test_fates_restricted_unpickler_policy_still_applies():
    pytest.importorskip("fate.arch.federation.api._serdes")
    from fate.arch.federation.api._serdes import TableRemotePersistentUnpickler

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    out = frames.encode([np.ones(10), Evil()], 0)
    wire = memoryview(b"".join(bytes(memoryview(b).cast("B")) for b in out.buffers))

    class Fed:
        local_party = ("guest", "1")

    # FATE's default policy for federation payloads is "restricted": builtins.print is not allowed (FATE's
    # ValueError, as every error of a peer's frame, arrives as fate-rdma's IntegrityError naming it)
    with pytest.raises(IntegrityError, match="restricted"):
        frames.decode(frames.InFrame(wire), TableRemotePersistentUnpickler, None, Fed(), "n", "t", ("host", "2"))
    ok = frames.encode([np.ones(10), {"a": 1.5}], 0)
    wire = memoryview(b"".join(bytes(memoryview(b).cast("B")) for b in ok.buffers))
    got = frames.decode(frames.InFrame(wire), TableRemotePersistentUnpickler, None, Fed(), "n", "t", ("host", "2"))
    assert got[1] == {"a": 1.5} and np.array_equal(got[0], np.ones(10))


def test_recv_buffers_are_reused_only_when_free():
    from fate_rdma.channel.buffers import RecvBuffers

    rb = RecvBuffers(1 << 20)
    a = rb.get(1000)
    held = np.frombuffer(memoryview(a).cast("B"), dtype=np.float64, count=10)
    b = rb.get(1000)
    assert b.ctypes.data != a.ctypes.data  # `a` is still referred to by `held`
    addr = a.ctypes.data
    del a, held, b
    c = rb.get(900)
    assert c.ctypes.data == addr and rb.reused == 1
    big = rb.get(2 << 20)  # above the cache limit: allocated, not kept
    assert big.nbytes == 2 << 20


def test_recv_buffers_unused_for_the_idle_time_are_let_go_of():
    """An idle endpoint holds little: a kept buffer nothing refers to and unused for `idle_s` is let go of; one
    still referred to (a message or an array made from it) or used more recently is kept; idle_s 0 keeps all."""
    from fate_rdma.channel.buffers import RecvBuffers

    rb = RecvBuffers(1 << 30)
    old, kept = rb.get(3000), rb.get(1 << 20)
    old_bytes = rb.held_bytes - (1 << 20)
    del old
    assert rb.trim(60, force=True) == 0 and rb.trim(0, force=True) == 0  # not idle long enough; never
    time.sleep(0.25)
    recent = rb.get(5 << 20)  # handed out just now
    del recent
    assert rb.trim(0.2) == 0  # (at most once every TRIM_EVERY_S: the first trim above counts)
    assert rb.trim(0.2, force=True) == old_bytes  # `kept` is referred to, `recent`'s buffer was used 0 s ago
    assert rb.held_bytes == (1 << 20) + (5 << 20) and rb.trimmed_bytes == old_bytes
    del kept
    time.sleep(0.25)
    assert rb.trim(0.2, force=True) == 6 << 20 and rb.held_bytes == 0
    again = rb.get(3000)  # a new buffer, faulted in afresh
    assert again.nbytes == 3000 and rb.held_bytes >= 3000


def test_message_detach_copies_only_slots():
    from fate_rdma.channel.buffers import RecvBuffers
    from fate_rdma.channel.transfer import Message

    own = np.arange(64, dtype=np.uint8)
    msg = Message("p", 1, {}, memoryview(own).cast("B"), "fedrdma")
    view = msg.detach()
    assert np.frombuffer(view, dtype=np.uint8).ctypes.data == own.ctypes.data  # zero copy
    released = []
    slot = np.arange(64, dtype=np.uint8)
    msg = Message("p", 2, {}, memoryview(slot).cast("B"), "fedrdma-e", lambda: released.append(2), RecvBuffers(1 << 20).get)
    view = msg.detach()
    assert released == [2] and bytes(view) == slot.tobytes()
    slot[:] = 0  # the slot is reused by the sender: the detached payload must not change
    assert bytes(view) == np.arange(64, dtype=np.uint8).tobytes()


def test_message_detach_lends_a_large_slot_until_the_last_view_is_gone():
    from fate_rdma.channel.buffers import RecvBuffers
    from fate_rdma.channel.transfer import LEND_MIN_BYTES, Message

    slot = np.random.default_rng(3).integers(0, 256, LEND_MIN_BYTES + 64, dtype=np.uint8)
    released, asked = [], []

    def lend(answer):
        return lambda: asked.append(answer) or answer

    msg = Message("p", 3, {}, memoryview(slot).cast("B"), "fedrdma-e", lambda: released.append(3),
                  RecvBuffers(1 << 20).get, lend(True))
    view = msg.detach()
    arr = np.frombuffer(view, dtype=np.uint8)
    assert arr.ctypes.data == slot.ctypes.data and asked == [True] and released == [] and msg.lent  # in place, held
    parts = [arr[:10].reshape(2, 5), arr[10:].view(np.uint16)]  # what a frame's decode makes of it
    del view, arr
    assert released == [] and msg.view.nbytes == 0
    del parts[0]
    assert released == []
    parts.clear()  # the last object made from the view: the slot goes back, once
    assert released == [3]
    msg.release()
    assert released == [3]
    # refused (the peer's last circulating slot): copied, and the slot goes back at once
    msg = Message("p", 4, {}, memoryview(slot).cast("B"), "fedrdma-e", lambda: released.append(4),
                  RecvBuffers(1 << 20).get, lend(False))
    view = msg.detach()
    assert released == [3, 4] and asked == [True, False] and not msg.lent
    assert np.frombuffer(view, dtype=np.uint8).ctypes.data != slot.ctypes.data and bytes(view) == slot.tobytes()
    # a release() racing detach() (another thread) waits for it and then has nothing left to release:
    # the slot stays lent until its last view goes, never released under a view the application holds
    racing = []
    msg = Message("p", 6, {}, memoryview(slot).cast("B"), "fedrdma-e", lambda: released.append(6),
                  RecvBuffers(1 << 20).get, lambda: racing.append(threading.Thread(target=msg.release)) or
                  racing[0].start() or time.sleep(0.2) or True)
    view = msg.detach()
    racing[0].join(5)
    assert msg.lent and 6 not in released and np.frombuffer(view, dtype=np.uint8).ctypes.data == slot.ctypes.data
    del view
    assert released[-1] == 6 and released.count(6) == 1
    # below LEND_MIN_BYTES a copy costs little: not even asked
    small = Message("p", 5, {}, memoryview(slot[:100]).cast("B"), "fedrdma-e", lambda: released.append(5),
                    RecvBuffers(1 << 20).get, lend(True))
    assert bytes(small.detach()) == slot[:100].tobytes() and released == [3, 4, 6, 5] and asked == [True, False]


def test_a_decoded_payload_dropped_frees_its_buffer_without_a_garbage_collection():
    """Round after round of FedAvg lands in recycled (faulted-in) buffers only if nothing but the
    application's objects holds a received buffer: decoding once made a class per call whose closure
    kept the whole payload alive until the next cyclic garbage collection."""
    import gc

    from fate_rdma.channel.buffers import RecvBuffers

    out = frames.encode([np.ones(1000), np.arange(7)], 0)
    rb = RecvBuffers(1 << 20)
    buf = rb.get(out.nbytes)
    wire = memoryview(buf).cast("B")
    wire[:] = b"".join(bytes(memoryview(b).cast("B")) for b in out.buffers)
    gc.disable()
    try:
        got = frames.decode(frames.InFrame(wire), PlainUnpickler, None, None, "n", "t", ("guest", "1"))
        assert np.array_equal(got[0], np.ones(1000))
        addr = buf.ctypes.data
        del got, wire, buf
        again = rb.get(out.nbytes)
        assert again.ctypes.data == addr and rb.reused_bytes == out.nbytes and rb.fresh_bytes == out.nbytes
    finally:
        gc.enable()
