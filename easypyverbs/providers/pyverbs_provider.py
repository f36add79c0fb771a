"""The pyverbs provider: real RDMA through rdma-core's pyverbs (RC QPs, RoCE v2 or InfiniBand).

Works with rdma-core 44 (`pyverbs.enums`) and 57+ (`pyverbs.libibverbs_enums`). pyverbs comes from
the system's rdma-core (deploy/install-rdma-core.sh), never from PyPI. With no RDMA device the
provider raises `NoDeviceError` saying so.

Tested in CI on Soft-RoCE (rxe0) in a qemu VM (`make test-rdma`, `fate-rdma vm run`): real
libibverbs and kernel verbs, not RDMA hardware. What rxe does differently from NICs (and from the
soft provider) is handled here and named in tests/test_verbs_conformance.py:
- rdma-core 44's pyverbs refuses a receive WR with no SGE, which libibverbs accepts (the normal
  receive for WRITE_WITH_IMM): such receives are posted with one zero-length SGE over a per-PD
  scratch MR, which NICs treat as no buffer at all (mlx5 skips zero-length scatter entries).
- pyverbs caches `qp_state` from the last modify; after an error completion the kernel has moved
  the QP to ERR, so the state is queried (and ERR remembered: it is sticky).
- `max_msg_sz` is per port (rxe: 8 MiB, NICs often 1 GiB); larger messages are refused before posting.
"""
from __future__ import annotations

import errno
import logging
import socket
import threading
from typing import Any, Callable, List, Optional

from ..api import CQ, MR, PD, QP, SGE, Context
from ..enums import MTU_BYTES, Access, QPState, WCOpcode, WCStatus
from ..errors import EasyVerbsError, NoDeviceError, UsageError
from ..types import WC, DeviceInfo, PortInfo, QPCap, QPInfo
from . import pyverbs_windows as W
from .pyverbs_call import call
from .pyverbs_devices import RXE_VENDOR_ID, gid_type, soft_roce_label, status
from .pyverbs_devices import version as version  # (re-exported: doctor)

log = logging.getLogger("easypyverbs.pyverbs")


def _enums() -> Any:
    try:
        import pyverbs.libibverbs_enums as e  # rdma-core >= 57
    except ImportError:
        import pyverbs.enums as e  # rdma-core 44
    return e


def open_pyverbs(name: Optional[str] = None, port_num: int = 1, gid_index: Optional[int] = None) -> "PyverbsContext":
    ok, why, devices = status()
    if not ok or not devices:
        raise NoDeviceError(f"pyverbs provider: {why}")
    name = name or devices[0]
    if name not in devices:
        raise NoDeviceError(f"pyverbs provider: no RDMA device {name!r}; found {', '.join(devices)}")
    return PyverbsContext(name, port_num, gid_index)


class PyverbsContext(Context):
    provider = "pyverbs"
    emulated = False

    def __init__(self, name: str, port_num: int = 1, gid_index: Optional[int] = None) -> None:
        import pyverbs.device as d

        super().__init__(name)
        self.e = _enums()
        W.windows_setting()  # (a bad EASYPYVERBS_MEMORY_WINDOWS is refused before the device is opened)
        self._ctx = call(f"open device {name}", d.Context, name=name)
        self.port_num = port_num
        self._port = call("query_port", self._ctx.query_port, port_num)
        self.is_roce = self._port.link_layer == self.e.IBV_LINK_LAYER_ETHERNET
        self.gid_index = self._pick_gid() if gid_index is None else gid_index
        self.gid = str(call("query_gid", self._ctx.query_gid, port_num, self.gid_index).gid)
        self._attr = call("query_device", self._ctx.query_device)
        self.soft_roce = self._attr.vendor_id == RXE_VENDOR_ID or name.startswith("rxe")
        #: whether `reg_mr(..., revocable=True)` opens remote access through a type 1 memory window, so that
        #: `revoke_remote`/`rekey` take it back and give it again without registering anew (pyverbs_windows):
        #: where the device has windows unless EASYPYVERBS_MEMORY_WINDOWS=off, or set it. Turned off, with a
        #: warning, if a bind fails.
        self.memory_windows = W.windows_wanted(bool(self._attr.max_mw))
        log.info("pyverbs: %s port %d, GID[%d]=%s, active MTU %d, max_msg_sz %d%s", name, port_num, self.gid_index,
                 self.gid, MTU_BYTES.get(self._port.active_mtu, 0), self._port.max_msg_sz,
                 f" [{soft_roce_label()}]" if self.soft_roce else "")

    @property
    def label(self) -> str:
        return soft_roce_label() if self.soft_roce else f"pyverbs ({self.name})"

    def _pick_gid(self) -> int:
        """RoCE: the first RoCE v2 GID with an IPv4-mapped address, else any RoCE v2; IB: index 0."""
        if not self.is_roce:
            return 0
        best = None
        for i in range(self._port.gid_tbl_len):
            try:
                gid = str(self._ctx.query_gid(self.port_num, i).gid)
            except Exception:
                continue
            if gid.strip("0:") == "" or "v2" not in gid_type(self.name, self.port_num, i):
                continue
            if gid.startswith("0000:0000:0000:0000:0000:ffff") or "::ffff:" in gid:
                return i
            best = i if best is None else best
        if best is None:
            raise NoDeviceError(f"{self.name} port {self.port_num}: no RoCE v2 GID (is an IP address configured?)")
        return best

    def _alloc_pd(self) -> PD:
        return PyverbsPD(self)

    def _create_cq(self, cqe: int) -> CQ:
        return PyverbsCQ(self, cqe)

    def _query(self) -> DeviceInfo:
        attr = call("query_device", self._ctx.query_device)
        port = call("query_port", self._ctx.query_port, self.port_num)
        gids = tuple((i, str(self._ctx.query_gid(self.port_num, i).gid), gid_type(self.name, self.port_num, i))
                     for i in range(min(port.gid_tbl_len, 8)))
        state = "ACTIVE" if port.state == self.e.IBV_PORT_ACTIVE else f"state {port.state}"
        p = PortInfo(self.port_num, state, MTU_BYTES.get(port.active_mtu, 0), port.max_msg_sz, port.lid,
                     "Ethernet (RoCE)" if self.is_roce else "InfiniBand", gids)
        return DeviceInfo("pyverbs", self.name, False, attr.max_mr_size, attr.max_qp_wr, attr.max_sge, attr.max_cqe,
                          (p,), notes=self.label if self.soft_roce else "", max_mw=int(attr.max_mw))

    @property
    def max_msg_bytes(self) -> int:
        return int(self._port.max_msg_sz)

    def close(self) -> None:
        for child in list(self._children):  # (its CQs close before its PDs: the binders' first, under their locks)
            if isinstance(child, PyverbsPD):
                child.close_binder()
        super().close()

    def _close_impl(self) -> None:
        self._ctx.close()


class PyverbsPD(PD):
    ctx: PyverbsContext

    def __init__(self, ctx: PyverbsContext) -> None:
        from pyverbs.pd import PD as _PD

        super().__init__(ctx)
        self._pd = call("alloc_pd", _PD, ctx._ctx)
        self._scratch: Any = None  # pyverbs MR (its own 64-byte buffer) for receives with no buffer
        self._binder: Optional[W.Binder] = None  # made at the first window bind
        self._binder_lock = threading.Lock()
        self.closing = False  # (close_binder: set before any of the PD's objects is closed)

    def scratch_sge(self) -> Any:
        """A zero-length SGE over a small registered buffer: the 'no SGE' receive pyverbs 44 cannot build."""
        from pyverbs.mr import MR as _MR
        from pyverbs.wr import SGE as _SGE

        if self._scratch is None:
            mr = call("reg_mr (scratch)", _MR, self._pd, 64, int(Access.LOCAL_WRITE))
            self._scratch = mr
        return _SGE(self._scratch.buf, 0, self._scratch.lkey)

    def _reg_mr(self, buffer: Any, view: memoryview, access: Access, revocable: bool = False) -> MR:
        from pyverbs.mr import MR as _MR

        from ..buffers import address_of

        if view.nbytes == 0:
            raise UsageError("cannot register an empty buffer")
        if self.closing:
            raise UsageError("PyverbsPD is closing")
        ctx = self.ctx
        windowed = revocable and bool(W.remote_bits(int(access))) and ctx.memory_windows
        bits = W.registration_access(int(access), ctx.e) if windowed else int(access)
        mr = call("reg_mr", _MR, self._pd, view.nbytes, bits, address=address_of(view))
        out = PyverbsMR(self, buffer, view, access, mr.lkey, mr.rkey)
        out._mr = mr
        if windowed:
            try:
                out._windowed = True
                out.rekey()
            except BaseException as exc:
                out.close()
                if not isinstance(exc, EasyVerbsError) or ctx.memory_windows:
                    raise  # (the PD closing, or not a failed bind)
                return self._reg_mr(buffer, view, access, False)  # (rekey turned windows off, saying so)
        return out

    def bind_window(self, raw_mr: Any, access: int) -> Any:
        """A type 1 memory window over all of `raw_mr` with remote `access`, bound (pyverbs_windows.Binder)."""
        with self._binder_lock:
            self._check_open()
            if self.closing:
                raise UsageError("PyverbsPD is closing")
            if self._binder is not None and self._binder.broken:
                self._binder.close()
                self._binder = None
            if self._binder is None:
                self._binder = self._new_binder()
            binder = self._binder
        return binder.bind(self._pd, raw_mr, access)

    def _new_binder(self) -> W.Binder:
        """This PD's binder, with a CQ and an RC QP of its own (both closed again where it cannot be made)."""
        cq = PyverbsCQ(self.ctx, 4)
        try:
            qp = PyverbsQP(self, cq, cq, QPCap(max_send_wr=2, max_recv_wr=1, max_send_sge=1, max_recv_sge=1))
        except BaseException:
            cq.close()
            raise
        return W.Binder(cq, qp)

    def _create_qp(self, send_cq: CQ, recv_cq: CQ, cap: QPCap) -> QP:
        return PyverbsQP(self, send_cq, recv_cq, cap)

    def close(self) -> None:
        self.close_binder()
        super().close()

    def close_binder(self) -> None:
        """Before the PD's objects go (a connection thread may be binding): no bind from now on, and the binder's QP
        and CQ closed once a bind under way is done."""
        with self._binder_lock:
            self.closing = True
            if self._binder is not None:
                self._binder.close()
                self._binder = None

    def _close_impl(self) -> None:
        if self._scratch is not None:
            self._scratch.close()
        self._pd.close()


class PyverbsMR(MR):
    """Registered revocable with windows on (`windowed`), its remote access goes through a type 1 memory window
    (pyverbs_windows): `revoke_remote` deallocates it, `rekey` binds a fresh one."""

    pd: PyverbsPD
    _windowed = False
    _mw: Any = None  # the pyverbs MW while remote access is open
    _mr: Any = None  # the pyverbs MR

    @property
    def windowed(self) -> bool:
        return self._windowed

    def revoke_remote(self) -> bool:
        with self._close_lock:  # (a close waits for a revoke or rekey, and the reverse)
            self._check_open()
            if not self._windowed:
                return False
            self._drop_window()
            return True

    def rekey(self) -> int:
        with self._close_lock:
            self._check_open()
            if not self._windowed:
                return super().rekey()
            if self._mw is not None:
                raise UsageError(f"pyverbs MR rkey {self.rkey:#x}: rekey needs its remote access revoked first "
                                 f"(revoke_remote)")
            pd, ctx = self.pd, self.pd.ctx
            if not ctx.memory_windows:  # (turned off since this MR was registered: register anew)
                raise EasyVerbsError(f"pyverbs: {ctx.name}: memory windows are off")
            try:
                self._mw = pd.bind_window(self._mr, W.remote_bits(int(self.access)))
            except EasyVerbsError as exc:
                if pd.closed or pd.closing:  # (not the device's failure: no fallback, no warning)
                    raise UsageError(f"pyverbs MR: no new key, its PD is closing ({exc})") from exc
                # (pyverbs refusing the bind's arguments, a UsageError, is the device's or pyverbs' limit too:
                # raised as a failed bind, which callers answer by registering anew)
                ctx.memory_windows = False
                log.warning("pyverbs: %s: a memory window could not be bound (%s): revocable MRs are registered "
                            "anew at each grant from now on", ctx.name, exc)
                raise EasyVerbsError(f"memory window not bound: {exc}") from exc
            self.rkey = int(self._mw.rkey)
            return self.rkey

    def _drop_window(self) -> None:
        """Deallocate the window: only once that succeeded is it forgotten (a window that stays bound keeps its
        access, and the MR must not be deregistered under it)."""
        if self._mw is not None:
            call("dealloc_mw", self._mw.close)
            self._mw = None

    def _close_impl(self) -> None:
        self._drop_window()  # (a device refuses to deregister an MR with a window bound)
        if self._mr is not None:
            self._mr.close()
        super()._close_impl()


class PyverbsCQ(CQ):
    def __init__(self, ctx: PyverbsContext, cqe: int) -> None:
        from pyverbs.cq import CQ as _CQ

        super().__init__(ctx, cqe)
        self._cq = call("create_cq", _CQ, ctx._ctx, cqe, None, None, 0)
        self._e = ctx.e
        # a close from another thread (an owner's cleanup, a test's leak check) must not free the CQ
        # under a poll in progress: with pyverbs that is a use-after-free in libibverbs (a segfault)
        self._poll_lock = threading.Lock()
        self._destroyed = False

    def _poll(self, max_entries: int) -> List[WC]:
        with self._poll_lock:
            if self._destroyed:
                raise UsageError("PyverbsCQ is closed")
            n, wcs = call("poll_cq", self._cq.poll, max_entries)
        out = []
        for wc in wcs[:n]:
            imm = socket.ntohl(wc.imm_data) if wc.wc_flags & self._e.IBV_WC_WITH_IMM else None
            # the opcode of an error completion is undefined in libibverbs: WCOpcode maps strays to UNKNOWN
            out.append(WC(wc.wr_id, WCStatus(wc.status), WCOpcode(wc.opcode), wc.byte_len, imm, wc.qp_num,
                          wc.vendor_err))
        return out

    def _close_impl(self) -> None:
        with self._poll_lock:
            self._destroyed = True
            self._cq.close()


class PyverbsQP(QP):
    ctx: PyverbsContext
    pd: PyverbsPD
    send_cq: PyverbsCQ  # (CQs of this QP's context: PyverbsContext makes only those)
    recv_cq: PyverbsCQ

    def __init__(self, pd: PyverbsPD, send_cq: CQ, recv_cq: CQ, cap: QPCap) -> None:
        import random

        from pyverbs.qp import QP as _QP
        from pyverbs.qp import QPCap as _Cap
        from pyverbs.qp import QPInitAttr

        super().__init__(pd, send_cq, recv_cq, cap)
        e = self.e = pd.ctx.e
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.send_cq._cq, rcq=self.recv_cq._cq,
                          cap=_Cap(cap.max_send_wr, cap.max_recv_wr, cap.max_send_sge, cap.max_recv_sge,
                                   cap.max_inline_data),
                          sq_sig_all=0)
        self._qp = call("create_qp", _QP, pd._pd, init)
        self.psn = random.randrange(1 << 24)
        self._in_error = False

    def _info(self) -> QPInfo:
        ctx = self.ctx
        return QPInfo("pyverbs", self._qp.qp_num, self.psn, ctx.gid, ctx._port.lid,
                      MTU_BYTES.get(ctx._port.active_mtu, 1024), ctx.max_msg_bytes)

    def _state(self) -> QPState:
        # pyverbs' qp_state is what the last modify set; an error completion moves the QP to ERR in
        # the kernel without telling pyverbs, so ask the device (ERR is sticky: remember it)
        if self._in_error:
            return QPState.ERR
        attr, _ = call("query_qp", self._qp.query, self.e.IBV_QP_STATE)
        state = QPState(attr.qp_state)
        self._in_error = state in (QPState.ERR, QPState.SQE)
        return state

    def _to_error(self, why: str) -> None:
        from pyverbs.qp import QPAttr

        attr = QPAttr()
        attr.qp_state = self.e.IBV_QPS_ERR
        call("modify QP to ERR", self._qp.modify, attr, self.e.IBV_QP_STATE)
        self._in_error = True
        log.info("QP %d -> ERR: %s", self._qp.qp_num, why)

    def _connect(self, remote: QPInfo, timeout_s: float, patient_until: float) -> None:  # (no wait on the peer)
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        ctx = self.ctx
        mtu_enum = {v: k for k, v in MTU_BYTES.items()}[min(remote.mtu, MTU_BYTES.get(ctx._port.active_mtu, 1024))]
        attr = QPAttr(port_num=ctx.port_num)
        attr.qp_access_flags = int(Access.all_rdma())
        attr.path_mtu = mtu_enum
        attr.dest_qp_num = remote.qpn
        attr.rq_psn = remote.psn
        attr.sq_psn = self.psn
        attr.max_rd_atomic = attr.max_dest_rd_atomic = 16
        attr.min_rnr_timer = 12  # 0.64 ms
        attr.timeout = 14  # 4.096 us * 2^14 = 67 ms per try; long-haul links want more (configurable later)
        attr.retry_cnt = 7
        attr.rnr_retry = 7  # infinite RNR retries, as perftest does
        gr = GlobalRoute(dgid=GID(remote.gid), sgid_index=ctx.gid_index)
        attr.ah_attr = AHAttr(port_num=ctx.port_num, is_global=1, gr=gr, dlid=remote.lid)
        call("modify QP to RTS", self._qp.to_rts, attr)

    def bind_mw(self, mw: Any, bind: Any) -> None:
        """Post the bind of pyverbs MW `mw` (`ibv_bind_mw`, a pyverbs MWBind): pyverbs_windows.Binder's QP."""
        self._qp.bind_mw(mw, bind)

    def _post(self, op: str, sges: List[SGE], raddr: Optional[int], rkey: int, imm: Optional[int], wr_id: int,
              signaled: bool) -> None:
        from pyverbs.wr import SGE as _SGE
        from pyverbs.wr import SendWR

        e = self.e
        opcode = {
            ("send", False): e.IBV_WR_SEND, ("send", True): e.IBV_WR_SEND_WITH_IMM,
            ("write", False): e.IBV_WR_RDMA_WRITE, ("write", True): e.IBV_WR_RDMA_WRITE_WITH_IMM,
            ("read", False): e.IBV_WR_RDMA_READ,
        }[(op, imm is not None)]

        pd = self.pd

        def post() -> None:  # building the WR is inside call too: pyverbs checks arguments there
            # pyverbs 44 refuses num_sge=0 (a zero-byte SEND or WRITE_WITH_IMM): one zero-length SGE instead
            sg = [_SGE(s.mr.addr + s.offset, s.length, s.mr.lkey) for s in sges] or [pd.scratch_sge()]
            wr = SendWR(wr_id=wr_id, opcode=opcode, num_sge=len(sg), sg=sg,
                        send_flags=e.IBV_SEND_SIGNALED if signaled else 0, imm_data=socket.htonl(imm or 0))
            if op != "send":
                wr.set_wr_rdma(rkey, raddr)
            self._qp.post_send(wr)

        self._posted(f"post_send ({op})", post, f"send queue full ({self.cap.max_send_wr} WRs outstanding)")

    def _post_recv(self, sges: List[SGE], wr_id: int) -> None:
        from pyverbs.wr import SGE as _SGE
        from pyverbs.wr import RecvWR

        pd = self.pd

        def post() -> None:
            sg = [_SGE(s.mr.addr + s.offset, s.length, s.mr.lkey) for s in sges] or [pd.scratch_sge()]
            self._qp.post_recv(RecvWR(wr_id=wr_id, num_sge=len(sg), sg=sg))

        self._posted("post_recv", post, f"receive queue full ({self.cap.max_recv_wr} WRs posted)")

    def _posted(self, what: str, post: Callable[[], None], full: str) -> None:
        try:
            call(what, post)
        except EasyVerbsError as exc:
            if exc.errno == errno.ENOMEM:  # what ibv_post_send/recv return for a full queue
                raise EasyVerbsError(f"{what}: {full}", errno.ENOMEM) from exc
            raise

    def _close_impl(self) -> None:
        self._qp.close()
