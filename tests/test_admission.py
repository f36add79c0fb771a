"""Admission to a listener's handshakes (easypyverbs.admission): strangers share a bounded number of slots, one
address a part of them, and the parties' own addresses have slots of their own that no flood takes."""
from __future__ import annotations

import pytest

from easypyverbs.admission import Admission

PARTY = "198.18.0.2"


def _admission():
    return Admission(strangers=8, per_source=2, known=lambda s: s == PARTY, known_slots=4)


def test_one_source_takes_at_most_its_part_of_the_strangers_slots():
    a = _admission()
    held = [a.admit("198.18.1.1") for _ in range(3)]
    assert held[0] and held[1] and held[2] is None and a.refused_crowded == 1
    assert a.admit("198.18.1.2")  # another source still gets in
    held[0]()
    assert a.admit("198.18.1.1")  # its slot came back


def test_a_flood_from_many_sources_fills_the_strangers_slots_only():
    a = _admission()
    flood = [a.admit(f"198.18.1.{i}") for i in range(1, 9) for _ in range(2)]
    assert sum(1 for d in flood if d) == 8 and a.refused_full == 8
    assert a.admit("198.18.1.99") is None  # a new stranger waits for a slot
    party = [a.admit(PARTY) for _ in range(4)]
    assert all(party) and a.admit(PARTY) is None  # the party's own slots, and their bound
    for d in party + [d for d in flood if d]:
        d()
    assert a.pending == 0


def test_done_counts_once_and_keeps_the_class_it_was_admitted_in():
    known = {PARTY}
    a = Admission(strangers=1, per_source=1, known=known.__contains__, known_slots=1)
    done = a.admit(PARTY)
    known.clear()  # (the party's QP attached meanwhile: the address is no longer awaited)
    done()
    done()
    assert a.pending == 0 and a.admit(PARTY) and a.admit("198.18.1.1") is None


def test_a_lookup_that_fails_counts_as_a_stranger():
    def boom(source):
        raise OSError("resolver down")

    a = Admission(strangers=1, per_source=1, known=boom, known_slots=4)
    assert a.admit(PARTY) and a.admit(PARTY) is None


@pytest.mark.parametrize("kw", [dict(strangers=0, per_source=1), dict(strangers=1, per_source=0),
                                dict(strangers=1, per_source=1, known_slots=-1)])
def test_bounds_are_checked(kw):
    with pytest.raises(ValueError):
        Admission(**kw)


def test_hosts_of_party_names_and_where_a_listener_dials_from():
    from easypyverbs.admission import HostSet, is_loopback
    from easypyverbs.bootstrap import source_address

    hosts = HostSet(["198.18.0.2:9999", "[fd00::1]:10000", "198.18.0.3"])
    assert "198.18.0.2" in hosts and "fd00::1" in hosts and "198.18.0.3" in hosts and "198.18.0.4" not in hosts
    assert is_loopback("localhost") and is_loopback("[::1]") and is_loopback("127.3.0.1")
    assert not is_loopback("localhost.example.org") and not is_loopback("198.18.0.2")
    assert source_address("198.18.0.2") == ("198.18.0.2", 0)
    assert source_address("0.0.0.0") is None and source_address("127.0.0.1") is None
    assert source_address("party.example.org") is None
