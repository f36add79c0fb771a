"""An RC connection in one call: PD, CQs and QP made, descriptors swapped over a bootstrap socket."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional

from .api import CQ, MR, PD, QP, Context
from .bootstrap import BootstrapConn
from .capabilities import AttachToken
from .errors import BootstrapError, EasyVerbsError
from .resource import Resource
from .types import QPCap, QPInfo, RemoteMR


@dataclasses.dataclass
class RCConnection:
    """One connected RC QP with its CQs, the peer's MR descriptors and extra fields."""

    ctx: Context
    pd: PD
    send_cq: CQ
    recv_cq: CQ
    qp: QP
    bootstrap: BootstrapConn
    remote_mrs: Dict[str, RemoteMR]
    peer_extra: Dict[str, Any]
    own_pd: bool = True
    owns_bootstrap: bool = True
    owns_cqs: bool = True

    def close(self) -> None:
        """Close the QP (draining posted sends), CQs, the PD if it was made here, and the socket."""
        self.qp.close()
        if self.owns_cqs:
            self.send_cq.close()
            self.recv_cq.close()
        if self.own_pd:
            self.pd.close()
        if self.owns_bootstrap:
            self.bootstrap.close()

    def abort(self) -> None:
        self.qp.abort()
        self.close()

    def __enter__(self) -> "RCConnection":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def establish(
    ctx: Context,
    conn: BootstrapConn,
    mrs: Optional[Mapping[str, MR]] = None,
    extra: Optional[Dict[str, Any]] = None,
    cap: QPCap = QPCap(),
    cqe: int = 4096,
    pd: Optional[PD] = None,
    timeout_s: float = 10.0,
    owns_bootstrap: bool = True,
    cq: Optional[CQ] = None,
) -> RCConnection:
    """Create a QP, swap QPInfo + MR descriptors + `extra` with the peer, connect, and barrier.

    Both sides call it on their ends of `conn`. MRs in `mrs` must belong to `pd` (if given).
    With `owns_bootstrap=False` the connection's close leaves `conn` open for further use. With `cq`,
    that CQ (not owned) takes both send and receive completions, e.g. one CQ for several QPs.
    """
    own_pd = pd is None
    pd = pd or ctx.alloc_pd()
    made: List[Resource] = []
    try:
        if cq is not None:
            send_cq = recv_cq = cq
        else:
            send_cq = ctx.create_cq(cqe)
            made.append(send_cq)
            recv_cq = ctx.create_cq(cqe)
            made.append(recv_cq)
        qp = pd.create_qp(send_cq, recv_cq, cap)
        made.append(qp)
        if conn.sealed and isinstance(qp, AttachToken):  # (its data connection's token from the session)
            qp.bind_attach(conn.attach_token)
        info = qp.info()
        host, _, port = info.gid.rpartition(":")
        if info.provider == "soft" and host in ("0.0.0.0", "::", "[::]"):
            info = dataclasses.replace(info, gid=f"{conn.local[0]}:{port}")
        mine = {"qp": info.to_dict(), "mrs": {k: m.remote().to_dict() for k, m in (mrs or {}).items()},
                "extra": extra or {}}
        theirs = conn.exchange(mine, timeout_s)
        if not isinstance(theirs.get("mrs"), dict) or not isinstance(theirs.get("extra", {}), dict):
            raise BootstrapError("peer's connection descriptor lacks 'mrs' or has a bad 'extra'")
        remote_info = QPInfo.from_dict(theirs.get("qp"))
        remote_mrs = {str(k): RemoteMR.from_dict(v) for k, v in theirs["mrs"].items()}
        qp.connect(remote_info, timeout_s, conn.patient_until)
        ack = conn.exchange({"ready": True}, timeout_s)  # both QPs in RTS before either side posts
        if ack.get("ready") is not True:
            raise BootstrapError("peer did not confirm the connection")
        return RCConnection(ctx, pd, send_cq, recv_cq, qp, conn, remote_mrs, theirs.get("extra", {}), own_pd,
                            owns_bootstrap, cq is None)
    except (EasyVerbsError, OSError):
        for r in reversed(made):
            r.abort()
        if own_pd:
            pd.close()
        raise
