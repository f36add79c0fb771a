"""Accepting a peer's dial: TLS, the proof, the federation's list of parties, the seal, then the connection's
set-up (dialer.py is the other side). Every read of the handshake has its own deadline (connect_timeout_s) and the
handshake a fixed number of reads, so a stranger holds one of max_pending_handshakes for a bounded time."""
from __future__ import annotations

import logging
from typing import FrozenSet, Optional, Protocol

import easypyverbs as ev

from .. import metrics
from ..errors import AuthenticationError
from .auth import authenticate, seal
from .connection import Connection, Host
from .tls import ChannelTLS

log = logging.getLogger("fate_rdma.channel")


class Accepting(Host, Protocol):
    """What an accept needs of its endpoint (endpoint.Endpoint)."""

    #: connections refused (for tests and doctor), and why the last one was
    refused: int
    last_refusal: str

    @property
    def tls(self) -> Optional[ChannelTLS]: ...

    @property
    def secret(self) -> Optional[bytes]: ...

    @property
    def allowed_peers(self) -> Optional[FrozenSet[str]]: ...

    @property
    def patience_s(self) -> float: ...


def accept(ep: Accepting, raw: ev.BootstrapConn) -> Optional[Connection]:
    """The connection a peer's dial on `raw` makes, or None: refused (logged, counted on `ep`, closed)."""
    boot = raw
    try:
        allowed = ep.allowed_peers
        claimed = None
        if ep.tls is not None:  # TLS first; the dialer's certificate must name the party it claims
            boot, claimed = ep.tls.accept(raw, ep.config.connect_timeout_s,
                                          None if allowed is None else allowed.__contains__)
        who = authenticate(boot, ep.name, ep.secret, dialer=False, timeout_s=ep.config.connect_timeout_s,
                           accept=None if allowed is None else allowed.__contains__, tls=ep.tls is not None)
        if ep.tls is not None:
            who = ep.tls.bind(who, claimed)
        if allowed is not None and who.name not in allowed:  # unauthenticated (loopback) peers too
            raise AuthenticationError(f"{who.name!r} is not a party of this endpoint's federation")
        seal(boot, who, dialer=False)
        if who.authenticated:  # a proven party may be held mid-handshake as in a transfer (never a stranger)
            boot.wait_patiently(ep.patience_s, "no_progress_timeout_s")
        return Connection(ep, boot, dialer=False, identity=who)
    except Exception as exc:
        ep.refused += 1
        if isinstance(exc, AuthenticationError):
            metrics.auth_failed("acceptor")
        ep.last_refusal = f"{raw.peer[0]}:{raw.peer[1]}: {exc}"
        log.warning("fate-rdma endpoint %s: rejected a connection from %s:%s: %s", ep.name, *raw.peer[:2], exc)
        boot.close()
        raw.close()
        return None
