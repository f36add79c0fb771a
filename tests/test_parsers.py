"""Every parser of a peer's bytes raises only the package's own errors, whatever arrives: random and
adversarial input (non-ASCII, lone surrogates, JSON nested 100000 deep, truncated and forged frames,
pickles of the wrong types) fuzzed with hypothesis (STYLE.md §7)."""
from __future__ import annotations

import io
import json
import pickle
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import easypyverbs as ev

from .test_bootstrap import _pair
from easypyverbs import bootstrap
from fate_rdma import errors as E
from fate_rdma.channel import auth
from fate_rdma.federation import frames
from fate_rdma.grpc_compat.router import decode_md, encode_md

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: any text JSON can carry, lone surrogates ("\ud800") included
any_text = st.text(st.characters(exclude_categories=()), max_size=80)
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | any_text,
                           lambda kids: st.lists(kids, max_size=3) | st.dictionaries(any_text, kids, max_size=3),
                           max_leaves=12)
DEEP = [b"[" * 100_000, b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
        b'{"x": ' + b"[" * 60 + b"]" * 60 + b"}"]


def nesting(v):
    if isinstance(v, (list, dict)):
        kids = v.values() if isinstance(v, dict) else v
        return 1 + max((nesting(k) for k in kids), default=0)
    return 0


# -- JSON (the bootstrap's messages; the channel's metadata and FATE descriptors use the same reader) ----
@FUZZ
@given(json_values)
def test_json_depth_is_exact_on_json(v):
    text = json.dumps(v, ensure_ascii=False)
    assert bootstrap.json_depth(text, 64) == nesting(v)


@FUZZ
@given(st.binary(max_size=300) | st.sampled_from(DEEP) | json_values.map(lambda v: json.dumps(v).encode())
       | any_text.map(lambda t: t.encode("utf-8", "surrogatepass")))
@example(b"\xff\xfe{}")
@example('{"k": "\u00e9\u4e2d"}'.encode())
def test_loads_object_raises_only_value_error(body):
    try:
        got = bootstrap.loads_object(body)
    except ValueError as exc:
        assert str(exc)
    else:
        assert isinstance(got, dict) and nesting(got) <= bootstrap.MAX_JSON_DEPTH


@pytest.mark.parametrize("body,match", [
    (b"[" * 100_000, "nested deeper than 32"),
    (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nested deeper than 32"),
    (b'{"a": "\xff"}', "not UTF-8"),
    (b'"just a string"', "JSON str, expected an object"),
])
def test_bootstrap_refuses_bad_json_with_a_bootstrap_error(body, match):
    a, b = _pair()
    with a, b:
        t = threading.Thread(target=lambda: a.sock.sendall(bootstrap.HEADER.pack(b"EPVB", 1, 1, 0, len(body)) + body))
        t.start()
        with pytest.raises(ev.BootstrapError, match=match):
            b.recv(5)
        t.join()


def test_bootstrap_still_takes_nested_messages():
    a, b = _pair()
    with a, b:
        msg = {"qp": {"mrs": [{"addr": 1, "rkey": 2, "tags": [[["x"]]]}]}, "s": "[[[[{{{{\"", "n": "\u4e2d"}
        a.send(msg, 5)
        assert b.recv(5) == msg


# -- authentication ---------------------------------------------------------------------------------
class ScriptedBoot:
    """A BootstrapConn whose peer says what the test scripts."""

    peer = ("10.0.0.9", 4000)

    def __init__(self, opening, *replies):
        self.opening, self.replies, self.sent = opening, list(replies), []

    def exchange(self, obj, timeout_s):
        self.sent.append(obj)
        return self.opening

    def send(self, obj, timeout_s):
        self.sent.append(obj)

    def recv(self, timeout_s):
        return self.replies.pop(0)


OPENING = {"auth": "hmac-sha256", "v": 1, "name": "host:10000", "nonce": "ab" * auth.NONCE_BYTES}
SECRET = b"s" * 32


@FUZZ
@given(st.one_of(any_text, json_values), st.booleans())
@example("\u00e9" * 64, True)
@example("\u00e9" * 64, False)
@example("\ud800", True)
def test_any_proof_is_an_authentication_error(proof, dialer):
    with pytest.raises(E.AuthenticationError, match="failed to prove"):
        auth.authenticate(ScriptedBoot(OPENING, {"proof": proof}), "guest:9999", SECRET, dialer, 1.0)


@FUZZ
@given(st.dictionaries(st.sampled_from(["auth", "v", "name", "nonce", "x"]),
                       st.one_of(json_values, any_text), max_size=5), st.booleans())
@example({"auth": "none", "v": 1, "name": "\ud800", "nonce": "ab" * 32}, False)
@example({"auth": "hmac-sha256", "v": 1, "name": "\udfff x", "nonce": "ab" * 32}, True)
@example({"auth": "hmac-sha256", "v": 1, "name": "n", "nonce": "\u00e9" * 64}, True)
def test_any_opening_is_a_protocol_error(opening, dialer):
    """The whole exchange, not only `_first`: a name must also survive the transcript's UTF-8."""
    try:
        auth.authenticate(ScriptedBoot(opening, {"proof": "00" * 32}), "guest:9999", SECRET, dialer, 1.0)
    except E.RemoteProtocolError as exc:
        assert str(exc)


# -- the gRPC facade's metadata ------------------------------------------------------------------------
@FUZZ
@given(st.one_of(json_values, st.lists(st.lists(json_values, max_size=3), max_size=4),
                 st.lists(st.tuples(any_text, st.dictionaries(st.just("b64"), json_values, max_size=1)).map(list),
                          max_size=3)))
def test_grpc_metadata_only_protocol_errors_escape(md):
    try:
        decode_md(md)
    except E.RemoteProtocolError:
        pass


def test_grpc_metadata_round_trips():
    md = (("k", "v"), ("x-bin", b"\x00\xff"))
    assert decode_md(json.loads(json.dumps(encode_md(md)))) == md


# -- FATE descriptors (wrapper) --------------------------------------------------------------------------
@pytest.mark.parametrize("raw", [b"[" * 100_000, b"\xff\xfe", b"[1, 2]", b'{"id": 1}', b'{"id": 1, "length": "x"}'])
def test_malformed_descriptor_is_an_integrity_error(raw):
    from fate_rdma.federation.wrapper import RdmaFederation

    with pytest.raises(E.IntegrityError, match="malformed descriptor"):
        RdmaFederation._resolve(None, raw, ("guest", "9999"), "w")  # (it fails before it looks at its object)


# -- array frames ----------------------------------------------------------------------------------------
class AllowNothing(pickle.Unpickler):
    """Stands in for FATE's TableRemotePersistentUnpickler: its allow-list refuses a class with ValueError."""

    def __init__(self, f):
        super().__init__(f)

    def find_class(self, module, name):
        raise ValueError(f"Deserialization is restricted for class `{module}`.`{name}`")


def wire_of(value):
    out = frames.encode(value, 0)
    return bytes(b"".join(bytes(memoryview(b).cast("B")) for b in out.buffers))


GOOD = wire_of([np.arange(12, dtype="<f8").reshape(3, 4), {"b": np.ones(5, dtype=np.int16)}, "tag"])


def decode(wire):
    return frames.decode(frames.InFrame(memoryview(bytearray(wire))), AllowNothing)


def forged(header: bytes, arrays: bytes = bytes(64), count: int = 1) -> bytes:
    """A frame around `header` (a structure pickle), `arrays` and an offsets table of `count` entries."""
    head = frames._HDR.pack(frames.MAGIC, len(header)) + header
    head += bytes(frames._pad(len(head)))
    offsets = np.full(count, len(head), dtype="<u8").tobytes()
    return head + arrays + offsets + count.to_bytes(8, "little")


class PidPickler(pickle.Pickler):
    """Pickles `Ref(x)` as the persistent id `x`: frames whose array references hold anything."""

    def persistent_id(self, obj):
        return obj.pid if isinstance(obj, Ref) else None


class Ref:
    def __init__(self, pid):
        self.pid = pid


def pickled(value) -> bytes:
    f = io.BytesIO()
    PidPickler(f, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return f.getvalue()


def only_frame_errors(wire):
    try:
        decode(wire)
    except E.IntegrityError as exc:
        assert str(exc)


@FUZZ
@given(st.binary(max_size=400))
def test_random_bytes_after_the_magic(tail):
    only_frame_errors(frames.MAGIC + tail)


@FUZZ
@given(st.integers(0, len(GOOD)), st.integers(0, len(GOOD) - 1), st.integers(1, 255))
@example(0, 85, 69)  # (a flipped byte made the dtype '<f8' a numpy comma string, '<f8,2': SyntaxError escaped)
def test_truncated_or_flipped_frames(cut, at, xor):
    only_frame_errors(GOOD[:cut])
    bad = bytearray(GOOD)
    bad[at] ^= xor
    only_frame_errors(bytes(bad))


pid_parts = st.one_of(st.integers(-2, 3), st.sampled_from(["<f8", "|b1", ">i4", "<c16", "|O", "<M8", "<U4"]),
                      st.tuples(st.integers(-1, 1 << 64), st.integers(0, 4)), any_text,
                      st.lists(st.integers(0, 4), max_size=3), st.sampled_from(["np", "torch:float32",
                                                                                 "torch:bfloat16", "torch:uint16"]))


@FUZZ
@given(st.one_of(json_values, st.tuples(st.just("fate-rdma/array"), pid_parts, pid_parts, pid_parts, pid_parts),
                 st.lists(pid_parts, max_size=6).map(tuple)),
       st.one_of(json_values, st.just(0)), st.integers(0, 3))
@example(("fate-rdma/array", 0, "<f8", (0,) * 40, "np"), 0, 1)
@example(("fate-rdma/array", 0, "<f8", (0, 1 << 70), "np"), 0, 1)
@example(("fate-rdma/array", 0, "<f8", (2,), "torch:bfloat16"), 0, 1)
@example(("fate-rdma/array", 0, ">f8", (2,), "torch:float64"), 0, 1)
@example(("fate-rdma/array", 0, "<u4", (2,), "torch:uint32"), 0, 1)
@example(("fate-rdma/array",), 0, 1)
def test_forged_array_references_of_any_type(pid, around, count):
    only_frame_errors(forged(pickled([around, Ref(pid)]), count=count))


@pytest.mark.parametrize("header,match", [
    (pickle.dumps([1, 2])[:-1], "exhausted before seeing STOP"),  # no STOP
    (b"\x80\x05\x95" + (1 << 40).to_bytes(8, "little"), "exhausted"),  # a pickle frame far larger than the header
    (b"\x80\x04\x8e" + (1 << 62).to_bytes(8, "little"), "4611686018427387904 bytes in a bytes8"),  # BINBYTES8: 4 EiB
    (b"\x80\x04\x96" + (1 << 33).to_bytes(8, "little") + b".", "8589934592 bytes in a bytearray8"),  # 8 GiB claimed
    # LONG_BINPUT: the C unpickler grows (and zeroes) its memo to the index: 2**31 would be 32 GiB, 2**30 16 GiB
    (b"\x80\x04N" + b"r" + (1 << 31).to_bytes(4, "little") + b".", "LONG_BINPUT at 3 names memo index 2147483648"),
    (b"\x80\x04N" + b"p1073741824\n.", "PUT at 3 names memo index 1073741824"),
    (pickle.dumps(print), "restricted"),  # a global the allow-list refuses
    (pickle.dumps(np.zeros(2)), "restricted"),  # numpy's own ndarray reduce: refused here too
    (b"\x80\x04K\x01K\x01\x85R.", "not callable"),  # REDUCE on an int
    (b"\x80\x04h\x05.", "Memo value not found"),  # a memo key never stored
    (b"\x80\x04\x8c\x03\xff\xfe\xfd.", "UnicodeDecodeError"),  # SHORT_BINUNICODE that is not UTF-8
    (b"\x80\x04Q.", "underflow"),  # BINPERSID with an empty stack
    (b".", "underflow"),
    (b"", "exhausted before seeing STOP"),
])
def test_adversarial_structure_pickles(header, match):
    with pytest.raises(E.IntegrityError, match=match):
        decode(forged(header))


def test_a_frame_from_a_peer_without_torch_or_with_a_wrong_kind_names_it():
    with pytest.raises(E.IntegrityError, match="bfloat16 tensor of dtype float64"):
        decode(forged(pickled([Ref(("fate-rdma/array", 0, "<f8", (2,), "torch:bfloat16"))])))
