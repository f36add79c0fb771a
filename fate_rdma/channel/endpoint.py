"""Endpoint: listens and connects through easypyverbs, keeps one connection per peer and reuses it,
and serves many peers at once (an arbiter receiving from N clients concurrently)."""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Dict, List, Optional

import easypyverbs as ev

from ..config import ChannelConfig
from ..errors import PeerUnreachable, TransferTimeout
from .buffers import RecvBuffers
from .connection import Connection
from .transfer import Message, TransferFuture

log = logging.getLogger("fate_rdma.channel")


class Endpoint:
    """A fate-rdma channel endpoint at `host:port` (port 0 picks one; see `.address`)."""

    def __init__(self, config: ChannelConfig = ChannelConfig(), host: str = "127.0.0.1", port: int = 0,
                 name: Optional[str] = None) -> None:
        self.config = config
        provider = config.provider
        self.ctx = ev.open_device(config.device, provider, link=config.soft_link if provider != "pyverbs" else None,
                                  **({"bind_host": host} if provider == "soft" else {}))
        if self.ctx.provider == "soft" and provider == "auto" and host != "127.0.0.1":
            log.info("soft provider bound to 127.0.0.1; pass provider='soft' to bind %s", host)
        self.pd = self.ctx.alloc_pd()
        self.listener = ev.Listener(host, port)
        self.address = f"{host}:{self.listener.address[1]}"
        self.name = name or self.address
        self._conns: Dict[str, Connection] = {}
        self._lock = threading.Lock()
        self._dialing: Dict[str, threading.Lock] = {}
        self._inbox: "queue.Queue[Message]" = queue.Queue()
        self.recv_buffers = RecvBuffers(config.recv_cache_bytes)
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept_loop, name="fate-rdma-accept", daemon=True)
        self._acceptor.start()
        log.info("fate-rdma endpoint %s on %s (%s)", self.name, self.address, self.ctx.label)

    @property
    def label(self) -> str:
        return self.ctx.label

    # -- connections ----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                boot = self.listener.accept(timeout_s=0.5)
            except ev.BootstrapError:
                continue
            threading.Thread(target=self._accept_one, args=(boot,), name="fate-rdma-handshake", daemon=True).start()

    def _accept_one(self, boot: ev.BootstrapConn) -> None:
        try:
            conn = Connection(self, boot, dialer=False)
        except Exception as exc:
            log.warning("rejected a connection from %s: %s", boot.peer, exc)
            boot.close()
            return
        with self._lock:
            old = self._conns.get(conn.peer)
            self._conns[conn.peer] = conn
        if old is not None and old is not conn:
            old.close()

    def connect(self, address: str) -> Connection:
        """The connection to the endpoint at `address` (host:port), made on first use and reused."""
        with self._lock:
            conn = self._conns.get(address)
            if conn is not None and conn.dead is None:
                return conn
            gate = self._dialing.setdefault(address, threading.Lock())
        with gate:
            with self._lock:
                conn = self._conns.get(address)
                if conn is not None and conn.dead is None:
                    return conn
            host, _, port = address.rpartition(":")
            try:
                boot = ev.connect(host, int(port), timeout_s=self.config.connect_timeout_s)
                conn = Connection(self, boot, dialer=True)
            except (ev.EasyVerbsError, OSError) as exc:
                raise PeerUnreachable(f"cannot connect to fate-rdma endpoint {address}: {exc}") from exc
            with self._lock:
                self._conns[address] = conn
                if conn.peer != address:
                    self._conns.setdefault(conn.peer, conn)
            return conn

    def _forget(self, conn: Connection) -> None:
        with self._lock:
            for k in [k for k, v in self._conns.items() if v is conn]:
                del self._conns[k]

    def pool_bytes(self) -> int:
        """Bytes of FedRDMA-E receive pools registered (and resident) for all current peers."""
        with self._lock:
            conns = list({id(c): c for c in self._conns.values()}.values())
        return sum(c.pool_bytes for c in conns)

    def peers(self) -> List[str]:
        with self._lock:
            return sorted({c.peer for c in self._conns.values()})

    # -- transfers ------------------------------------------------------------------------------
    def send(self, address: str, buffers: Any, metadata: Optional[Dict[str, Any]] = None) -> TransferFuture:
        """Send `buffers` (bytes, memoryview, numpy array or a list of them) with `metadata` to `address`."""
        return self.connect(address).send(buffers, metadata)

    def _inbox_put(self, msg: Message) -> None:
        self._inbox.put(msg)

    def recv(self, timeout: Optional[float] = None) -> Message:
        """The next complete message from any peer; raises TransferTimeout after `timeout` seconds."""
        try:
            return self._inbox.get(timeout=timeout)
        except queue.Empty:
            raise TransferTimeout(f"no message arrived within {timeout} s") from None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._acceptor.join(timeout=5)
        self.listener.close()
        with self._lock:
            conns = list({id(c): c for c in self._conns.values()}.values())
        for c in conns:
            c.close()
        self.recv_buffers.clear()
        while True:
            try:
                self._inbox.get_nowait().release()
            except queue.Empty:
                break
            except Exception:
                pass
        self.ctx.close()

    def __enter__(self) -> "Endpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
