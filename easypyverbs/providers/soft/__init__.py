"""The soft provider: RC verbs emulated in user space over TCP, or shared memory between processes of one host
(no RDMA NIC needed).

It is an emulation and says so: `Context.emulated` is True and its label is
"soft (emulated verbs, not RDMA)"; a QP's `data_path` says how its payloads move (tcp or same-host).
Semantics follow RC: per-QP ordering, WRITE placement with no
remote completion, WRITE_WITH_IMM and SEND consuming posted receives, RNR, remote access checks
against registered MRs, error completions and flushing. Data lands with `recv_into` straight in the
target MR.
"""
from .context import SoftContext
from .link import LinkModel

__all__ = ["SoftContext", "LinkModel"]
