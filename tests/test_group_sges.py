"""How a chunk becomes WRITEs: posting.group_sges cuts its SGEs into WRs of at most max_sge, at integrity
block boundaries where it takes more than one WR (only for FedRDMA-E slots on a provider that digests WRITEs
as they land), covering exactly the same bytes in the same order; an endpoint asks for 30 SGEs a WR, fewer
where its device refuses that many."""
from __future__ import annotations

import logging
import random

import numpy as np
import pytest

import easypyverbs as ev
from fate_rdma.channel import Endpoint
from fate_rdma.channel import posting
from fate_rdma.channel.posting import group_sges
from fate_rdma.protocol.integrity import BLOCK_BYTES

from .test_channel import cfg_for

B = 4096  # block size of these tests


def _bytes_of(sges):
    """(mr index, byte offset) for every byte the SGEs name, in order."""
    return [(s.mr.i, s.offset + k) for s in sges for k in range(s.length)]


class _MR:
    def __init__(self, i: int) -> None:
        self.i = i


def _sges(rng: random.Random, n: int):
    mrs = [_MR(i) for i in range(n)]
    return [ev.SGE(mr, rng.randrange(0, 100), rng.choice([1, 7, 300, B - 1, B, B + 5, 3 * B + 17])) for mr in mrs]


@pytest.mark.parametrize("seed", range(40))
def test_groups_cover_the_same_bytes_within_the_limit_cut_at_blocks(seed):
    rng = random.Random(seed)
    sges, max_sge, offset = _sges(rng, rng.randrange(1, 40)), rng.choice([1, 2, 3, 8, 30]), rng.randrange(0, 3 * B)
    groups = group_sges(sges, max_sge, offset, B)
    assert all(1 <= len(g) <= max_sge for g in groups)
    assert _bytes_of([s for g in groups for s in g]) == _bytes_of(sges)
    if len(sges) <= max_sge:
        assert groups == [sges]
        return
    # every WR boundary that is not a block boundary lies inside a block of more pieces than one WR takes
    pieces = {}  # block -> pieces it has (SGEs cut at block boundaries)
    pos = offset
    for s in sges:
        left = s.length
        while left:
            n = min(left, B - pos % B)
            pieces[pos // B] = pieces.get(pos // B, 0) + 1
            pos, left = pos + n, left - n
    pos = offset
    for g in groups[:-1]:
        pos += sum(s.length for s in g)
        assert pos % B == 0 or pieces[pos // B] > max_sge, (pos, pieces[pos // B])


def test_one_large_sge_is_joined_again_after_the_cut():
    mr = _MR(0)
    sges = [ev.SGE(mr, 0, 10 * B)] + [ev.SGE(_MR(i), 0, 10) for i in range(1, 3)]
    groups = group_sges(sges, 2, 0, B)
    assert groups == [[ev.SGE(mr, 0, 10 * B)], sges[1:]]  # block 10's two pieces do not fit beside it
    assert _bytes_of([s for g in groups for s in g]) == _bytes_of(sges)


def test_without_blocks_it_cuts_by_count_and_an_empty_list_is_one_empty_wr():
    sges = [ev.SGE(_MR(i), 0, 10) for i in range(5)]
    assert group_sges(sges, 2) == [sges[:2], sges[2:4], sges[4:]]
    assert group_sges([], 8, 0, B) == [[]]
    with pytest.raises(ValueError):
        group_sges(sges, 0, 0, B)


def test_a_block_of_more_pieces_than_a_wr_takes_fills_the_current_wr_first():
    """Blocks of 31 one-byte-apart pieces with 30 SGEs a WR: WRs share such blocks anyway, so none is cut
    early; as many WRs as a plain count split."""
    sges = [ev.SGE(_MR(i), 0, 1) for i in range(10 * 31)]
    groups = group_sges(sges, 30, 0, 31)
    assert len(groups) == -(-len(sges) // 30) and all(len(g) == 30 for g in groups[:-1])
    assert _bytes_of([s for g in groups for s in g]) == _bytes_of(sges)


def _frame():
    rng = np.random.default_rng(3)
    return [rng.integers(0, 256, int(n), dtype=np.uint8) for n in rng.choice([3000, 200_000, 1_500_000], 60)]


@pytest.mark.parametrize("mode", ["fedrdma-e", "fedrdma"])
def test_wrs_are_cut_at_blocks_only_into_a_fedrdma_e_slot(monkeypatch, mode):
    cuts = []
    real = posting.group_sges
    monkeypatch.setattr(posting, "group_sges", lambda sges, n, off, block: cuts.append(block) or real(sges, n, off, block))
    arrays = _frame()
    with Endpoint(cfg_for(mode, "soft", slot_bytes=64 << 20), name="rx") as rx, \
            Endpoint(cfg_for(mode, "soft"), name="tx") as tx:
        tx.send(rx.address, arrays).result(60)
        with rx.recv(timeout=30) as msg:
            assert bytes(msg.view) == b"".join(a.tobytes() for a in arrays)
    assert cuts and set(cuts) == ({BLOCK_BYTES} if mode == "fedrdma-e" else {0})


def test_a_device_that_refuses_30_sges_gets_fewer(monkeypatch, caplog):
    """A device may report max_sge 30 yet refuse an RC QP of 30 send SGEs (its WQE's other segments
    counted): the endpoint finds what it takes (16 here) once, and the transfer goes in WRs of that many."""
    from easypyverbs.providers.soft.context import _SoftPD

    real = _SoftPD._create_qp
    asked = []

    def picky(self, send_cq, recv_cq, cap):
        asked.append(cap.max_send_sge)
        if cap.max_send_sge > 16:
            raise ev.EasyVerbsError(f"create_qp: EINVAL for max_send_sge {cap.max_send_sge}")
        return real(self, send_cq, recv_cq, cap)

    monkeypatch.setattr(_SoftPD, "_create_qp", picky)
    caplog.set_level(logging.INFO, "fate_rdma.channel")
    arrays = _frame()
    with Endpoint(cfg_for("fedrdma-e", "soft", slot_bytes=64 << 20), name="rx") as rx, \
            Endpoint(cfg_for("fedrdma-e", "soft"), name="tx") as tx:
        tx.send(rx.address, arrays).result(60)
        with rx.recv(timeout=30) as msg:
            assert bytes(msg.view) == b"".join(a.tobytes() for a in arrays)
        assert tx.send_sge_limit(None) == 16 and rx.send_sge_limit(None) == 16
    assert asked.count(30) == 2  # once per endpoint, not per connection
    assert "refuses a QP of 30 send SGEs" in caplog.text
