"""Revocable remote access on real verbs: type 1 memory windows (`PD.reg_mr(..., revocable=True)`).

An MR registered revocable grants no remote access under its own rkey: it is registered with local access
and MW_BIND only, and remote access goes through a type 1 memory window bound over the whole MR. Taking the
access back (`MR.revoke_remote`) deallocates the window; giving it again (`MR.rekey`) allocates a fresh one and
binds it, under a new rkey. The memory stays registered (pinned) the whole time: on a NIC a registration pins
and maps every page (not measured here: no NIC), a window bind is one work request.

`ibv_bind_mw` posts a bind work request on a QP in RTS, so each PD that binds windows keeps one private RC
QP connected to itself, with its own CQ (`Binder`): no bind completion ever reaches the application's CQs, and
a bind is complete (or failed) when `bind` returns. Type 1 windows are valid from every QP of the PD, as the MR's
own rkey would have been.

What is verified: on rxe0 (Linux 6.1, `make test`'s VM leg), a window's dealloc, like a deregistration, stops a
WRITE already under way: the bytes placed when `revoke_remote` returns are all that land, and the WRITE fails
with REM_ACCESS_ERR (tests/test_verbs_conformance.py `test_a_revoke_stops_a_write_already_under_way`, which is the
test to run on a NIC: none has been tried). rxe does not check a window's bounds (DEVICE_DIFFERENCES there); these
windows cover the whole MR. `EASYPYVERBS_MEMORY_WINDOWS=off` registers anew at each grant instead.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any

from ..enums import Access, WCStatus
from ..errors import EasyVerbsError, PollTimeout, UsageError

log = logging.getLogger("easypyverbs.pyverbs")

#: a bind is a local work request: this bounds the wait for its completion
BIND_TIMEOUT_S = 5.0
_REMOTE = int(Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC)


def windows_setting() -> bool:
    """EASYPYVERBS_MEMORY_WINDOWS: on (the default) or off; anything else is a usage error naming it."""
    how = os.environ.get("EASYPYVERBS_MEMORY_WINDOWS", "on").strip().lower() or "on"
    if how not in ("on", "off"):
        raise UsageError(f"EASYPYVERBS_MEMORY_WINDOWS={how!r}: expected on or off")
    return how == "on"


def windows_wanted(device_has: bool) -> bool:
    """PyverbsContext.memory_windows at open: where the device has windows, unless EASYPYVERBS_MEMORY_WINDOWS=off."""
    return windows_setting() and device_has


def registration_access(access: int, e: Any) -> int:
    """What a revocable MR with `access` is registered with: its local bits and MW_BIND, no remote bits."""
    return (access & ~_REMOTE) | int(e.IBV_ACCESS_MW_BIND)


def remote_bits(access: int) -> int:
    return access & _REMOTE


class Binder:
    """One PD's private RC QP connected to itself, and its CQ, that binds type 1 windows (see the module). A bind
    that fails leaves the QP in ERR: the binder closes itself then (`broken`) and the PD makes a new one when next
    asked. Binds and the close are serialised by one lock, so a QP is never used while it is destroyed."""

    def __init__(self, pd: Any) -> None:
        from .pyverbs_provider import PyverbsCQ, PyverbsQP
        from ..types import QPCap

        self._lock = threading.RLock()
        self._next = 1
        self.broken = False
        self.cq = PyverbsCQ(pd.ctx, 4)
        self.qp: Any = None
        try:
            self.qp = PyverbsQP(pd, self.cq, self.cq, QPCap(max_send_wr=2, max_recv_wr=1, max_send_sge=1, max_recv_sge=1))
            self.qp.connect(self.qp.info())
        except BaseException:
            self.close()
            raise

    def bind(self, raw_pd: Any, raw_mr: Any, access: int) -> Any:
        """A new type 1 window over all of `raw_mr` (a pyverbs MR of `raw_pd`) with remote `access`, bound: returns
        the pyverbs MW (its `rkey` the new key). Raises EasyVerbsError naming the failure; nothing is left
        allocated then."""
        from pyverbs.mr import MW, MWBind, MWBindInfo

        from .pyverbs_provider import _call

        with self._lock:
            if self.broken or self.qp is None or self.qp.closed:
                raise EasyVerbsError("bind_mw: the binder is closed")
            e = self.qp.e
            mw = _call("alloc_mw (type 1)", MW, raw_pd, e.IBV_MW_TYPE_1)
            try:
                wr_id, self._next = self._next, self._next + 1
                bind = _call("bind_mw (arguments)", lambda: MWBind(MWBindInfo(raw_mr, raw_mr.buf, raw_mr.length, access),
                                                                   e.IBV_SEND_SIGNALED, wr_id))
                _call("bind_mw", self.qp._qp.bind_mw, mw, bind)
                self._wait(wr_id)
            except BaseException:
                self.broken = True
                self.close()  # (first: a bind still outstanding is flushed with its QP before its window goes)
                mw.close()
                raise
        return mw

    def _wait(self, wr_id: int) -> None:
        """The completion of bind `wr_id`, within BIND_TIMEOUT_S (a failed one raises, naming its status)."""
        try:
            for wc in self.cq.wait_n(1, BIND_TIMEOUT_S):
                if wc.wr_id != wr_id:  # (cannot happen: a binder whose bind failed is not used again)
                    raise EasyVerbsError(f"bind_mw: completion of work request {wc.wr_id}, expected {wr_id}")
                if wc.status != WCStatus.SUCCESS:
                    raise EasyVerbsError(f"bind_mw: completion {wc.status.name} (vendor error {wc.vendor_err})")
        except PollTimeout as exc:
            raise EasyVerbsError(f"bind_mw: no completion within {BIND_TIMEOUT_S:g} s") from exc

    def close(self) -> None:
        with self._lock:
            self.broken = True
            if self.qp is not None:
                self.qp.close()
            self.cq.close()


class WindowedMR:
    """PyverbsMR's revoke_remote and rekey: through its window where registered revocable with windows on."""

    _windowed = False
    _mw: Any = None

    @property
    def windowed(self) -> bool:
        return self._windowed

    def revoke_remote(self) -> bool:
        with self._close_lock:  # type: ignore[attr-defined]  (a close waits for a revoke or rekey, and the reverse)
            self._check_open()  # type: ignore[attr-defined]
            if not self._windowed:
                return False
            self._drop_window()
            return True

    def rekey(self) -> int:
        with self._close_lock:  # type: ignore[attr-defined]
            self._check_open()  # type: ignore[attr-defined]
            if not self._windowed:
                return super().rekey()  # type: ignore[misc]
            if self._mw is not None:
                raise UsageError(f"pyverbs MR rkey {self.rkey:#x}: rekey needs its remote access revoked first "  # type: ignore[attr-defined]
                                 f"(revoke_remote)")
            pd, ctx = self.pd, self.pd.ctx  # type: ignore[attr-defined]
            if not ctx.memory_windows:  # (turned off since this MR was registered: register anew)
                raise EasyVerbsError(f"pyverbs: {ctx.name}: memory windows are off")
            try:
                self._mw = pd.bind_window(self._mr, remote_bits(int(self.access)))  # type: ignore[attr-defined]
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
        from .pyverbs_provider import _call

        if self._mw is not None:
            _call("dealloc_mw", self._mw.close)
            self._mw = None
