"""The federation wrapper's receive side (federation/wrapper.py): each complete message from the channel is
checked (for this job and this party, from the party its connection proved) and stored for FATE's get.

A message is stored by the thread that completed it (Endpoint.on_message: the connection's, or the soft
NIC's), so FATE's waiting get wakes without a hand-off to the receive loop's thread first (0.2-0.6 ms a
message on a busy 2-core machine, traced: `bench fate --trace`, c_deliver to stored), unless it would have to
be copied out of its receive slot (a slot that cannot be lent) and is larger than INLINE_COPY_BYTES: such a
copy would hold that thread (the connection's turn, the NIC's answers), so it goes through the loop, as
every message did before.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from .. import trace
from ..channel.buffers import GIL_COPY_BYTES
from ..errors import ConfigError, TransferTimeout
from .config import party_key

if TYPE_CHECKING:
    from ..channel import Endpoint
    from ..channel.buffers import RecvBuffers
    from .config import RdmaFederationConfig
    from .store import Store

log = logging.getLogger("fate_rdma.federation")

#: the largest copy out of a receive slot made in the thread that completed the message (larger: the loop's):
#: one short enough to hold the GIL for (buffers.GIL_COPY_BYTES, ~0.1 ms), so short enough to hold that thread
INLINE_COPY_BYTES = GIL_COPY_BYTES


class Receiving:
    """RdmaFederation's receive side (a mixin: the state is the wrapper's)."""

    _lent_lock = threading.Lock()  # (stats["lent_bytes"] is counted from several threads)
    # the wrapper's state this side uses (set in RdmaFederation.__init__)
    fed: Any
    cfg: RdmaFederationConfig
    local: Tuple[str, ...]
    announce: bool
    endpoint: Endpoint
    stats: Dict[str, float]
    put_copies: RecvBuffers
    _party_at: Dict[str, str]
    _store: Store
    _stop: bool

    def _take_inline(self, msg: Any) -> bool:
        """Endpoint.on_message: store `msg` now (True) unless that needs a copy of more than INLINE_COPY_BYTES
        or the wrapper is closing (False: the loop takes it). Never raises: a failure fails the gets."""
        if self._stop:
            return False
        try:
            return self._take(msg, INLINE_COPY_BYTES)
        except Exception as exc:  # as the loop's own failure: every waiting and later get learns why at once
            msg.release()  # (the slot goes back; idempotent)
            self._rx_failed(exc.with_traceback(None))  # (kept by the store: not with this frame and `msg`)
            return True

    def _receive(self) -> None:
        try:
            while not self._stop:
                # put copies unused for pool_idle_s are let go of (as the endpoint's idle slots and buffers)
                self.put_copies.trim(self.cfg.channel.pool_idle_s)
                try:
                    msg = self.endpoint.recv(timeout=0.5)
                except TransferTimeout:
                    continue
                self._take(msg)
                del msg  # not held while the loop waits: its buffer is recycled once FATE lets go of it
        except BaseException as exc:  # every waiting get() learns why at once, instead of timing out
            self._rx_failed(exc)

    def _rx_failed(self, exc: BaseException) -> None:
        if not self._stop:
            log.error("fate-rdma: receive loop of %s failed; pending and later gets fail: %r",
                      party_key(self.local), exc)
        self._store.fail(exc)

    def _take(self, msg: Any, copy_up_to: Optional[int] = None) -> bool:
        """Store one complete message for its get (or say why not, and let it go): True; False (nothing done)
        where that needs a copy of more than `copy_up_to` bytes."""
        md = msg.metadata if isinstance(msg.metadata, dict) else {}
        key: Any = md.get("id")
        if bool(md.get("announce")) != self.announce:  # nobody would take it: say why, let it go
            self._mismatch(md, msg.peer)
            msg.release()
            return True
        if self.announce:
            key, why = self._announced_key(md, msg.peer)
            if key is None:
                log.warning("fate-rdma: dropped transfer %d from %s: %s", msg.transfer_id, msg.peer, why)
                msg.release()
                return True
        data = msg.detach(copy_up_to)  # FATE (or a frame's arrays) use it in place: a FedRDMA-E slot lent, or copied
        if data is None:
            return False
        if msg.lent:
            with self._lent_lock:
                self.stats["lent_bytes"] += data.nbytes
        trace.event("stored", tid=msg.transfer_id, peer=msg.peer, name=md.get("name"), tag=md.get("tag"),
                    src=md.get("src"))
        if isinstance(key, tuple):
            self._store.put(key, (md, data))
        elif isinstance(key, str):
            self._store.put(key, data)
        else:
            log.warning("fate-rdma: dropped transfer %d from %s: its metadata carries no payload id",
                        msg.transfer_id, msg.peer)
        return True

    def _mismatch(self, md: Dict[str, Any], peer: str) -> None:
        """A peer that resolved `descriptors` differently: say so; with channel descriptors here, the get
        waiting for that object fails at once instead of after pull_timeout_s."""
        mine, theirs = ("channel", "fate") if self.announce else ("fate", "channel")
        err = ConfigError(f"fate-rdma: party {self._party_at.get(peer, peer)} sends with descriptors: {theirs}, party "
                          f"{party_key(self.local)} receives with descriptors: {mine}: set the same descriptors (and "
                          "secret_file, tls, fallback) at every party")
        log.error("%s", err)
        name, tag, src = md.get("name"), md.get("tag"), self._party_at.get(peer)
        ours = md.get("session") == self.fed.session_id and md.get("dst") == party_key(self.local)
        if self.announce and ours and isinstance(name, str) and isinstance(tag, str) and src == md.get("src"):
            self._store.put(("obj", self.fed.session_id, name, tag, src), err)

    def _announced_key(self, md: Dict[str, Any], peer: str) -> Tuple[Optional[tuple], str]:
        """The store key of an object announced over the channel (descriptors: channel), or None and why not:
        it must be for this party and this job, from the party whose endpoint the connection proved."""
        name, tag, src = md.get("name"), md.get("tag"), md.get("src")
        if not (isinstance(name, str) and isinstance(tag, str) and isinstance(src, str)):
            return None, "its metadata lacks a name, tag or source party"
        if md.get("session") != self.fed.session_id or md.get("dst") != party_key(self.local):
            return None, f"it is for session {md.get('session')!r}, party {md.get('dst')!r}, not this one"
        if self._party_at.get(peer) != src:
            return None, f"it names party {src!r}, but came from {peer} ({self._party_at.get(peer) or 'no party'})"
        return ("obj", md["session"], name, tag, src), ""
