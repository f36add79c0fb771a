"""Revocable remote access on real verbs: type 1 memory windows (`PD.reg_mr(..., revocable=True)`).

An MR registered revocable grants no remote access under its own rkey: it is registered with local access
and MW_BIND only, and remote access goes through a type 1 memory window bound over the whole MR. Taking the
access back (`MR.revoke_remote`) deallocates the window; giving it again (`MR.rekey`) allocates a fresh one and
binds it, under a new rkey. The memory stays registered (pinned) the whole time: on a NIC a registration pins
and maps every page (tens to hundreds of milliseconds per GiB), a window bind is one work request.

`ibv_bind_mw` posts a bind work request on a QP in RTS, so each PD that binds windows keeps one private RC
QP connected to itself, with its own CQ (`Binder`): no bind completion ever reaches the application's CQs, and
a bind is complete (or failed) when `bind` returns. Type 1 windows are valid from every QP of the PD, as the MR's
own rkey would have been.

What rxe (Linux 6.1) does differently, and why windows are off there by default (`PyverbsContext.memory_windows`):
its responder checks a WRITE's key once, on the first packet, and then holds the MR, not the window, so a
multi-packet WRITE admitted before the window's dealloc may finish after it; deregistering the MR instead waits
for that WRITE. NICs translate each packet through the key (not verified here: no NIC). Its window bounds are
not checked either (DEVICE_DIFFERENCES in tests/test_verbs_conformance.py); these windows cover the whole MR.
"""
from __future__ import annotations

import os
import threading
from typing import Any

from ..enums import Access, WCStatus
from ..errors import EasyVerbsError, PollTimeout, UsageError

#: a bind is a local work request: this bounds the wait for its completion
BIND_TIMEOUT_S = 5.0
_REMOTE = int(Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC)


def windows_wanted(device_has: bool, soft_roce: bool) -> bool:
    """PyverbsContext.memory_windows at open: EASYPYVERBS_MEMORY_WINDOWS (on, off, auto: the default)."""
    how = os.environ.get("EASYPYVERBS_MEMORY_WINDOWS", "auto").strip().lower() or "auto"
    if how not in ("on", "off", "auto"):
        raise UsageError(f"EASYPYVERBS_MEMORY_WINDOWS={how!r}: expected on, off or auto")
    if how == "auto":
        return device_has and not soft_roce
    return how == "on" and device_has


def registration_access(access: int, e: Any) -> int:
    """What a revocable MR with `access` is registered with: its local bits and MW_BIND, no remote bits."""
    return (access & ~_REMOTE) | int(e.IBV_ACCESS_MW_BIND)


def remote_bits(access: int) -> int:
    return access & _REMOTE


class Binder:
    """One PD's private RC QP connected to itself, and its CQ, that binds type 1 windows (see the module). A bind
    that fails leaves the QP in ERR: the PD drops the binder then (`broken`) and makes a new one when next asked."""

    def __init__(self, pd: Any) -> None:
        from .pyverbs_provider import PyverbsCQ, PyverbsQP
        from ..types import QPCap

        self._lock = threading.Lock()
        self._next = 1
        self.broken = False
        self.cq = PyverbsCQ(pd.ctx, 4)
        try:
            self.qp = PyverbsQP(pd, self.cq, self.cq, QPCap(max_send_wr=2, max_recv_wr=1, max_send_sge=1, max_recv_sge=1))
            self.qp.connect(self.qp.info())
        except BaseException:
            self.cq.close()
            raise

    def bind(self, raw_pd: Any, raw_mr: Any, access: int) -> Any:
        """A new type 1 window over all of `raw_mr` (a pyverbs MR of `raw_pd`) with remote `access`, bound: returns
        the pyverbs MW (its `rkey` the new key). Raises EasyVerbsError naming the failure; nothing is left
        allocated then."""
        from pyverbs.mr import MW, MWBind, MWBindInfo

        from .pyverbs_provider import _call

        e = self.qp.e
        mw = _call("alloc_mw (type 1)", MW, raw_pd, e.IBV_MW_TYPE_1)
        try:
            with self._lock:
                wr_id, self._next = self._next, self._next + 1
                bind = MWBind(MWBindInfo(raw_mr, raw_mr.buf, raw_mr.length, access), e.IBV_SEND_SIGNALED, wr_id)
                _call("bind_mw", self.qp._qp.bind_mw, mw, bind)
                try:
                    (wc,) = self.cq.wait_n(1, BIND_TIMEOUT_S)
                except PollTimeout as exc:
                    raise EasyVerbsError(f"bind_mw: no completion within {BIND_TIMEOUT_S:g} s") from exc
                if wc.status != WCStatus.SUCCESS:
                    raise EasyVerbsError(f"bind_mw: completion {wc.status.name} (vendor error {wc.vendor_err})")
        except BaseException:
            self.broken = True
            mw.close()
            raise
        return mw

    def close(self) -> None:
        self.qp.close()
        self.cq.close()
