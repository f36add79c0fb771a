"""Endpoint: listens and connects through easypyverbs, keeps one connection per peer and reuses it,
and serves many peers at once (an arbiter receiving from N clients concurrently)."""
from __future__ import annotations

import itertools
import logging
import queue
import secrets
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional

import easypyverbs as ev
from easypyverbs import stalls
from easypyverbs.admission import Admission, HostSet
from easypyverbs.retry import Retry

from .. import metrics, trace
from ..config import ChannelConfig, is_loopback_host as _loopback, port_range
from ..errors import ConfigError, FateRdmaError, PeerUnreachable, TransferTimeout
from .auth import load_secret
from .buffers import Budget, RecvBuffers
from .connection import Connection, checked_metadata, pending
from .accepting import accept
from .dialer import dial
from .holds import hold_reporter
from .engine import Engine
from .layout import same_host_capable
from .posting import send_sge_limit
from .posture import posture
from ..protocol.integrity import KEYED
from .resume import Pending, Resumer
from .tls import ChannelTLS
from .transfer import Fill, Message, TransferFuture

log = logging.getLogger("fate_rdma.channel")


class Endpoint:
    """A fate-rdma channel endpoint at `host:port` (port 0 picks one; see `.address`)."""

    def __init__(self, config: ChannelConfig = ChannelConfig(), host: str = "127.0.0.1", port: int = 0,
                 name: Optional[str] = None, allowed_peers: Optional[Iterable[str]] = None,
                 party_names: Optional[Mapping[str, str]] = None, terms: Optional[Mapping[str, str]] = None) -> None:
        """`allowed_peers`: the names (party endpoint addresses) that may connect here; None = any
        peer that proves the federation's secret. `party_names` (tls: true): endpoint name -> the party
        ("role:party_id") its certificate must name; a name not in it must be named itself. `terms`:
        settings of the layer above that every peer must share (checked in the hello; handshake.py)."""
        self.config = config
        self._host = host  # (outgoing connections leave from it where it is one address: bootstrap.source_address)
        self.terms = dict(terms) if terms else None
        self.secret = load_secret(config.secret_file) if config.secret_file else None
        if self.secret is None and not config.tls and not _loopback(host):
            raise ConfigError(f"fate-rdma endpoint on {host}: without authentication an endpoint may only listen on "
                              f"loopback; set secret_file (the federation's shared secret, `fate-rdma secret FILE`) "
                              f"or tls (the parties' certificates, `fate-rdma tls init`)")
        if self.secret is not None and not config.tls and not _loopback(host) and not config.shared_secret_only:
            raise ConfigError(f"fate-rdma endpoint on {host}: between hosts peers prove their party by certificate: set "
                              f"tls: true with this party's certificate (fate-rdma tls request, then tls sign at the "
                              f"federation's CA), or shared_secret_only: true in the site file to run on the secret "
                              f"alone (members can then impersonate each other)")
        if config.keyed and config.checksum not in KEYED and not _loopback(host) and config.integrity != "unkeyed":
            raise ConfigError(f"fate-rdma endpoint on {host}: checksum {config.checksum} is not keyed: a relay on the "
                              f"path between sites could alter weights and recompute it. Leave checksum at auto "
                              f"(blake3, a MAC under each connection's session key), or accept the risk with "
                              f"integrity: unkeyed in the site file")
        self.allowed_peers = frozenset(allowed_peers) if allowed_peers is not None else None
        self.tls = ChannelTLS(config, party_names) if config.tls else None
        if self.tls is not None and (name or port):  # before anything is opened: a wrong certificate fails here
            self.tls.check_own(name or f"{host}:{port}")
        provider = config.provider
        # the soft provider's NIC is threads of this process (and of the peer's): it must not give up on a held
        # peer before the channel would (its kernel send and receive timeouts; a real NIC answers from hardware)
        # same_host: false switches the same-host path off; true leaves it to the provider, which takes it where
        # it works unless the operator switched it off for every process (EASYPYVERBS_SOFT_SAME_HOST=off)
        # (the soft provider's data connections use the endpoint's certificates; a real device ignores all this)
        # the parties allowed to connect: their addresses are admitted ahead of strangers, here and by the soft NIC
        self._party_hosts = HostSet(self.allowed_peers)
        emulation = ev.Emulation(link=config.soft_link, bind_host=host, same_host=None if config.same_host else False,
                                 retry_timeout_s=max(30.0, config.no_progress_timeout_s),
                                 tls=self.tls.contexts if self.tls is not None else None,
                                 known_sources=self._party_hosts.__contains__,
                                 ports=port_range(config.soft_data_ports) if config.soft_data_ports else None)
        self.ctx = ev.open_device(config.device, provider, emulation=emulation)
        if self.ctx.emulated and provider == "auto" and host != "127.0.0.1":
            log.info("%s bound to 127.0.0.1; pass provider='soft' to bind %s", self.ctx.label, host)
        self.pd = self.ctx.alloc_pd()
        self.listener = ev.Listener(host, port)
        #: the policy a dial retries a handshake the peer closed unanswered under (it is at its cap of pending
        #: handshakes): every 0.2 s within connect_timeout_s; tests pass a clock and a wait of their own
        self.dial_retry: Callable[[float], Retry] = lambda timeout_s: Retry(timeout_s, first_pause_s=0.2,
                                                                              max_pause_s=0.2)
        self.address = f"{host}:{self.listener.address[1]}"
        self.name = name or self.address
        if self.tls is not None and not self.ctx.emulated:  # (an emulated NIC's connections carry the tls)
            log.warning("fate-rdma endpoint %s: tls protects the bootstrap connections; the RDMA traffic of %s is "
                        "not encrypted by fate-rdma (use IPsec or MACsec on links that are not private)",
                        self.name, self.ctx.label)
        self._conns: Dict[str, Connection] = {}
        #: a peer's second connection, accepted while the first (ours to it) was alive: both ends dialed at
        #: once. Kept, not swapped in: closing either would cut the transfers under way on it. Sends stay on
        #: the first; the second takes over if the first ends. At most one per peer.
        self._extra: Dict[str, Connection] = {}
        self._send_sge: Optional[int] = None  # send_sge_limit, found once
        self._sge_lock = threading.Lock()
        self._lock = threading.Lock()
        self._dialing: Dict[str, threading.Lock] = {}
        self._inbox: "queue.Queue[Message]" = queue.Queue()
        #: on_message's taker: offered each complete message in the delivering thread before the inbox
        self._taker: Optional[Callable[[Message], bool]] = None
        self.recv_buffers = RecvBuffers(config.recv_cache_bytes)
        self.budget = Budget(config.budget_bytes, config.peer_budget_bytes)
        # handshakes in progress (easypyverbs.admission): strangers share max_pending_handshakes, one address a
        # quarter of them (loopback is one address for every local process, tests, one machine: all of them);
        # the addresses of the parties allowed to connect have as many again of their own, which a flood from
        # any number of addresses cannot take
        self._admission = Admission(config.max_pending_handshakes,
                                    config.max_pending_handshakes if _loopback(host)
                                    else max(2, config.max_pending_handshakes // 4),
                                    self._party_hosts.__contains__,
                                    config.max_pending_handshakes if allowed_peers is not None else 0)
        #: transfer ids: a random prefix of this endpoint's (a restarted process does not reuse its ids) and a count
        self._tid_prefix, self._tids = secrets.randbits(22) << 40, itertools.count(1)
        #: resume.py: transfers that outlive a connection which broke under them (None: resume_window_s 0)
        self._resumer = Resumer(self, config.resume_window_s) if config.resume_window_s > 0 else None
        self.refused = 0  # connections closed unauthenticated or over the pending cap (for tests and doctor)
        self.last_refusal = ""  # why the last connection that failed its handshake here was refused
        self._closed = False
        # holds of this process (easypyverbs.stalls) since the endpoint opened: count, seconds, the longest
        self.holds, self.held_s, self.longest_hold_s = 0, 0.0, 0.0
        self._holds_token = stalls.subscribe(hold_reporter(weakref.ref(self)))
        trace.watch_holds()
        self._acceptor = threading.Thread(target=self._accept_loop, name="fate-rdma-accept", daemon=True)
        self._acceptor.start()
        if config.metrics_dir and metrics.enable(config.metrics_dir):  # (never raises: off, with a warning)
            metrics.started(self.ctx.provider)
        log.info("fate-rdma endpoint %s on %s (%s)", self.name, self.address, self.ctx.label)
        for level, line in posture(config, host):  # what its settings protect, and what not (docs/security.md)
            (log.warning if level == "warning" else log.info)("fate-rdma endpoint %s: %s", self.name, line)

    @property
    def label(self) -> str:
        return self.ctx.label

    @property
    def resumer(self) -> Optional[Resumer]:
        return self._resumer

    def recv_alloc(self, n: int) -> Any:
        """A buffer for a message's copy (Message.detach): a recycled reassembly buffer."""
        return self.recv_buffers.get(n)

    def next_transfer_id(self) -> int:
        return self._tid_prefix | next(self._tids)  # (next() on a count is atomic: no lock)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def source_host(self) -> str:
        """Where outgoing connections leave from, where it is one address (bootstrap.source_address)."""
        return self._host

    @property
    def _patience_s(self) -> float:
        """How long a handshake waits for a peer whose host took the connection but whose process does not
        answer (held): as long as a transfer waits for a held peer."""
        return max(self.config.connect_timeout_s, self.config.no_progress_timeout_s)

    @property
    def patience_s(self) -> float:
        return self._patience_s

    @property
    def same_host_capable(self) -> bool:
        """Can this endpoint's payloads reach a peer on this host by the soft provider's same-host path? Then a
        send source allocated with `shared=True` (channel.buffers.fresh) is read through a mapping of it."""
        return same_host_capable(self.ctx)

    # -- connections ----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            if self._resumer is not None:
                self._resumer.expire()
            try:
                boot = self.listener.accept(timeout_s=0.5)
            except ev.BootstrapError:
                continue
            done = self._admission.admit(boot.peer[0])
            if done is None:  # bounded: no thread per stranger
                self.refused += 1
                if self.refused in (1, 10, 100, 1000):
                    log.warning("fate-rdma endpoint %s: too many handshakes pending (at most %d from strangers, %d "
                                "from one address); closed a connection from %s (%d so far)", self.name,
                                self._admission.strangers, self._admission.per_source, boot.peer, self.refused)
                boot.close()
                continue
            threading.Thread(target=self._accept_one, args=(boot, done), name="fate-rdma-handshake",
                             daemon=True).start()

    def _accept_one(self, boot: ev.BootstrapConn, done: Callable[[], None]) -> None:
        try:
            conn = accept(self, boot)
        finally:
            done()
        if conn is None:
            return
        with self._lock:
            old = self._conns.get(conn.peer)
            if old is not None and old is not conn and old.dead is None:
                old, self._extra[conn.peer] = self._extra.get(conn.peer), conn
            else:
                self._conns[conn.peer] = conn
        if old is not None and old is not conn:
            old.close()

    def connect(self, address: str, timeout_s: Optional[float] = None) -> Connection:
        """The connection to the endpoint at `address` (host:port), made on first use and reused. With
        authentication on, the endpoint there must prove that its name is `address`. `timeout_s`: how long
        a dial may take (connect_timeout_s)."""
        with self._lock:
            conn = self._live(address)
            if conn is not None:
                return conn
            gate = self._dialing.setdefault(address, threading.Lock())
        with gate:
            with self._lock:
                conn = self._live(address)
                if conn is not None:
                    return conn
            conn, who = dial(self, address, self.config.connect_timeout_s if timeout_s is None else timeout_s)
            with self._lock:
                live, spare = self._live(address), None
                if live is not None:  # our accept of the peer's own dial finished first: that one stays the
                    held = self._extra.get(address)  # first, ours is its spare (unless a live spare exists:
                    if held is not None and held.dead is None:  # ours, unused yet, is the one to close)
                        spare = conn
                    else:
                        self._extra[address] = conn
                else:
                    self._conns[address] = conn
                    if conn.peer != address and not who.authenticated:
                        self._conns.setdefault(conn.peer, conn)
            if spare is not None:
                spare.close()
            return live or conn

    def send_sge_limit(self, cq: ev.CQ) -> int:
        """posting.send_sge_limit for this endpoint's device, found once."""
        with self._sge_lock:
            if self._send_sge is None:
                self._send_sge = send_sge_limit(self.ctx, self.pd, cq, self.name)
            return self._send_sge

    def round_trip_s(self, address: str) -> float:
        """The round trip the live connection to `address` measured, without dialing: 0 where there is none
        yet, its probe has not finished, or the peer is a process of this host with no link model between
        (Connection.near: a probe there reads scheduling noise, several ms under load, not a path's delay)."""
        with self._lock:
            conn = self._live(address)
        if conn is None or conn.near:
            return 0.0
        return conn.probe.rtt_s or 0.0

    def _live(self, address: str) -> Optional[Connection]:
        """The live connection to `address`, the spare promoted if the first has ended (lock held)."""
        conn = self._conns.get(address)
        if conn is not None and conn.dead is None:
            return conn
        spare = self._extra.get(address)
        if spare is not None and spare.dead is None:
            self._conns[address] = self._extra.pop(address)
            return spare
        return None

    def forget(self, conn: Connection) -> None:
        """`conn` has ended (Connection's teardown): its spare, if any, takes its place."""
        with self._lock:
            for k in [k for k, v in self._extra.items() if v is conn]:
                del self._extra[k]
            for k in [k for k, v in self._conns.items() if v is conn]:
                del self._conns[k]
                spare = self._extra.pop(k, None)
                if spare is not None and spare.dead is None:
                    self._conns[k] = spare

    def engines_of(self, peer: str) -> List[Engine]:  # (resume.Home)
        """The engines of the connections to `peer` (resume.py)."""
        return [c.engine for c in self._all_conns() if c.peer == peer]

    def _all_conns(self) -> List[Connection]:
        with self._lock:
            return list({id(c): c for c in [*self._conns.values(), *self._extra.values()]}.values())

    def pool_bytes(self) -> int:
        """Bytes of FedRDMA-E receive pools registered now for all current peers (they grow with the
        traffic and shrink when idle; `pool_report` says how much is resident)."""
        return sum(c.pool_bytes for c in self._all_conns())

    def pool_report(self) -> Dict[str, Any]:
        """What the FedRDMA-E receive pools hold now: registered and resident bytes, in all and per peer
        with each slot's room and state, and the memory budget (slots.pool_report; logged when the endpoint closes;
        `doctor` prints what a configuration lets the pools hold, slots.pool_policy)."""
        from .slots import pool_report

        pools = []
        for c in self._all_conns():
            slots, rx = c.mem.slots if c.mem is not None else None, c.slot_receiver
            if slots is not None and rx is not None:
                pools.append((c.peer, slots, rx.machine.pool, rx.lent_slots()))
        return pool_report(pools, self.budget, self.recv_buffers)

    def peers(self) -> List[str]:
        return sorted({c.peer for c in self._all_conns()})

    # -- transfers ------------------------------------------------------------------------------
    def send(self, address: str, buffers: Any, metadata: Optional[Dict[str, Any]] = None,
             fill: Optional[Fill] = None) -> TransferFuture:
        """Send `buffers` (bytes, memoryview, numpy array or a list of them) with `metadata` to `address`;
        with `fill`, buffers still being copied into (back to front): chunks go as their bytes are final."""
        began = time.monotonic()  # (c_send is stamped with the call's start: before the engine can start it)
        try:
            checked_metadata(metadata)  # (before a dial: a send that cannot go fails at once)
            resumer = self._resumer

            def make() -> Pending:
                return pending(buffers, metadata, fill, self.next_transfer_id(), lambda f: None)

            # its connection broke: it goes behind the transfers that wait for it
            waiting = None if resumer is None else resumer.waiting(address, make)
            if waiting is None:
                try:
                    conn = self.connect(address)
                except PeerUnreachable as exc:  # (it broke a moment ago, idle: wait for it, within the window)
                    waiting = None if resumer is None else resumer.after_failed_dial(address, make, exc)
                    if waiting is None:
                        raise
            if waiting is not None:
                return self._waits(waiting, address, began)
            fut = conn.send(buffers, metadata, fill)
        except FateRdmaError as exc:
            metrics.send_failed(exc)
            raise
        metrics.sending(fut, conn.peer, conn.where["provider"], conn.path_kind.value, conn.send_integrity.kind,
                        self.config.log_format)
        trace.event("c_send", at=began, tid=fut.transfer_id, bytes=fut.total_bytes, peer=address)
        return fut

    def wait_for(self, address: str, buffers: Any, metadata: Optional[Dict[str, Any]], fill: Optional[Fill],
                 cause: PeerUnreachable) -> Optional[TransferFuture]:
        """A send to `address` whose dial failed with `cause` (a caller that dialed first): the send's future if
        it waits for the peer (its connection broke within resume_window_s), else None: the send fails with
        `cause`."""
        if self._resumer is None:
            return None
        began = time.monotonic()
        checked_metadata(metadata)
        fut = self._resumer.after_failed_dial(address, lambda: pending(
            buffers, metadata, fill, self.next_transfer_id(), lambda f: None), cause)
        return None if fut is None else self._waits(fut, address, began)

    def _waits(self, fut: TransferFuture, address: str, began: float) -> TransferFuture:
        """A send that waits for its peer's connection (resume.py): traced and counted as any send (its data
        path is not known yet: "")."""
        metrics.sending(fut, address, self.ctx.provider, "", self.config.checksum, self.config.log_format)
        trace.event("c_send", at=began, tid=fut.transfer_id, bytes=fut.total_bytes, peer=address)
        return fut

    def on_message(self, take: Optional[Callable[[Message], bool]]) -> None:
        """Offer each complete message to `take(msg)` in the thread that completes it (the connection's, or the
        soft NIC's), before the inbox: True if it took the message, False to leave it to `recv`. It saves the
        hand-off to a receiving thread, so it must be quick and never block (what it cannot do quickly, such
        as a large copy, it leaves to `recv`). A taker that raises has failed before touching the message (it
        must not raise after detaching or releasing it): the error is logged and the message goes to the inbox."""
        self._taker = take

    def deliver(self, msg: Message) -> None:
        """A complete message from a connection: to the taker (on_message), else to the inbox."""
        if self._resumer is not None:  # (a transfer delivered once, the rest of one behind what was held of it)
            whole = self._resumer.holdings.arrived(msg)
            if whole is None:
                return
            msg = whole
        trace.event("c_deliver", tid=msg.transfer_id, bytes=msg.nbytes, peer=msg.peer)
        if metrics.enabled():
            conn = self._conns.get(msg.peer) or self._extra.get(msg.peer)
            metrics.received(msg.peer, msg.nbytes, msg.mode, self.ctx.provider,
                             conn.path_kind.value if conn is not None else "")
        take = self._taker
        if take is not None:
            try:
                if take(msg):
                    return
            except Exception:
                log.exception("fate-rdma endpoint %s: a message taker failed; transfer %d goes to the inbox",
                              self.name, msg.transfer_id)
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
        stalls.unsubscribe(self._holds_token)
        self.listener.stop()  # the acceptor wakes now instead of at its next poll
        self._acceptor.join(timeout=5)
        self.listener.close()
        if self.config.mode == "fedrdma-e":  # what the pools hold at the end, for the task's log
            from .slots import describe_live

            try:
                log.info("fate-rdma endpoint %s at close: %s", self.name, "; ".join(describe_live(self.pool_report())))
            except Exception:  # (a report is not worth failing a close over)
                log.debug("fate-rdma endpoint %s: no pool report at close", self.name, exc_info=True)
        if self._resumer is not None:
            self._resumer.close()
        for c in self._all_conns():
            c.close(bye=True)
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
