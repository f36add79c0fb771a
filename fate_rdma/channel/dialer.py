"""Dialing a peer: the bootstrap connection (retried while the peer closes handshakes unanswered: it is at its cap
of pending ones), TLS, the proof, the seal, then the connection's set-up. The endpoint keeps what it dialed."""
from __future__ import annotations

import time
from typing import Callable, Optional, Protocol, Tuple

import easypyverbs as ev
from easypyverbs.retry import Retry

from .. import metrics
from ..errors import AuthenticationError, PeerUnreachable
from .auth import Identity, authenticate, seal
from .connection import Connection, Host
from .tls import ChannelTLS


class Dialing(Host, Protocol):
    """What a dial needs of its endpoint (endpoint.Endpoint)."""

    @property
    def tls(self) -> Optional[ChannelTLS]: ...

    @property
    def secret(self) -> Optional[bytes]: ...

    @property
    def dial_retry(self) -> Callable[[float], Retry]: ...

    @property
    def source_host(self) -> str: ...

    @property
    def patience_s(self) -> float: ...


def _tries(tries: int, started: float) -> str:
    """What a failed dial adds about its earlier attempts (each closed by the peer during the handshake)."""
    if tries <= 1:
        return ""
    before = "the attempt" if tries == 2 else f"the {tries - 1} attempts"
    return (f" (attempt {tries}, {time.monotonic() - started:.1f} s after the first; the peer closed {before} "
            f"before it during the handshake)")


def dial(ep: Dialing, address: str, timeout_s: float) -> Tuple[Connection, Identity]:
    """A new connection to the endpoint at `address` (host:port) and who it proved to be, within `timeout_s`;
    PeerUnreachable naming the attempts, AuthenticationError where the peer is not who `address` names."""
    host, _, port = address.rpartition(":")
    started = time.monotonic()
    retry = ep.dial_retry(timeout_s)
    for _ in retry:
        try:
            boot = ev.connect(host, int(port), timeout_s=max(0.1, retry.left_s()), source=ep.source_host)
        except (ev.EasyVerbsError, OSError, ValueError) as exc:
            raise PeerUnreachable(f"cannot connect to fate-rdma endpoint {address}: {exc}"
                                  f"{_tries(retry.attempts, started)}") from exc
        # the peer's kernel took the connection; its process may be held (a long native call keeping
        # its GIL): while its host acknowledges what we send, wait for it as for a held peer in a transfer
        boot.wait_patiently(ep.patience_s, "no_progress_timeout_s")
        try:
            if ep.tls is not None:  # TLS first; the peer's certificate must name the party at `address`
                boot = ep.tls.dial(boot, address, ep.name, max(0.1, retry.left_s()))
            who = authenticate(boot, ep.name, ep.secret, dialer=True, timeout_s=ep.config.connect_timeout_s,
                               tls=ep.tls is not None)
            if ep.tls is not None:
                who = ep.tls.bind(who, None)
            seal(boot, who, dialer=True)
        except ev.BootstrapError as exc:
            boot.close()
            # closed before its first answer: the peer is at its cap of pending handshakes (strangers
            # hold them until their deadline); try again within connect_timeout_s
            if "closed" in str(exc) or "connection lost" in str(exc):
                retry.failed(exc)
                metrics.connect_retried()
                continue
            raise PeerUnreachable(f"cannot connect to fate-rdma endpoint {address}: {exc}"
                                  f"{_tries(retry.attempts, started)}") from exc
        except BaseException as exc:
            boot.close()
            if isinstance(exc, AuthenticationError):
                metrics.auth_failed("dialer")
            raise
        break
    else:
        raise PeerUnreachable(f"cannot connect to fate-rdma endpoint {address}: {retry.last_error}"
                              f"{_tries(retry.attempts, started)}") from retry.last_error
    try:
        if who.authenticated and who.name != address:
            metrics.auth_failed("dialer")
            raise AuthenticationError(f"the endpoint at {address} proved it is {who.name!r}, not {address!r}")
        conn = Connection(ep, boot, dialer=True, identity=who, address=address)
        metrics.dialed(time.monotonic() - started)
    except (ev.EasyVerbsError, OSError) as exc:
        boot.close()
        raise PeerUnreachable(f"cannot connect to fate-rdma endpoint {address}: {exc}") from exc
    except BaseException:
        boot.close()
        raise
    return conn, who
