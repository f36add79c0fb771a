"""A connection's wire: its QPs, their CQ and registered memory as the engine posts on them. Data moves as RDMA
WRITEs in both modes; control frames (ACK, CREDIT, CANCEL, ERROR, PROBE, DONE) travel as SENDs on QP 0. Receive
queues hold small buffers only (control frames and the notices of WRITE_WITH_IMM), so they never stall on a
large SEND. Each signalled send WR is noted here with what it was, so that its completion goes to the right place.

The connection makes the QPs, the CQ and the memory and closes them (connection.py); the engine posts and takes
completions through this (engine.py).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Tuple

import easypyverbs as ev

from .. import protocol as P
from ..errors import RemoteProtocolError
from ..protocol.packing import recv_wr_id
from .control import ControlSender
from .layout import RECV_DEPTH, LocalMemory
from .outgoing import Outgoing, Wr
from .posting import post_chunk

#: what a signalled send WR was: its kind, its transfer (None for a control frame), its chunk, and its buffer
#: (a control frame's or a header's)
WrEntry = Tuple[Wr, Optional[Outgoing], int, int]


class Wire:
    """Posts on a connection's QPs (`rcs`: the connection's list, QP 0 first) and notes its signalled WRs."""

    def __init__(self, cq: ev.CQ, mem: LocalMemory, rcs: List[ev.RCConnection],
                 ctrl_keys: Tuple[bytes, bytes] = (b"", b"")) -> None:
        """`ctrl_keys`: (send, receive) keys of the control frames' MAC (auth.direction_keys "ctrl"), empty
        on a connection without a session key."""
        self.cq, self.mem, self.rcs = cq, mem, rcs
        self._wrs: Dict[int, WrEntry] = {}
        self._wr_seq = 0
        self._rr = 0
        self.control = ControlSender(mem, self.control_qp, lambda idx: self.wr_id(Wr.CTRL, None, 0, idx), ctrl_keys[0])
        self._ctrl_key = ctrl_keys[1]
        self._ctrl_in = 0  # control frames taken from the peer

    def add(self, rc: ev.RCConnection) -> None:
        """`rc` is connected: it is the next QP, and its receive queue is filled."""
        self.rcs.append(rc)
        for k in range(RECV_DEPTH):
            self.post_recv(len(self.rcs) - 1, k)

    def post_recv(self, qp_idx: int, k: int) -> None:
        self.rcs[qp_idx].qp.post_recv(self.mem.recv_sge(qp_idx, k), wr_id=recv_wr_id(qp_idx, k))

    def received(self, qp_idx: int, k: int, nbytes: int) -> P.Ctrl:
        """The control frame that receive buffer `k` of QP `qp_idx` holds, checked (its MAC and number where
        the connection has a session key): the peer sends them on QP 0 only."""
        if qp_idx != 0:
            raise RemoteProtocolError(f"a control frame arrived on QP {qp_idx}; they travel on QP 0 only")
        c = P.decode_ctrl(self.mem.received(qp_idx, k, nbytes), self._ctrl_key, self._ctrl_in)
        self._ctrl_in += 1
        return c

    # -- send WRs ---------------------------------------------------------------------------------
    def wr_id(self, kind: Wr, out: Optional[Outgoing], seq: int, extra: int) -> int:
        """A wr_id for a signalled send WR, noted with what it is (numbered from 1: below packing.RECV_TAG)."""
        self._wr_seq += 1
        self._wrs[self._wr_seq] = (kind, out, seq, extra)
        return self._wr_seq

    def take(self, wr_id: int) -> Optional[WrEntry]:
        """What the completed send WR `wr_id` was (None: not signalled, or taken already)."""
        return self._wrs.pop(wr_id, None)

    def control_qp(self) -> ev.QP:
        return self.rcs[0].qp

    def next_qp(self, active: int) -> ev.QP:
        """The next of the first `active` QPs, round robin."""
        self._rr = (self._rr + 1) % active
        return self.rcs[self._rr].qp

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Every QP's WRs posted inside go in one batch (one write per QP on the soft provider), after the
        control frames held so far."""
        with contextlib.ExitStack() as batches:
            for rc in self.rcs:
                batches.enter_context(rc.qp.batch())
            self.control.flush()
            yield

    def post_data(self, qp: ev.QP, o: Outgoing, c: P.Chunk, remote: ev.RemoteMR, roff: int, signal_last: bool,
                  seq: int, in_place: bool = False) -> None:
        """WRITE chunk `c` of `o` to `remote` at `roff` (posting.post_chunk; `in_place`: into a FedRDMA-E slot)."""
        def signal() -> int:
            o.pending_wrs += 1
            return self.wr_id(Wr.DATA, o, seq, 0)

        o.note_posted(c.offset, c.length)
        post_chunk(qp, o.payload.sges(c.offset, c.length), c.offset, in_place, remote, roff,
                   signal if signal_last else None, o.leaving.hook_for(c) if o.leaving is not None else None)

    def post_header(self, qp: ev.QP, o: Outgoing, hdr: P.Header, seq: int, remote: ev.RemoteMR, roff: int,
                    imm: int) -> None:
        """WRITE_WITH_IMM a header (and chunk 0's metadata) to `remote` at `roff`."""
        idx, sge = self.mem.put_header(P.encode_header(hdr), o.meta if hdr.meta_len else b"")
        o.pending_wrs += 1
        qp.post_write_with_imm(sge, remote, imm, remote_offset=roff, wr_id=self.wr_id(Wr.HEADER, o, seq, idx))

    def header_done(self, idx: int) -> None:
        """The header WRITE from buffer `idx` completed: the buffer is free."""
        self.mem.hdr_free.append(idx)
