"""A connection's work completions: its WRITEs' and control SENDs' (the send side), the receives of the
peer's control frames and of its WRITE_WITH_IMM notices (the receive side). Called with the connection's
turn lock held (connection.py)."""
from __future__ import annotations

from typing import Any

import easypyverbs as ev

from .. import protocol as P
from ..errors import PeerUnreachable, RemoteProtocolError
from ..protocol.policy import Mode
from .control import dispatch
from .fedrdma import STAGING_BIT
from .outgoing import Wr

RECV_TAG = 1 << 62  # wr_id bit of posted receives; wr_ids of sends count up from 1


def on_wc(conn: Any, wc: ev.WC) -> None:
    if wc.wr_id & RECV_TAG:
        _on_recv(conn, wc)
        return
    entry = conn._wrs.pop(wc.wr_id, None)
    if not wc.ok:
        raise PeerUnreachable(f"connection to {conn.peer} failed: work completion {wc.status.name}{_why(wc)}")
    if entry is None:
        return
    kind, o, seq, extra = entry
    if kind is Wr.CTRL:
        conn.control.on_complete(extra)
        return
    if kind is Wr.HEADER:
        conn.mem.hdr_free.append(extra)
    o.pending_wrs -= 1
    if o.error is not None:
        conn._maybe_finish_failed(o)
    elif o.mode is Mode.FEDRDMA_E:
        conn.slot_sender.on_write_complete(o, seq)


def _why(wc: ev.WC) -> str:
    return f" ({wc.reason})" if getattr(wc, "reason", "") else ""


def _on_recv(conn: Any, wc: ev.WC) -> None:
    qp_idx, k = (wc.wr_id >> 20) & 0xFF, wc.wr_id & 0xFFFFF
    if not wc.ok:
        raise PeerUnreachable(f"connection to {conn.peer} failed: receive completed with {wc.status.name}{_why(wc)}")
    if wc.opcode == ev.WCOpcode.RECV_RDMA_WITH_IMM:
        imm = wc.imm_data or 0
        conn._post_recv(qp_idx, k)
        if imm & STAGING_BIT:
            if conn.staged_receiver is None:
                raise RemoteProtocolError(f"{conn.peer} wrote a FedRDMA chunk; this side offered no staging buffers")
            conn.staged_receiver.on_chunk(imm & ~STAGING_BIT)
        else:
            if conn.slot_receiver is None:
                raise RemoteProtocolError(f"{conn.peer} wrote a FedRDMA-E slot; this side offered no receive pool")
            conn.slot_receiver.on_write_imm(imm)
        return
    raw = conn.mem.received(qp_idx, k, wc.byte_len)
    conn._post_recv(qp_idx, k)
    dispatch(conn, P.decode_ctrl(raw), conn._active)
