"""Soft provider: what the parts of the emulation see of each other, as small ports (`typing.Protocol`), so that
no module imports one that imports it back and each part can be driven against a fake.

SoftContext (context.py) is the `NIC` its QPs use, and its SoftMR the `TargetMR` a responder places a peer's
request in; SoftQP (qp.py) is the `Attachable` QP the NIC attaches a peer's requester to, and the `QPPort` its two
halves, the requester (requester.py) and the responder (responder.py), use.
"""
from __future__ import annotations

import threading
from typing import Tuple, Any, Deque, Optional, Protocol

from ...enums import Access, QPState, WCStatus
from ...tls import MutualTLS
from ...types import QPCap
from .cq import SoftCQ
from .landing import WriteDigests
from .link import Link, LinkModel


class TargetMR(Protocol):
    """An MR as the responder checks a peer's request against it and places the request's bytes (SoftMR)."""

    @property
    def pd(self) -> object: ...

    @property
    def access(self) -> Access: ...

    @property
    def addr(self) -> int: ...

    @property
    def length(self) -> int: ...

    @property
    def landing(self) -> Optional[WriteDigests]:
        """The digests of the WRITEs landing in it, where tracked (MR.track_writes)."""

    def begin_remote(self, rkey: int, offset: int, length: int) -> Optional[memoryview]:
        """The view a WRITE under `rkey` may fill now, or None; pair with `end_remote`."""

    def end_remote(self) -> None: ...

    def remote_view(self, rkey: int, offset: int, length: int) -> Optional[memoryview]:
        """The view a READ under `rkey` may read now, or None."""


class Attachable(Protocol):
    """A QP as the NIC sees it when a peer's requester dials it (SoftQP)."""

    @property
    def token(self) -> bytes:
        """What the peer must name to attach (handed out in QPInfo only)."""

    @property
    def awaits_host(self) -> Optional[str]:
        """The peer NIC's host once connect() named it, while no peer has attached: where its dial comes from."""

    def attach_responder(self, sock: Any, src_qpn: int, psn: int, fwd_delay_s: float,
                         pull_pid: int = 0, push: bool = False, defer_ack: bool = False) -> bool:
        """Serve the peer's requests arriving on `sock`; False if the QP takes none (closing, failed, attached)."""


class NIC(Protocol):
    """The emulated NIC (SoftContext) as its QPs use it."""

    @property
    def link_model(self) -> LinkModel: ...

    @property
    def link(self) -> Optional[Link]:
        """The emulated link, where the link model is active."""

    @property
    def tls(self) -> Optional[MutualTLS]: ...

    @property
    def same_host(self) -> bool: ...

    @property
    def nic_address(self) -> str: ...

    @property
    def source(self) -> Optional[Tuple[str, int]]:
        """The local address its QPs dial from (None: the kernel's choice)."""

    @property
    def max_msg_bytes(self) -> int: ...

    @property
    def rnr_timeout_s(self) -> float: ...

    @property
    def retry_timeout_s(self) -> float: ...

    def add_qp(self, qp: Attachable) -> int:
        """Enter `qp` in the QP table: its QP number."""

    def remove_qp(self, qpn: int) -> None: ...

    def mr_by_rkey(self, rkey: int) -> Optional[TargetMR]: ...


class QPPort(Protocol):
    """A QP (SoftQP) as its requester and responder halves use it: its resources, the lock that guards its state
    (one lock, three conditions: SoftQP says why), that state, its posted receives and its error handling."""

    @property
    def qpn(self) -> int: ...

    @property
    def cap(self) -> QPCap: ...

    @property
    def pd(self) -> object: ...

    @property
    def nic(self) -> NIC: ...

    @property
    def send_cq(self) -> SoftCQ: ...

    @property
    def recv_cq(self) -> SoftCQ: ...

    @property
    def cv(self) -> threading.Condition:
        """Close's drain and state changes."""

    @property
    def tx_cv(self) -> threading.Condition:
        """The send thread's: a WR queued, a doorbell write's rest."""

    @property
    def recv_cv(self) -> threading.Condition:
        """A responder's waiting for a posted receive."""

    @property
    def st(self) -> QPState:
        """The QP's state (under `cv`), as its own threads see it: ERR once it failed."""

    @property
    def closing(self) -> bool: ...

    #: set before an error completion is pushed (the QP reads ERR from then on; the flush follows)
    err_seen: bool

    @property
    def recv_q(self) -> Deque[Any]:
        """The posted receives, (wr_id, SGEs) each, oldest first (under `cv`)."""

    def fail(self, status: WCStatus, why: str) -> None:
        """Error the QP after the completions already due (keeps completion order)."""

    def enter_error(self, first_status: WCStatus, why: str) -> None:
        """Error the QP now: the oldest WR outstanding completes with `first_status`, every other is flushed."""

    def awaits_answers(self) -> bool:
        """Do requests of this QP's requester await the peer's answer?"""
