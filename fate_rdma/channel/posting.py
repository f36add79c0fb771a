"""How a chunk becomes WRITE work requests: the QP capabilities of the channel's data QPs (as many send SGEs
as the device takes, up to MAX_SEND_SGE, found once per endpoint by creating a QP), a chunk's SGEs cut into
WRs (at integrity block boundaries where the receiver digests WRITEs as they land), and their posting."""
from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional

import easypyverbs as ev
from easypyverbs.capabilities import LeavingWrites

from ..protocol.integrity import BLOCK_BYTES
from .layout import RECV_DEPTH

log = logging.getLogger("fate_rdma.channel")

#: SGEs a data WRITE may gather, where the device takes a QP of that many (send_sge_limit; the soft provider
#: reports 32, rxe's limit is 32; an mlx5 reports 30 but may refuse an RC QP of 30, then 16 or 8 are tried)
MAX_SEND_SGE = 30


def connection_path(rcs: List[ev.RCConnection]) -> ev.DataPath:
    """How the data QPs `rcs` (a connection's, connected) move payloads, as their provider reports it: their common
    kind; where they differ (a QP that could not take the same-host path), the kind of one whose payloads cross a
    wire, which the others wait for."""
    kinds = {rc.qp.path_kind for rc in rcs}
    if len(kinds) == 1:
        return kinds.pop()
    crossing = [k for k in kinds if not k.same_host]
    return crossing[0] if crossing else ev.DataPath.RDMA


def data_qp_cap(max_send_sge: int) -> ev.QPCap:
    """The capabilities of the channel's data QPs."""
    return ev.QPCap(max_send_wr=1024, max_recv_wr=RECV_DEPTH, max_send_sge=max_send_sge, max_recv_sge=1)


def send_sge_limit(ctx: ev.Context, pd: ev.PD, cq: ev.CQ, name: str) -> int:
    """The SGEs one data WRITE may gather on `ctx`: MAX_SEND_SGE, or fewer where the device reports fewer
    (`max_sge`) or refuses a QP with that many (a device's max_sge is the most a WR may have; a NIC may still
    refuse an RC QP of that many once its WQE's other segments are counted, as an mlx5 with small send WQEs
    does). Found by creating a QP: 30, 16, then 8 SGEs (the limit of earlier releases); the error of the last
    try is raised. `name`: the endpoint, for the log."""
    most = max(1, min(MAX_SEND_SGE, ctx.query().max_sge))
    tries = sorted({most, min(most, 16), min(most, 8)}, reverse=True)
    for n, fewer in zip(tries, tries[1:]):
        try:
            pd.create_qp(cq, cap=data_qp_cap(n)).close()
            return n
        except ev.EasyVerbsError as exc:
            log.info("fate-rdma endpoint %s: %s refuses a QP of %d send SGEs (%s); trying %d", name, ctx.label, n, exc, fewer)
    pd.create_qp(cq, cap=data_qp_cap(tries[-1])).close()  # (its error is raised)
    return tries[-1]


def post_chunk(qp: ev.QP, sges: List[ev.SGE], offset: int, in_place: bool, remote: ev.RemoteMR, roff: int,
               signal: Optional[Callable[[], int]], leave_at: Optional[Callable[[int], Any]] = None) -> None:
    """WRITE `sges` (a chunk at payload offset `offset`) to `remote` at `roff`, in WRs of at most the QP's
    max_send_sge SGEs (group_sges); `in_place` (into a FedRDMA-E slot, the payload's final place) on a provider
    that digests WRITEs as they land: cut at integrity blocks (elsewhere cuts would only add WRs). With
    `signal`, the last WR is signaled with the wr_id it returns (called only if a WR is posted). `leave_at(pos)`:
    the on_leave hook (capabilities.LeavingWrites) for a WR whose first byte is payload byte `pos` (leaving.py),
    on a QP that takes one."""
    cut_at = BLOCK_BYTES if in_place and qp.ctx.tracks_writes else 0
    groups = group_sges(sges, qp.cap.max_send_sge, offset, cut_at)
    pos = offset
    for i, g in enumerate(groups):
        if not g:
            continue
        last = signal is not None and i == len(groups) - 1
        wr_id = signal() if signal is not None and last else 0
        if leave_at is not None and isinstance(qp, LeavingWrites):
            qp.post_write(g, remote, remote_offset=roff, wr_id=wr_id, signaled=last, on_leave=leave_at(pos))
        else:
            qp.post_write(g, remote, remote_offset=roff, wr_id=wr_id, signaled=last)
        n = sum(s.length for s in g)
        roff += n
        pos += n


def group_sges(sges: List[ev.SGE], max_sge: int, offset: int = 0, block_bytes: int = 0) -> List[List[ev.SGE]]:
    """Split an SGE list into WRs of at most `max_sge` elements, in order, covering the same bytes.

    `block_bytes` (the integrity blocks of the payload; `offset`: the payload offset of the first SGE): where
    the list needs more than one WR, cut the WRs at block boundaries, splitting an SGE there if need be, so
    that each block is placed by one WRITE and the receiver can take its digest where it landed (a block two
    WRITEs share is read again from memory). A block of more than `max_sge` pieces still takes several."""
    if max_sge < 1:
        raise ValueError(f"max_sge must be >= 1, got {max_sge}")
    if len(sges) <= max_sge or block_bytes <= 0:
        return [sges[i:i + max_sge] for i in range(0, len(sges), max_sge)] or [[]]
    out: List[List[ev.SGE]] = []
    cur: List[ev.SGE] = []
    block: List[ev.SGE] = []  # the pieces of the block being gathered
    pos = offset

    def add_block() -> None:
        nonlocal cur
        if not block:
            return
        # the block's first piece continues cur's last SGE (an SGE split at the boundary): they join again
        joins = bool(cur) and cur[-1].mr is block[0].mr and cur[-1].offset + cur[-1].length == block[0].offset
        if len(cur) + len(block) - joins <= max_sge or len(block) > max_sge:
            # it fits; or it has more pieces than one WR takes, so WRs share it anyway: fill the current one
            rest = block[1:] if joins else list(block)
            if joins:
                cur[-1] = ev.SGE(cur[-1].mr, cur[-1].offset, cur[-1].length + block[0].length)
            while rest:
                if len(cur) == max_sge:
                    out.append(cur)
                    cur = []
                room = max_sge - len(cur)
                cur.extend(rest[:room])
                rest = rest[room:]
        else:
            if cur:
                out.append(cur)
            cur = list(block)
        block.clear()

    for s in sges:
        at, left = s.offset, s.length
        while left > 0:
            n = min(left, block_bytes - pos % block_bytes)
            block.append(ev.SGE(s.mr, at, n))
            at, left, pos = at + n, left - n, pos + n
            if pos % block_bytes == 0:
                add_block()
    add_block()
    if cur:
        out.append(cur)
    return out or [[]]

