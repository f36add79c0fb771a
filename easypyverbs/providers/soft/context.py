"""Soft provider: context (the emulated NIC), PD and MR (the CQ: cq.py; the QP: qp.py)."""
from __future__ import annotations

import errno
import hmac
import logging
import os
import secrets
import socket
import struct
import threading
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ... import stalls
from ...admission import Admission, is_loopback
from ...bootstrap import source_address
from ...api import CQ, MR, PD, QP, SOFT_LABEL, Context
from ...enums import Access
from ...errors import EasyVerbsError, UsageError
from ...tls import TLS_RECORD_HANDSHAKE, MutualTLS, TLSStream, first_byte, handshake
from ...types import DeviceInfo, PortInfo, QPCap
from . import samehost, shm, wire
from .cq import SoftCQ
from .link import Link, LinkModel
from .landing import WriteDigests
from .port import Attachable
from .qp import SoftQP

log = logging.getLogger("easypyverbs.soft")

#: rkeys drawn from the OS at a time (_new_key)
KEY_BATCH = 256


def _listen(host: str, ports: Optional[Tuple[int, int]]) -> socket.socket:
    """The NIC's data listener on `host`: the first free port of `ports` (low, high, inclusive), else any."""
    if ports is None:
        return socket.create_server((host, 0), backlog=128)
    low, high = ports
    if not 0 < low <= high < 65536:
        raise UsageError(f"soft NIC data ports must be a range within 1-65535, got {low}-{high}")
    for port in range(low, high + 1):
        try:
            return socket.create_server((host, port), backlog=128)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise EasyVerbsError(f"soft NIC: cannot listen on {host}:{port}: {exc}", exc.errno) from exc
    raise EasyVerbsError(f"soft NIC: every data port of {low}-{high} on {host} is in use ({high - low + 1} port(s), "
                         f"one per process with an endpoint at once); widen the range (soft_data_ports)",
                         errno.EADDRINUSE)


class SoftContext(Context):
    """An emulated NIC: a TCP listener that peers' QPs dial, plus the MR and QP tables."""

    provider = "soft"
    emulated = True
    tracks_writes = True  # (its MRs: capabilities.PlacesWrites)
    pins_memory = False  # (the emulated NIC reads and writes the memory as this process does)

    def __init__(
        self,
        bind_host: str = "127.0.0.1",
        advertise_host: Optional[str] = None,
        link: Optional[LinkModel] = None,
        max_msg_bytes: int = 1 << 30,
        rnr_timeout_s: float = 2.0,
        # the emulated NIC answers from a thread of the peer's Python process, so anything that holds
        # the peer's GIL (a large pickle, a copy into fresh memory) delays its answers; a real NIC
        # answers from hardware. 30 s matches the channel's default no-progress deadline.
        retry_timeout_s: float = 30.0,
        same_host: Optional[bool] = None,
        # mutual TLS on every data connection, both ways (links that are not private); None = plaintext
        tls: Optional[MutualTLS] = None,
        # the caller's expected peers (the job's parties): admitted ahead of strangers (easypyverbs.admission)
        known_sources: Optional[Callable[[str], bool]] = None,
        # the data listener's port: the first free one of (low, high), for a firewall's rules; None = any
        ports: Optional[Tuple[int, int]] = None,
    ) -> None:
        self._listener = _listen(bind_host, ports)  # (first: a NIC that cannot listen is not opened at all)
        super().__init__("soft0")
        self.tls = tls
        self.link_model = link or LinkModel()
        self.link = Link(self.link_model) if self.link_model.active else None
        # same-host path (samehost.py): on unless switched off, and never under a link model (a WAN)
        want = samehost.enabled_by_env() if same_host is None else same_host
        ok, why = samehost.self_test() if want else (False, "switched off")
        if want and ok and self.link is not None:
            ok, why = False, "a link model is set (an emulated WAN)"
        self.same_host, self.same_host_why = ok, why
        self._max_msg_bytes = max_msg_bytes
        self.rnr_timeout_s = rnr_timeout_s
        stalls.ensure_watching()  # the receive-queue wait counts no time this process was held (stalls.py)
        self.retry_timeout_s = retry_timeout_s
        self._lock = threading.Lock()
        # data connections being attached at once (easypyverbs.admission): strangers 32, one address 8 of them
        # (on loopback, one address for every local process: all), and 32 more for the hosts whose dials a QP
        # awaits or that attached a QP before, which a flood from any number of addresses cannot take
        self._known_hosts: Set[str] = set()
        self._known_sources = known_sources
        self._hellos = Admission(32, 32 if is_loopback(bind_host) else 8, self._expected, 32)
        self._mrs: Dict[int, Optional["SoftMR"]] = {}  # rkey -> MR (None: reserved, being registered)
        self._keys: List[int] = []  # unused random rkeys (_new_key), drawn by process _keys_pid
        self._keys_pid = 0
        self._qps: Dict[int, Attachable] = {}
        self._next_qpn = 0x100 + secrets.randbelow(0x1000)
        port = self._listener.getsockname()[1]
        self.nic_address = f"{advertise_host or bind_host}:{port}"
        #: where this NIC's QPs dial their peers from (bootstrap.source_address)
        self.source = source_address(bind_host)
        self._acceptor = threading.Thread(target=self._accept_loop, name="soft-nic-accept", daemon=True)
        self._acceptor.start()
        log.info("opened %s at %s (link: %s)%s", SOFT_LABEL, self.nic_address, self.link_model.describe(),
                 ", data connections over mutual TLS 1.3" if tls else "")
        if tls is not None and self.same_host:
            log.info("soft NIC %s: transfers to a peer on this host take the same-host path: payloads are copied "
                     "between the two processes' memory (process_vm_readv) and cross no network; only request "
                     "headers and answers travel over TLS", self.nic_address)

    # -- tables ---------------------------------------------------------------------------------
    def _new_key(self) -> int:
        """An unused, unpredictable rkey (under `_lock`): 32 bits of the OS's randomness, drawn KEY_BATCH at a
        time (one system call per registration was a tenth of its cost); a child made by fork() draws its own
        rather than hand out the keys its parent would hand out next."""
        while True:
            if not self._keys or self._keys_pid != os.getpid():
                self._keys = list(struct.unpack(f"<{KEY_BATCH}I", os.urandom(4 * KEY_BATCH)))
                self._keys_pid = os.getpid()
            k = self._keys.pop()
            if k and k not in self._mrs:
                return k

    def register_mr(self, make: Callable[[int], "SoftMR"]) -> "SoftMR":
        """`make(key)` with a fresh key, entered in the MR table. The key is reserved under the lock and the MR
        built outside it (the responders take the lock for every request; and a collection during the build
        may run finalizers that take it)."""
        with self._lock:
            key = self._new_key()
            self._mrs[key] = None  # reserved: names no MR yet (mr_by_rkey)
        try:
            mr = make(key)
        except BaseException:
            with self._lock:
                self._mrs.pop(key, None)
            raise
        with self._lock:
            self._mrs[key] = mr
        return mr

    def rekey_mr(self, mr: "SoftMR") -> int:
        """Enter `mr` in the MR table under a fresh key (returned) in place of the one it had."""
        with self._lock:
            self._drop(mr)
            key = self._new_key()
            self._mrs[key] = mr
        return key

    def _drop(self, mr: "SoftMR") -> None:
        """(under `_lock`) `mr`'s table entry gone, if it still has one: its key, once revoked, may name another
        MR since"""
        if self._mrs.get(mr.rkey) is mr:
            del self._mrs[mr.rkey]

    def remove_mr(self, mr: "SoftMR") -> None:
        with self._lock:
            self._drop(mr)

    def mr_by_rkey(self, rkey: int) -> Optional["SoftMR"]:
        with self._lock:
            return self._mrs.get(rkey)

    def add_qp(self, qp: Attachable) -> int:
        with self._lock:
            qpn = self._next_qpn
            self._next_qpn = (self._next_qpn + 1) & 0xFFFFFF or 1
            self._qps[qpn] = qp
            return qpn

    def remove_qp(self, qpn: int) -> None:
        with self._lock:
            self._qps.pop(qpn, None)

    # -- the NIC --------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # listener closed
            try:
                source = str(sock.getpeername()[0])
            except OSError:
                sock.close()
                continue
            done = self._hellos.admit(source)
            if done is None:  # bounded: no thread per stranger
                sock.close()
                continue
            threading.Thread(target=self._handshake, args=(sock, source, done), name="soft-nic-hello",
                             daemon=True).start()

    def _expected(self, source: str) -> bool:
        """A host that attached a QP here before, or whose dial a QP awaits."""
        if source in self._known_hosts or (self._known_sources is not None and self._known_sources(source)):
            return True
        with self._lock:
            qps = list(self._qps.values())
        return any(qp.awaits_host == source for qp in qps)

    def _tls_accept(self, sock: socket.socket, timeout_s: float) -> TLSStream:
        """The TLS side of an accepted connection; a plaintext HELLO is answered HELLO_TLS_REQUIRED (in
        plaintext, so the peer can say why) and refused."""
        assert self.tls is not None
        if first_byte(sock, timeout_s) == wire.HELLO_MAGIC[:1]:
            wire.recv_exactly(sock, wire.HELLO.size)
            sock.sendall(wire.HELLO_REPLY.pack(wire.HELLO_MAGIC, wire.VERSION, 2, wire.HELLO_TLS_REQUIRED, 0))
            raise EasyVerbsError("refused a plaintext connection: this NIC takes TLS connections only")
        try:
            return TLSStream(handshake(sock, self.tls.server, True, timeout_s), timeout_s)
        except (OSError, TimeoutError) as exc:
            raise EasyVerbsError(f"TLS handshake failed: {exc}") from exc

    def _handshake(self, sock: Any, source: str, done: Callable[[], None]) -> None:
        try:
            sock.settimeout(5.0)
            if self.tls is not None:
                sock = self._tls_accept(sock, 5.0)
            raw = wire.recv_exactly(sock, wire.HELLO.size)
            (magic, version, kind, flags, src_qpn, dst_qpn, psn, fwd_delay_us, token, pid, probe_addr,
             probe) = wire.HELLO.unpack(raw)
            if magic != wire.HELLO_MAGIC or version != wire.VERSION or kind != 1:
                tls = raw[:1] == TLS_RECORD_HANDSHAKE
                raise EasyVerbsError("not a soft-verbs HELLO" + (" but a TLS ClientHello: the peer has TLS on, this "
                                                                  "NIC has it off" if tls else ""))
            with self._lock:
                qp = self._qps.get(dst_qpn)
            status = wire.HELLO_OK if qp is not None else wire.HELLO_NO_QP
            if qp is not None and not hmac.compare_digest(token, qp.token):
                status = wire.HELLO_BAD_TOKEN
            pull_pid = 0
            if (status == wire.HELLO_OK and flags & wire.FLAG_SAME_HOST and self.same_host and fwd_delay_us == 0
                    and samehost.usable(pid, probe_addr, probe) and samehost.same_network_namespace(pid)
                    and samehost.peer_owns(pid, sock)):  # (the probe alone: a peer could plant it in a third process)
                pull_pid = pid  # the requester's memory is readable from here: take its bytes directly
            # (not within one process: its requester would decline a push into its own memory)
            push = bool(pull_pid and pull_pid != os.getpid() and flags & wire.FLAG_PUSH and shm.push_enabled())
            # answers deferred (wire.py): a plain socket, answers not delayed by a link model
            defer = bool(flags & wire.FLAG_DEFER_ACK and self.tls is None and fwd_delay_us == 0 and self.link is None
                         and wire.defer_ack_enabled())
            # (HELLO_OK: `qp` is not None)
            if status == wire.HELLO_OK and qp is not None \
                    and not qp.attach_responder(sock, src_qpn, psn, fwd_delay_us / 1e6, pull_pid, push, defer):
                status = wire.HELLO_BUSY
            ok = status == wire.HELLO_OK
            if ok and len(self._known_hosts) < 1024:
                self._known_hosts.add(source)
            reply_flags = (wire.FLAG_SAME_HOST | (wire.FLAG_PUSH if push else 0)) if pull_pid and ok else 0
            reply_flags |= wire.FLAG_DEFER_ACK if defer and ok else 0
            sock.sendall(wire.HELLO_REPLY.pack(wire.HELLO_MAGIC, wire.VERSION, 2, status, reply_flags))
            if status != wire.HELLO_OK:
                sock.close()
            if status != wire.HELLO_OK:
                log.warning("soft NIC %s: refused to attach a peer to QP %d: %s", self.nic_address, dst_qpn,
                            {wire.HELLO_NO_QP: "no such QP", wire.HELLO_BUSY: "already connected",
                             wire.HELLO_BAD_TOKEN: "wrong attach token"}[status])
        except (OSError, EasyVerbsError, wire.PeerClosed) as exc:
            log.warning("soft NIC %s: rejected a connection: %s", self.nic_address, exc)
            sock.close()
        finally:
            done()

    # -- verbs ----------------------------------------------------------------------------------
    def _alloc_pd(self) -> PD:
        return _SoftPD(self)

    def _create_cq(self, cqe: int) -> CQ:
        return SoftCQ(self, cqe)

    def _query(self) -> DeviceInfo:
        port = PortInfo(1, "ACTIVE", self.link_model.mtu, self._max_msg_bytes, 0, "Ethernet (TCP emulation)",
                        ((0, self.nic_address, "soft"),))
        return DeviceInfo("soft", self.name, True, 1 << 40, 1 << 15, 32, 1 << 20, (port,),
                          notes=f"{SOFT_LABEL}; link model: {self.link_model.describe()}")

    @property
    def max_msg_bytes(self) -> int:
        return self._max_msg_bytes

    @property
    def link_rate_bps(self) -> Optional[float]:
        return self.link_model.rate_bps

    def _close_impl(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._acceptor.join(timeout=5)


class _SoftPD(PD):
    ctx: SoftContext

    def _reg_mr(self, buffer: Any, view: memoryview, access: Access, revocable: bool = False) -> MR:
        # (every soft MR is revocable: SoftMR.revoke_remote, rekey)
        return self.ctx.register_mr(lambda key: SoftMR(self, buffer, view, access, key, key))

    def _create_qp(self, send_cq: CQ, recv_cq: CQ, cap: QPCap) -> QP:
        return SoftQP(self, send_cq, recv_cq, cap, self.ctx)


class SoftMR(MR):
    """A soft MR. Like a NIC's, its deregistration is final for remote access: a WRITE the emulated NIC
    is placing into it when it is closed finishes before `close` returns (the NIC completes or fails
    in-flight DMA before the deregistration completes), and no byte lands after that. The wait is
    bounded by the QP's receive timeout (a peer that stalls mid-WRITE fails its QP). The emulated NIC
    places the peer's WRITEs itself, so it is a capabilities.PlacesWrites: `track_writes`,
    `placing_after_close`."""

    pd: _SoftPD

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._remote = threading.Condition()
        self._placing = 0
        self._revoked = False
        self.landing: Optional[WriteDigests] = None
        #: closed while a WRITE was still being placed (past the bound): that WRITE may still change the
        #: memory, so no later registration of it should trust digests taken as bytes land
        self.placing_after_close = False

    def track_writes(self, origin: int, block_bytes: int, start: Callable[[int], Any]) -> Optional[WriteDigests]:
        """Tracking starts once no WRITE is being placed (one that began before it is not digested; its
        bytes are read from memory, or overwritten whole by a tracked WRITE), within the close bound."""
        with self._remote:
            if not self._remote.wait_for(lambda: self._placing == 0, timeout=self._bound()):
                raise EasyVerbsError(f"soft MR rkey {self.rkey:#x}: a remote WRITE is still being placed; "
                                     f"cannot start tracking WRITEs")
            self.landing = WriteDigests(self.view(), origin, block_bytes, start)
        return self.landing

    def _bound(self) -> float:
        return getattr(self.pd.ctx, "retry_timeout_s", 30.0) + 5.0

    def begin_remote(self, rkey: int, offset: int, length: int) -> Optional[memoryview]:
        """The view a remote WRITE under `rkey` may fill now, or None if the MR is being or has been
        deregistered or its remote access revoked, or `rkey` is no longer its key (a request that found the
        MR under a key `rekey` replaced); pair with `end_remote`."""
        with self._remote:
            if not self._open_to(rkey):
                return None
            view = self.view(offset, length)
            self._placing += 1
            return view

    def remote_view(self, rkey: int, offset: int, length: int) -> Optional[memoryview]:
        """The view a remote READ under `rkey` may read now, or None (as `begin_remote`, unpaired: a READ
        answered while a revoke runs reads bytes no WRITE is placing)."""
        with self._remote:
            return self.view(offset, length) if self._open_to(rkey) else None

    def _open_to(self, rkey: int) -> bool:
        """(under `_remote`) May a remote request under `rkey` touch this MR's memory now?"""
        return not (self._revoked or self.closed) and rkey == self.rkey

    def end_remote(self) -> None:
        with self._remote:
            self._placing -= 1
            self._remote.notify_all()

    def revoke_remote(self) -> bool:
        self._check_open()
        self._stop_remote()
        return True

    def rekey(self) -> int:
        self._check_open()
        if not self._revoked:
            raise UsageError(f"soft MR rkey {self.rkey:#x}: rekey needs its remote access revoked first "
                             f"(revoke_remote)")
        key = self.pd.ctx.rekey_mr(self)
        with self._remote:
            self.lkey = self.rkey = key
            self._revoked = False
        return key

    def _stop_remote(self) -> None:
        """No remote request under the current key from now on; returns once none is being placed (within the
        close bound: past it, `placing_after_close`)."""
        self.pd.ctx.remove_mr(self)
        bound = self._bound()
        with self._remote:
            self._revoked = True
            # (once past the bound, never again for this MR: its stalled WRITE is known)
            if self._placing and not self.placing_after_close \
                    and not self._remote.wait_for(lambda: self._placing == 0, timeout=bound):
                self.placing_after_close = True
                log.error("soft MR rkey %#x revoked while a remote WRITE into it was still being placed after %.0f s",
                          self.rkey, bound)
        if self.landing is not None:
            self.landing.close()

    def _close_impl(self) -> None:
        self._stop_remote()
        super()._close_impl()
