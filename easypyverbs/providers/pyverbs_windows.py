"""Revocable remote access on real verbs: type 1 memory windows (`PD.reg_mr(..., revocable=True)`).

An MR registered revocable grants no remote access under its own rkey: it is registered with local access
and MW_BIND only, and remote access goes through a type 1 memory window bound over the whole MR. Taking the
access back (`MR.revoke_remote`) deallocates the window; giving it again (`MR.rekey`) allocates a fresh one and
binds it, under a new rkey. The memory stays registered (pinned) the whole time: on a NIC a registration pins
and maps every page (not measured here: no NIC), a window bind is one work request.

`ibv_bind_mw` posts a bind work request on a QP in RTS, so each PD that binds windows keeps one private RC
QP connected to itself, with its own CQ (`Binder`, which the PD hands them: PyverbsPD.bind_window): no bind
completion ever reaches the application's CQs, and a bind is complete (or failed) when `bind` returns. Type 1
windows are valid from every QP of the PD, as the MR's own rkey would have been. PyverbsMR (pyverbs_provider.py)
takes remote access back and gives it again through its PD's binder.

What is verified: on rxe0 (Linux 6.1, `make test`'s VM leg), a window's dealloc, like a deregistration, stops a
WRITE already under way: the bytes placed when `revoke_remote` returns are all that land, and the WRITE fails
with REM_ACCESS_ERR (tests/test_verbs_conformance.py `test_a_revoke_stops_a_write_already_under_way`, which is the
test to run on a NIC: none has been tried). rxe does not check a window's bounds (DEVICE_DIFFERENCES there); these
windows cover the whole MR. `EASYPYVERBS_MEMORY_WINDOWS=off` registers anew at each grant instead.
"""
from __future__ import annotations

import os
import threading
from typing import Any, List, Protocol

from ..enums import Access, WCStatus
from ..errors import EasyVerbsError, PollTimeout, UsageError
from ..types import WC, QPInfo
from .pyverbs_call import call

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


class BinderCQ(Protocol):
    """The binder's CQ (a PyverbsCQ) as the binder uses it."""

    def wait_n(self, n: int, timeout_s: float) -> List[WC]: ...

    def close(self) -> None: ...


class BinderQP(Protocol):
    """The binder's QP (a PyverbsQP of the PD, on the binder's CQ) as the binder uses it."""

    @property
    def e(self) -> Any:
        """pyverbs' enums."""

    @property
    def closed(self) -> bool: ...

    def info(self) -> QPInfo: ...

    def connect(self, remote: QPInfo) -> None: ...

    def bind_mw(self, mw: Any, bind: Any) -> None:
        """Post the bind of pyverbs MW `mw` (a pyverbs MWBind)."""

    def close(self) -> None: ...


class Binder:
    """One PD's private RC QP connected to itself, and its CQ, that binds type 1 windows (see the module). A bind
    that fails leaves the QP in ERR: the binder closes itself then (`broken`) and the PD makes a new one when next
    asked. Binds and the close are serialised by one lock, so a QP is never used while it is destroyed."""

    def __init__(self, cq: BinderCQ, qp: BinderQP) -> None:
        """Takes `qp` and its CQ `cq` (new, for the binder alone: it closes them) and connects `qp` to itself; both
        are closed if that fails."""
        self._lock = threading.RLock()
        self._next = 1
        self.broken = False
        self.cq = cq
        self.qp = qp
        try:
            self.qp.connect(self.qp.info())
        except BaseException:
            self.close()
            raise

    def bind(self, raw_pd: Any, raw_mr: Any, access: int) -> Any:
        """A new type 1 window over all of `raw_mr` (a pyverbs MR of `raw_pd`) with remote `access`, bound: returns
        the pyverbs MW (its `rkey` the new key). Raises EasyVerbsError naming the failure; nothing is left
        allocated then."""
        from pyverbs.mr import MW, MWBind, MWBindInfo

        with self._lock:
            if self.broken or self.qp.closed:
                raise EasyVerbsError("bind_mw: the binder is closed")
            e = self.qp.e
            mw = call("alloc_mw (type 1)", MW, raw_pd, e.IBV_MW_TYPE_1)
            try:
                wr_id, self._next = self._next, self._next + 1
                bind = call("bind_mw (arguments)",
                            lambda: MWBind(MWBindInfo(raw_mr, raw_mr.buf, raw_mr.length, access), e.IBV_SEND_SIGNALED,
                                           wr_id))
                call("bind_mw", self.qp.bind_mw, mw, bind)
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
            self.qp.close()
            self.cq.close()

