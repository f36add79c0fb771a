"""The connection handshake: the hello each side sends, validated field by field."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fate_rdma import errors as E
from fate_rdma.protocol.hello import Hello, PoolOffer, StagingOffer, agree_terms

GOOD = {"fate_rdma": 1, "name": "host:10000", "qps": 2,
        "pool": {"slots": 2, "slot_payload_bytes": 1 << 20, "meta_cap": 65536},
        "staging": {"count": 8, "buf_bytes": (1 << 20) + 64 + 65536, "meta_cap": 65536}}


def with_field(path, value):
    obj = {k: (dict(v) if isinstance(v, dict) else v) for k, v in GOOD.items()}
    *parents, key = path
    d = obj
    for p in parents:
        d = d[p]
    if value is KeyError:
        del d[key]
    else:
        d[key] = value
    return obj


def test_round_trip():
    h = Hello.from_wire(GOOD, "peer")
    assert h == Hello("host:10000", 2, PoolOffer(2, 1 << 20, 65536), StagingOffer(8, (1 << 20) + 64 + 65536, 65536))
    assert Hello.from_wire(h.to_wire(), "peer") == h
    assert Hello.from_wire(dict(GOOD, pool=None, staging=None), "peer").pool is None


def test_terms_both_sides_announce_must_match():
    peer = Hello.from_wire(dict(GOOD, terms={"descriptors": "fate"}), "peer")
    assert peer.terms == {"descriptors": "fate"} and Hello.from_wire(peer.to_wire(), "peer") == peer
    agree_terms({"descriptors": "fate"}, peer)
    agree_terms(None, peer)  # this side has no say
    agree_terms({"descriptors": "channel"}, Hello.from_wire(GOOD, "peer"))  # a peer that predates terms
    agree_terms({"other": "x"}, peer)  # a key only one side announces
    with pytest.raises(E.ConfigError, match="host:10000 uses descriptors: fate and this side descriptors: channel"):
        agree_terms({"descriptors": "channel"}, peer)


def test_offsets():
    p = PoolOffer(3, 1000, 100)
    assert p.slot_bytes == 64 + 100 + 1000
    assert p.slot_base(2) == 2 * p.slot_bytes and p.payload_offset(2, 5) == 2 * p.slot_bytes + 164 + 5
    s = StagingOffer(4, 64 + 10 + 500, 10)
    assert s.base(3) == 3 * 574 and s.data_offset(3) == 3 * 574 + 74 and s.chunk_capacity == 500


@pytest.mark.parametrize("path,value,names", [
    (("fate_rdma",), 2, "fate_rdma"),
    (("fate_rdma",), True, "fate_rdma"),
    (("fate_rdma",), KeyError, "fate_rdma"),
    (("name",), 5, "name"),
    (("name",), "", "name"),
    (("name",), "x" * 300, "name"),
    (("qps",), 0, "qps"),
    (("qps",), "2", "qps"),
    (("qps",), 10 ** 6, "qps"),
    (("qps",), KeyError, "qps"),
    (("pool",), [1], "pool"),
    (("pool", "slots"), 0, "slots"),
    (("pool", "slots"), "2", "slots"),
    (("pool", "slots"), True, "slots"),
    (("pool", "slot_payload_bytes"), -1, "slot_payload_bytes"),
    (("pool", "slot_payload_bytes"), 1 << 60, "slot_payload_bytes"),
    (("pool", "meta_cap"), 1 << 20, "meta_cap"),
    (("staging", "count"), -3, "count"),
    (("staging", "count"), KeyError, "count"),
    (("staging", "buf_bytes"), 10, "buf_bytes"),
    (("staging", "meta_cap"), None, "meta_cap"),
    (("terms",), ["descriptors"], "terms"),
    (("terms",), {"descriptors": 1}, "terms"),
    (("terms",), {"x" * 65: "y"}, "terms"),
    (("terms",), {str(i): "v" for i in range(9)}, "terms"),
])
def test_every_malformed_field_is_a_protocol_error_naming_it(path, value, names):
    with pytest.raises(E.RemoteProtocolError, match=names):
        Hello.from_wire(with_field(path, value), "10.0.0.1:5")


def test_not_an_object():
    for obj in (None, [], "hello", 1):
        with pytest.raises(E.RemoteProtocolError, match="not"):
            Hello.from_wire(obj, "peer")


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
                           max_leaves=10)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(GOOD) + ["x"]), json_values, max_size=6))
def test_fuzz_only_protocol_errors_escape(obj):
    try:
        Hello.from_wire(obj, "peer")
    except E.RemoteProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["auth", "v", "name", "nonce", "x"]), json_values, max_size=5))
def test_fuzz_auth_opening_only_protocol_errors_escape(obj):
    from fate_rdma.channel.auth import _first

    try:
        _first(obj, "peer")
    except E.RemoteProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["provider", "qpn", "psn", "gid", "lid", "mtu", "max_msg_bytes", "token",
                                        "addr", "rkey", "length"]), json_values, max_size=9))
def test_fuzz_qp_and_mr_descriptors_only_bootstrap_errors_escape(obj):
    import easypyverbs as ev

    for cls in (ev.QPInfo, ev.RemoteMR):
        try:
            cls.from_dict(obj)
        except ev.BootstrapError:
            pass
