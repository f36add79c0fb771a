"""transfer.group_sges: a chunk's SGEs cut into WRs of at most max_sge, at integrity block boundaries where
it takes more than one WR, covering exactly the same bytes in the same order."""
from __future__ import annotations

import random

import pytest

import easypyverbs as ev
from fate_rdma.channel.transfer import group_sges

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
    sges = [ev.SGE(mr, 0, 10 * B)] + [ev.SGE(_MR(i), 0, 10) for i in range(1, 4)]
    groups = group_sges(sges, 2, 0, B)
    assert groups[0] == [ev.SGE(mr, 0, 10 * B)]  # one WR; the rest starts inside block 10
    assert _bytes_of([s for g in groups for s in g]) == _bytes_of(sges)


def test_without_blocks_it_cuts_by_count_and_an_empty_list_is_one_empty_wr():
    sges = [ev.SGE(_MR(i), 0, 10) for i in range(5)]
    assert group_sges(sges, 2) == [sges[:2], sges[2:4], sges[4:]]
    assert group_sges([], 8, 0, B) == [[]]
    with pytest.raises(ValueError):
        group_sges(sges, 0, 0, B)
