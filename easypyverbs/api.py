"""The provider-independent verbs API: Context -> PD -> MR, CQ, QP.

Providers (`easypyverbs.providers.*`) subclass these and implement the `_`-prefixed hooks; the
argument checking, bounds checks and lifetime rules live here once, so both providers behave alike. What a
provider's objects can do beyond this API (hooks of a provider that moves the bytes itself) is in
capabilities.py; how its payloads move, for a policy to read, is a QP's `path_kind` (types.DataPath).
"""
from __future__ import annotations

import abc
import contextlib
import dataclasses
import time
from typing import Any, Iterator, List, Optional, Sequence, Union

from .buffers import address_of, as_byte_view
from .enums import Access, QPState, WCOpcode
from .errors import PollTimeout, UsageError
from .resource import Resource
from .types import WC, DataPath, DeviceInfo, QPCap, QPInfo, RemoteMR


_LOCAL_WRITE = int(Access.LOCAL_WRITE)
_REMOTE_WRITE_OR_ATOMIC = int(Access.REMOTE_WRITE | Access.REMOTE_ATOMIC)


#: the soft provider's name in logs and on benchmark lines: path-neutral, since one context carries TCP streams (as
#: between hosts) and same-host shared-memory copies alike; where a figure has a path, its line names it
SOFT_LABEL = "soft (emulated verbs, not RDMA)"


class Context(Resource):
    """An opened device (`ibv_context`)."""

    close_rank = 90
    provider: str = "?"
    emulated: bool = False
    #: the provider places remote WRITEs itself: its MRs are capabilities.PlacesWrites (digests as they land)
    tracks_writes: bool = False
    #: registering memory pins it (a NIC's DMA needs it resident): fault large registrations in first
    pins_memory: bool = True
    #: payloads to a peer process of this host may move by a copy between the two processes (no wire)
    same_host: bool = False

    def __init__(self, name: str) -> None:
        super().__init__(None)
        self.name = name

    @property
    def label(self) -> str:
        """How benchmark lines and logs name this provider."""
        return SOFT_LABEL if self.emulated else f"pyverbs ({self.name})"

    def alloc_pd(self) -> "PD":
        self._check_open()
        return self._alloc_pd()

    def create_cq(self, cqe: int = 4096) -> "CQ":
        self._check_open()
        if cqe < 1:
            raise UsageError(f"cqe must be >= 1, got {cqe}")
        return self._create_cq(cqe)

    def query(self) -> DeviceInfo:
        self._check_open()
        return self._query()

    @property
    def max_msg_bytes(self) -> int:
        return min(p.max_msg_bytes for p in self.query().ports)

    @property
    def link_rate_bps(self) -> Optional[float]:
        """The rate of an emulated link this context's payloads cross, where it has one (None: unknown)."""
        return None

    @abc.abstractmethod
    def _alloc_pd(self) -> "PD":
        """Provider hook."""

    @abc.abstractmethod
    def _create_cq(self, cqe: int) -> "CQ":
        """Provider hook."""

    @abc.abstractmethod
    def _query(self) -> DeviceInfo:
        """Provider hook."""


class PD(Resource):
    """A protection domain (`ibv_pd`)."""

    close_rank = 80

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.ctx = ctx

    def reg_mr(self, buffer: Any, access: Access = Access.LOCAL_WRITE, revocable: bool = False) -> "MR":
        """Register `buffer` (zero copy). Remote write/read or local write need a writable buffer.

        `revocable`: remote access is to be taken back and given again under new rkeys (MR.revoke_remote,
        MR.rekey) while the memory stays registered: the soft provider does that for every MR; pyverbs through
        a memory window where `ctx.memory_windows` (pyverbs_windows), else its MR's revoke_remote answers False."""
        self._check_open()
        if type(access) is not Access:
            access = Access(access)
        bits = int(access)  # (int arithmetic: IntFlag's own operators build members, ~1 us a registration)
        if bits & _REMOTE_WRITE_OR_ATOMIC and not bits & _LOCAL_WRITE:
            raise UsageError("REMOTE_WRITE requires LOCAL_WRITE (as ibv_reg_mr does)")
        view = as_byte_view(buffer, writable=bool(bits & _LOCAL_WRITE))
        return self._reg_mr(buffer, view, access, revocable)

    def create_qp(self, send_cq: "CQ", recv_cq: Optional["CQ"] = None, cap: QPCap = QPCap()) -> "QP":
        """Create an RC queue pair in RESET->INIT; call `connect()` with the peer's `QPInfo`."""
        self._check_open()
        recv_cq = recv_cq or send_cq
        for cq in (send_cq, recv_cq):
            cq._check_open()
            if cq.ctx is not self.ctx:
                raise UsageError("CQ belongs to another context")
        return self._create_qp(send_cq, recv_cq, cap)

    @abc.abstractmethod
    def _reg_mr(self, buffer: Any, view: memoryview, access: Access, revocable: bool = False) -> "MR":
        """Provider hook."""

    @abc.abstractmethod
    def _create_qp(self, send_cq: "CQ", recv_cq: "CQ", cap: QPCap) -> "QP":
        """Provider hook."""


class MR(Resource):
    """A registered memory region (`ibv_mr`) over the caller's buffer."""

    close_rank = 20

    def __init__(self, pd: PD, buffer: Any, view: memoryview, access: Access, lkey: int, rkey: int) -> None:
        super().__init__(pd)
        self.pd = pd
        self._owner = buffer  # keeps the memory alive while registered
        self._view = view
        self.access = access
        self.addr = address_of(view)
        self.length = view.nbytes
        self.lkey = lkey
        self.rkey = rkey

    def _range(self, offset: int, length: Optional[int]) -> int:
        if length is None:
            length = self.length - offset
        if offset < 0 or length < 0 or offset + length > self.length:
            raise UsageError(f"range [{offset}, {offset + length}) outside MR of {self.length} bytes")
        return length

    def view(self, offset: int = 0, length: Optional[int] = None) -> memoryview:
        """A bounds-checked view of the registered bytes (aliases the buffer)."""
        self._check_open()
        length = self._range(offset, length)
        return self._view[offset : offset + length]

    def sge(self, offset: int = 0, length: Optional[int] = None) -> "SGE":
        length = self._range(offset, length)
        return SGE(self, offset, length)

    def remote(self, offset: int = 0, length: Optional[int] = None) -> RemoteMR:
        """Descriptor a peer uses to address this MR (send it over the bootstrap socket)."""
        self._check_open()
        length = self._range(offset, length)
        return RemoteMR(self.addr + offset, self.rkey, length)

    @property
    def windowed(self) -> bool:
        """Does remote access go through a memory window (pyverbs: registered revocable, windows on)?"""
        return False

    def revoke_remote(self) -> bool:
        """Stop remote access under the current rkey and keep the memory registered: from now on a peer's
        request under that rkey fails (remote access error); one being placed finishes first, within the
        provider's close bound. `rekey` opens it again under a new rkey. False where the provider cannot
        (pyverbs without a memory window over this MR: close it and register the memory anew instead); then
        nothing changed."""
        return False

    def rekey(self) -> int:
        """After `revoke_remote`: remote access again, under a new rkey (returned), which no earlier
        descriptor of this MR holds; tracking WRITEs (capabilities.PlacesWrites) starts anew after it where
        wanted."""
        raise UsageError(f"{type(self).__name__} cannot take a new rkey: close it and register the memory again")

    def _close_impl(self) -> None:
        self._view = memoryview(b"")
        self._owner = None


@dataclasses.dataclass(frozen=True)
class SGE:
    """A scatter/gather element: `length` bytes at `offset` of a registered MR."""

    mr: MR
    offset: int
    length: int

    def view(self) -> memoryview:
        return self.mr.view(self.offset, self.length)


SGEs = Union[SGE, MR, Sequence[Union[SGE, MR]]]


class CQ(Resource):
    """A completion queue (`ibv_cq`)."""

    close_rank = 60

    def __init__(self, ctx: Context, cqe: int) -> None:
        super().__init__(ctx)
        self.ctx = ctx
        self.cqe = cqe
        self._woken = False

    def wake(self) -> None:
        """Make a thread blocked in `wait` return early (with no completions): a doorbell for event loops."""
        self._woken = True
        self._notify()

    def _notify(self) -> None:
        """Provider hook for `wake`: the base `_wait` polls, so it needs nothing."""

    def poll(self, max_entries: int = 16) -> List[WC]:
        """Up to `max_entries` completions that are ready now (never blocks)."""
        self._check_open()
        return self._poll(max_entries)

    def wait(self, timeout_s: float, max_entries: int = 16) -> List[WC]:
        """At least one completion, waiting up to `timeout_s`; raises `PollTimeout` after that.

        Returns an empty list early if `wake()` was called meanwhile.
        """
        self._check_open()
        if timeout_s < 0:
            raise UsageError("timeout_s must be >= 0")
        return self._wait(timeout_s, max_entries)

    def wait_n(self, n: int, timeout_s: float) -> List[WC]:
        """Exactly `n` completions within `timeout_s` in total."""
        deadline = time.monotonic() + timeout_s
        out: List[WC] = []
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PollTimeout(f"got {len(out)} of {n} completions within {timeout_s:.3f} s")
            try:
                out.extend(self.wait(left, n - len(out)))
            except PollTimeout:
                raise PollTimeout(f"got {len(out)} of {n} completions within {timeout_s:.3f} s") from None
        return out

    @abc.abstractmethod
    def _poll(self, max_entries: int) -> List[WC]:
        """Provider hook."""

    def _wait(self, timeout_s: float, max_entries: int) -> List[WC]:
        # busy-poll with a growing sleep: bounded, never forever
        deadline = time.monotonic() + timeout_s
        pause = 0.0
        while True:
            got = self._poll(max_entries)
            if got:
                return got
            if self._woken:
                self._woken = False
                return []
            now = time.monotonic()
            if now >= deadline:
                raise PollTimeout(f"no completion within {timeout_s:.3f} s")
            if pause:
                time.sleep(min(pause, deadline - now))
            pause = min(0.002, pause * 2 or 0.00002)


def _check_imm(imm: Optional[int]) -> None:
    if imm is not None and not 0 <= imm < 1 << 32:
        raise UsageError(f"imm must fit 32 bits, got {imm}")


class QP(Resource):
    """A reliable-connected queue pair (`ibv_qp`, IBV_QPT_RC)."""

    close_rank = 10

    def __init__(self, pd: PD, send_cq: CQ, recv_cq: CQ, cap: QPCap) -> None:
        super().__init__(pd)
        self.pd = pd
        self.ctx = pd.ctx
        self.send_cq = send_cq
        self.recv_cq = recv_cq
        self.cap = cap
        self.remote_info: Optional[QPInfo] = None

    # -- connection -----------------------------------------------------------------------------
    def info(self) -> QPInfo:
        """This QP's descriptor for the peer."""
        self._check_open()
        return self._info()

    def connect(self, remote: QPInfo, timeout_s: float = 10.0, patient_until: float = 0.0) -> None:
        """Move RESET/INIT -> RTR -> RTS against the peer's `QPInfo`. `patient_until` (easypyverbs.stalls'
        clock; establish passes its bootstrap connection's window): a provider that waits on the peer here
        (soft: its NIC's answer) waits on past `timeout_s` until then while the peer's host acknowledges
        what was sent (a held peer process, bootstrap.BootstrapConn.wait_patiently)."""
        self._check_open()
        if remote.provider != self.ctx.provider:
            raise UsageError(f"cannot connect a {self.ctx.provider} QP to a {remote.provider} QP")
        if self.state not in (QPState.RESET, QPState.INIT):
            raise UsageError(f"QP is already {self.state.name}; connect() is for a new QP")
        self._connect(remote, timeout_s, patient_until)
        self.remote_info = remote

    @property
    def state(self) -> QPState:
        return QPState.ERR if self.closed else self._state()

    def to_error(self, why: str = "moved to the error state") -> None:
        """Move the QP to the error state (`ibv_modify_qp` to IBV_QPS_ERR): its posted work requests complete
        with WR_FLUSH_ERR and nothing more is posted on it; `why` for the log. A QP in error is not reused: a
        connection makes new ones."""
        self._check_open()
        self._to_error(why)

    def _to_error(self, why: str) -> None:
        """Provider hook."""
        raise UsageError(f"{type(self).__name__} cannot be moved to the error state")

    @property
    def path_kind(self) -> DataPath:
        """How this QP's payloads move, for a policy to read; fixed once connected. A provider whose payloads
        do not cross a NIC says so."""
        return DataPath.RDMA

    @property
    def data_path(self) -> str:
        """The same in words, for logs and traces (a provider may say more)."""
        return "verbs"

    # -- posting --------------------------------------------------------------------------------
    def _sges(self, sges: SGEs, limit: int) -> List[SGE]:
        if isinstance(sges, (SGE, MR)):
            sges = [sges]
        out = [s.sge() if isinstance(s, MR) else s for s in sges]
        if len(out) > limit:
            raise UsageError(f"{len(out)} SGEs exceed the QP's limit of {limit}")
        for s in out:
            if not isinstance(s, SGE):
                raise UsageError(f"expected SGE or MR, got {type(s).__name__}")
            s.mr._check_open()
            if s.mr.pd is not self.pd:
                raise UsageError("MR belongs to another protection domain")
            s.mr._range(s.offset, s.length)  # an SGE built by hand must lie inside its MR too
        return out

    def _check_len(self, total: int) -> None:
        limit = self.remote_info.max_msg_bytes if self.remote_info else self.ctx.max_msg_bytes
        limit = min(limit, self.ctx.max_msg_bytes)
        if total > limit:
            raise UsageError(f"message of {total} bytes exceeds max_msg_sz {limit}")

    def _ready(self) -> None:
        self._check_open()
        if self.state != QPState.RTS:
            raise UsageError(f"QP is in state {self.state.name}; post_send needs RTS")

    def post_send(self, sges: SGEs, wr_id: int = 0, signaled: bool = True, imm: Optional[int] = None) -> None:
        """SEND (or SEND_WITH_IMM): consumes one receive posted at the peer."""
        self._ready()
        lst = self._sges(sges, self.cap.max_send_sge)
        self._check_len(sum(s.length for s in lst))
        _check_imm(imm)
        self._post("send", lst, None, 0, imm, wr_id, signaled)

    def post_write(self, sges: SGEs, remote: RemoteMR, remote_offset: int = 0, wr_id: int = 0,
                   signaled: bool = True) -> None:
        """RDMA WRITE of the SGEs to `remote` at `remote_offset`; no completion at the peer. (A QP that sends
        the bytes itself may take a hook for them on the way: capabilities.LeavingWrites.)"""
        self._post_rdma("write", sges, remote, remote_offset, None, wr_id, signaled)

    def post_write_with_imm(
        self, sges: SGEs, remote: RemoteMR, imm: int, remote_offset: int = 0, wr_id: int = 0, signaled: bool = True
    ) -> None:
        """RDMA WRITE_WITH_IMM: places the bytes, then consumes a peer receive carrying `imm`."""
        self._post_rdma("write", sges, remote, remote_offset, imm, wr_id, signaled)

    def post_read(self, sges: SGEs, remote: RemoteMR, remote_offset: int = 0, wr_id: int = 0,
                  signaled: bool = True) -> None:
        """RDMA READ from `remote` at `remote_offset` into the local SGEs."""
        self._post_rdma("read", sges, remote, remote_offset, None, wr_id, signaled)

    def _post_rdma(self, op: str, sges: SGEs, remote: RemoteMR, remote_offset: int, imm: Optional[int], wr_id: int,
                   signaled: bool) -> None:
        lst = self._rdma_sges(sges, remote, remote_offset, imm)
        self._post(op, lst, remote.addr + remote_offset, remote.rkey, imm, wr_id, signaled)

    def _rdma_sges(self, sges: SGEs, remote: RemoteMR, remote_offset: int, imm: Optional[int]) -> List[SGE]:
        """Check an RDMA request (this QP ready, its SGEs, lengths, immediate and remote range): its SGEs."""
        self._ready()
        lst = self._sges(sges, self.cap.max_send_sge)
        total = sum(s.length for s in lst)
        self._check_len(total)
        _check_imm(imm)
        if remote_offset < 0 or remote_offset + total > remote.length:
            raise UsageError(f"remote range [{remote_offset}, {remote_offset + total}) outside the remote MR of "
                             f"{remote.length} bytes")
        if not 0 <= remote.rkey < 1 << 32 or not 0 <= remote.addr <= (1 << 64) - remote.length:
            raise UsageError(f"remote MR rkey {remote.rkey:#x} / address {remote.addr:#x} + {remote.length} bytes "
                             f"outside 32 / 64 bits")
        return lst

    @contextlib.contextmanager
    def batch(self) -> Iterator["QP"]:
        """Post the send-queue WRs of the `with` block as one list, as ibv_post_send takes a chain of WRs:
        the provider may hand them to the wire together (the soft provider: in one vectored write, which
        the peer answers once). Each WR is checked, fails and completes as if posted alone; only their
        departure is shared. Posts from the thread that opened the batch; batches do not nest."""
        self._check_open()
        self._begin_batch()
        try:
            yield self
        finally:
            self._end_batch()

    def _begin_batch(self) -> None:
        """Provider hook: hold this thread's posts until _end_batch (default: each goes when posted)."""

    def _end_batch(self) -> None:
        """Provider hook: hand the held posts to the wire."""

    def post_recv(self, sges: SGEs, wr_id: int = 0) -> None:
        """Post a receive buffer for an incoming SEND or WRITE_WITH_IMM (may be zero SGEs for imm-only)."""
        self._check_open()
        if self.state == QPState.ERR:
            raise UsageError("QP is in the error state")
        lst = self._sges(sges, self.cap.max_recv_sge) if sges != [] else []
        self._post_recv(lst, wr_id)

    @abc.abstractmethod
    def _post(self, op: str, sges: List[SGE], raddr: Optional[int], rkey: int, imm: Optional[int], wr_id: int,
              signaled: bool) -> None:
        """Provider hook."""

    @abc.abstractmethod
    def _post_recv(self, sges: List[SGE], wr_id: int) -> None:
        """Provider hook."""

    @abc.abstractmethod
    def _info(self) -> QPInfo:
        """Provider hook."""

    @abc.abstractmethod
    def _connect(self, remote: QPInfo, timeout_s: float, patient_until: float) -> None:
        """Provider hook."""

    @abc.abstractmethod
    def _state(self) -> QPState:
        """Provider hook."""


OPCODE_OF = {"send": WCOpcode.SEND, "write": WCOpcode.RDMA_WRITE, "read": WCOpcode.RDMA_READ}
