"""Buffered puts of the same arrays again share one copy (fate_rdma/federation/shared_puts.py): only while
the copy is held, only when every XXH3 leaf of the arrays now equals the copy's, and the copy's room is
given back by its last user."""
from __future__ import annotations

import numpy as np
import pytest

from fate_rdma.channel.checksum import block_digest
from fate_rdma.channel.transfer import Fill
from fate_rdma.federation.shared_puts import SharedCopies
from fate_rdma.protocol.integrity import BLOCK_BYTES


def copied(bufs, kind="xxh3"):
    """What a buffered put does: a copy of `bufs` and its finished Fill (digests taken while copying)."""
    total = sum(memoryview(b).nbytes for b in bufs)
    dest = np.empty(total, np.uint8)
    fill = Fill(total, block_digest(kind))
    fill.run(dest, bufs, BLOCK_BYTES)
    return dest, fill


def frame_like(rng):
    """An array frame's buffers: a header pickle (bytes, made anew by each put), arrays, padding."""
    return [b"header-pickle", rng.standard_normal(700_000), bytes(8), rng.standard_normal(300_000), b"index"]


def held_copy(seed):
    """A frame's buffers, their complete copy, and a SharedCopies holding it (and the rooms it freed)."""
    bufs = frame_like(np.random.default_rng(seed))
    copy, fill = copied(bufs)
    freed = []
    s = SharedCopies(freed.append)
    s.hold(bufs, copy, fill)
    s.ready(copy)
    return bufs, copy, s, freed


def test_the_same_arrays_share_the_held_copy_and_its_last_user_frees_the_room():
    rng = np.random.default_rng(1)
    bufs = frame_like(rng)  # 8 MB: two 4 MiB blocks and a part
    copy, fill = copied(bufs)
    freed = []
    s = SharedCopies(freed.append)
    s.hold(bufs, copy, fill)
    assert s.share(bufs) is None  # not complete yet: nothing to share
    s.ready(copy)
    again = [b"header-pickle"] + bufs[1:]  # a new header object with the same bytes, the same arrays
    got = s.share(again)
    assert got is not None and got[0] is copy and got[1] is fill and s.shared_puts == 1
    assert bytes(memoryview(copy)) == b"".join(bytes(memoryview(b).cast("B")) for b in again)
    assert s.release(copy) is False and freed == []  # the first put is done, the second still sends from it
    assert s.share(bufs) is not None  # a third put finds it through the second
    assert s.release(copy) is False and freed == []
    assert s.release(copy) is False and freed == [copy.nbytes] and s.held() == 0  # the last user: room back once
    assert s.share(bufs) is None  # released: a later put copies anew
    assert s.release(np.empty(1)) is True  # a copy never held here: the caller gives its room back


@pytest.mark.parametrize("where", ["first block", "last byte", "header"])
def test_bytes_changed_after_the_copy_are_never_sent_stale(where):
    bufs, copy, s, freed = held_copy(2)
    if where == "first block":
        bufs[1][10] += 1.0
    elif where == "last byte":
        bufs[3][-1] = -bufs[3][-1] + 1.0
    else:
        bufs[0] = b"header-pickle-2"  # another structure: not even a candidate
    import fate_rdma.federation.shared_puts as sp
    whole = []
    real = sp.xxh3_leaves
    sp.xxh3_leaves = lambda views, first: whole.append(1) or real(views, first)
    try:
        assert s.share(bufs) is None and s.shared_puts == 0 and freed == []  # compared, unpinned, still held
    finally:
        sp.xxh3_leaves = real
    assert whole == ([1] if where == "last byte" else [])  # the rest is read only when the first block matches
    assert s.release(copy) is False and freed == [copy.nbytes]


def test_other_arrays_of_the_same_shape_are_not_candidates():
    bufs, copy, s, freed = held_copy(3)
    same_bytes_elsewhere = [bufs[0], bufs[1].copy(), bufs[2], bufs[3].copy(), bufs[4]]
    assert s.share(same_bytes_elsewhere) is None


@pytest.mark.parametrize("kind", ["crc32c", None])
def test_only_xxh3_copies_are_shared(kind):
    """crc32c's 32 bits cannot vouch for unchanged bytes; blake2b and none take no digests while copying."""
    rng = np.random.default_rng(4)
    bufs = frame_like(rng)
    total = sum(memoryview(b).nbytes for b in bufs)
    copy = np.empty(total, np.uint8)
    fill = Fill(total, block_digest(kind) if kind else None)
    fill.run(copy, bufs, BLOCK_BYTES)
    freed = []
    s = SharedCopies(freed.append)
    s.hold(bufs, copy, fill)
    s.ready(copy)
    assert s.held() == 0 and s.share(bufs) is None and s.release(copy) is True


def test_a_copy_that_failed_is_never_shared():
    rng = np.random.default_rng(5)
    bufs = frame_like(rng)
    total = sum(memoryview(b).nbytes for b in bufs)
    copy = np.empty(total, np.uint8)
    fill = Fill(total, block_digest("xxh3"))
    freed = []
    s = SharedCopies(freed.append)
    s.hold(bufs, copy, fill)
    fill.advance(total - BLOCK_BYTES)
    fill.fail(MemoryError("copy failed"))
    s.ready(copy)
    assert s.share(bufs) is None and s.release(copy) is False and freed == [total]


def test_a_copy_compared_while_its_put_finishes_stays_pinned_and_its_room_goes_back_once():
    """The first put's transfers finish while a new put hashes its arrays: the copy is pinned meanwhile, so a
    match still shares it (and a mismatch lets it go, giving the room back then)."""
    import fate_rdma.federation.shared_puts as sp

    rng = np.random.default_rng(6)
    bufs = frame_like(rng)
    copy, fill = copied(bufs)
    freed = []
    s = SharedCopies(freed.append)
    real = sp.xxh3_leaves

    def leaves_while_the_first_put_ends(views, first):
        assert s.release(copy) is False and freed == []  # the first put's last transfer ends now
        return real(views, first)

    for change, want_shared in ((False, True), (True, False)):
        freed.clear()
        s.hold(bufs, copy, fill)
        s.ready(copy)
        if change:
            bufs[3][0] += 1.0
        sp.xxh3_leaves = leaves_while_the_first_put_ends
        try:
            got = s.share(bufs)
        finally:
            sp.xxh3_leaves = real
        assert (got is not None) is want_shared
        if want_shared:
            assert freed == [] and s.held() == 1
            assert s.release(copy) is False
        assert freed == [copy.nbytes] and s.held() == 0


@pytest.mark.parametrize("arrays", [[300_000], [700_000, 300_000], [700_000, 600_000, 900_000]])
def test_the_leaves_after_the_first_are_the_same_as_all_leaves_read_anew(arrays):
    """share() reads the first block once: xxh3_leaves given its leaf reads only the other blocks (none, for
    a payload of one block, as a LoRA average's) and must still give every leaf as a whole pass would."""
    import fate_rdma.federation.shared_puts as sp
    from fate_rdma.protocol.integrity import blocks, xxh_leaf

    rng = np.random.default_rng(7)
    views = [memoryview(b"hdr")] + [memoryview(rng.standard_normal(n)).cast("B") for n in arrays]
    first = xxh_leaf(0, blocks(views, BLOCK_BYTES, 1)[0])
    assert len(blocks(views, BLOCK_BYTES, 1)) == 1
    assert sp.xxh3_leaves(views, first) == sp.xxh3_leaves(views)
    assert sp.xxh3_leaves(views, b"\0" * len(first))[len(first):] == sp.xxh3_leaves(views)[len(first):]
