"""The registered memory of one connection, and where each thing sits in it.

    pool      FedRDMA-E receive slots (remote write), each [HEADER][metadata cap][payload], each its
              own MR: revoked when its transfer arrives, given a new rkey when released (the soft
              provider keeps it registered; a NIC's is registered anew);
              each grows and shrinks with the traffic (slots.py)
    staging   FedRDMA staging buffers (remote write), each [HEADER][metadata cap][chunk]
    recv      the receive ring: small buffers for control SENDs (and the WRITE_WITH_IMM notices)
    ctrl      outgoing control frames, one buffer per SEND in flight
    hdr       outgoing headers (+ metadata), one buffer per header WRITE in flight

The remote layouts (the peer's pool and staging buffers) are described by its hello: see
protocol/hello.py (PoolOffer, StagingOffer), which this module mirrors for the local side.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
from numpy.typing import NDArray

import easypyverbs as ev

from ..protocol.frames import CTRL
from ..protocol.hello import HDR_SLOT, PoolOffer, StagingOffer
from .slots import WRITE_ONLY, SlotMemory

#: a control frame (CTRL + reason) fits with room to spare
CTRL_BUF = CTRL.size + 1024 + 64
#: per QP: control frames + WRITE_WITH_IMM notifications that may arrive before the engine reposts
RECV_DEPTH = 256
#: control SENDs in flight before further ones wait in a backlog
CTRL_SENDS = 256


def same_host_capable(ctx: ev.Context) -> bool:
    """Does `ctx` (a device context) move payloads to peers of this host by a copy between the two processes
    (Context.same_host)? (Endpoint.same_host_capable; FedRDMA-E slots for a peer of this host are then shared
    memory.)"""
    return ctx.same_host


class LocalMemory:
    """Registers what this side of a connection needs, and hands out views and SGEs into it."""

    def __init__(self, pd: ev.PD, nqps: int, max_window: int, pool: Optional[PoolOffer],
                 staging: Optional[StagingOffer], slot_initial_bytes: Optional[int] = None,
                 track: Optional[Callable[[int], Any]] = None, near: bool = False) -> None:
        """`pool`: the slots at their largest; each starts with room for `slot_initial_bytes` (None: the
        largest); `track`: digest the peer's WRITEs into them as they land (SlotMemory); `near`: the peer is
        a process of this host, so where the soft provider's same-host path is on, the slots are shared
        memory that the peer's soft NIC copies its large WRITEs into itself (SlotMemory, its push)."""
        self.mrs: List[ev.MR] = []
        self.remote_mrs: Dict[str, ev.MR] = {}
        self.pool, self.staging = pool, staging
        self.slots: Optional[SlotMemory] = None
        rw = WRITE_ONLY  # the peer writes the staging buffers, never reads them
        try:
            if pool is not None:  # one MR per slot: a grant the peer loses while the slot is held
                initial = pool.slot_payload_bytes if slot_initial_bytes is None else slot_initial_bytes
                self.slots = SlotMemory(pd, pool, initial, pin=pd.ctx.pins_memory,
                                        track=track, shared=near and same_host_capable(pd.ctx))
                for i, mr in enumerate(self.slots.mrs):
                    assert mr is not None, "each slot is registered as it is made"
                    self.remote_mrs[f"slot{i}"] = mr
            if staging is not None:
                self.staging_buf, self.remote_mrs["staging"] = self._register(pd, staging.count * staging.buf_bytes, rw)
            self.nqps = nqps
            self.recv_buf, self.recv_mr = self._register(pd, nqps * RECV_DEPTH * CTRL_BUF, ev.Access.LOCAL_WRITE)
            self.ctrl_buf, self.ctrl_mr = self._register(pd, CTRL_SENDS * CTRL_BUF, ev.Access.LOCAL_WRITE)
            nhdr = max_window * 2 + 4
            self.hdr_buf, self.hdr_mr = self._register(pd, nhdr * HDR_SLOT, ev.Access.LOCAL_WRITE)
        except BaseException:
            self.close()
            raise
        self.hdr_free = list(range(nhdr - 1, -1, -1))
        self.ctrl_free = list(range(CTRL_SENDS - 1, -1, -1))

    # -- FedRDMA-E slots (SlotMemory: the peer may write a slot only while it holds its current rkey) --------
    @property
    def pool_bytes(self) -> int:
        """Bytes of receive slots registered now."""
        return self.slots.reserved_bytes if self.slots is not None else 0

    def _register(self, pd: ev.PD, nbytes: int, access: ev.Access) -> Tuple[NDArray[Any], ev.MR]:
        buf = np.empty(max(nbytes, 1), dtype=np.uint8)  # untouched pages cost no memory until written
        mr = pd.reg_mr(buf, access)
        self.mrs.append(mr)
        return buf, mr

    # -- receive ring ---------------------------------------------------------------------------
    def recv_sge(self, qp_idx: int, k: int) -> ev.SGE:
        return self.recv_mr.sge((qp_idx * RECV_DEPTH + k) * CTRL_BUF, CTRL_BUF)

    def received(self, qp_idx: int, k: int, nbytes: int) -> bytes:
        off = (qp_idx * RECV_DEPTH + k) * CTRL_BUF
        return bytes(self.recv_buf[off:off + min(nbytes, CTRL_BUF)])

    # -- outgoing control frames and headers ----------------------------------------------------
    def put_ctrl(self, idx: int, raw: bytes) -> ev.SGE:
        off = idx * CTRL_BUF
        self.ctrl_buf[off:off + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        return self.ctrl_mr.sge(off, len(raw))

    def put_header(self, raw_header: bytes, meta: bytes) -> Tuple[int, ev.SGE]:
        """Copy a header and its metadata into a free header buffer: (its index, the SGE to WRITE)."""
        idx = self.hdr_free.pop()
        base = idx * HDR_SLOT
        self.hdr_buf[base:base + len(raw_header)] = np.frombuffer(raw_header, dtype=np.uint8)
        if meta:
            self.hdr_buf[base + len(raw_header):base + len(raw_header) + len(meta)] = np.frombuffer(meta, dtype=np.uint8)
        return idx, self.hdr_mr.sge(base, len(raw_header) + len(meta))

    # -- receive areas --------------------------------------------------------------------------
    def staging_view(self, index: int) -> memoryview:
        assert self.staging is not None
        base = self.staging.base(index)
        return self.staging_buf.data[base:base + self.staging.buf_bytes]

    def close(self) -> None:
        for mr in self.mrs:
            mr.close()
        self.mrs = []
        slots: Optional[SlotMemory] = getattr(self, "slots", None)  # (None: __init__ failed before it)
        if slots is not None:
            slots.close()
