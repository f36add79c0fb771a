"""Mutual TLS on an endpoint's bootstrap connections (`tls: true`), and the certificate's say in who a
peer is.

With TLS on, a bootstrap connection is a TLS 1.3 connection from its first byte, both sides present a
certificate from the federation's CA (`tls_ca`), and before anything else runs inside it:

    dialer   -> {"tls": 1, "name": <the name it will claim>}
    acceptor -> {"tls": 1, "ok": true}   or   {"refused": <why>}, then closes

The acceptor refuses a dialer whose certificate does not name the party it claims to be; the dialer
refuses an acceptor whose certificate does not name the party it dialed. A certificate names a party
by its subject commonName or a URI SAN "fate-rdma:<party>"; the party of an endpoint name (its
host:port in a federation) is looked up in `party_names` ("role:party_id", e.g. "guest:9999"), and a
name not there is its own party. So a party cannot pose as another even though all hold the one
federation secret: the secret says "a member", the certificate says which. The HMAC exchange
(auth.py) still runs inside TLS when a secret is set, and the soft provider's data connections use
the same certificates (easypyverbs.tls). Nothing here is allocated for a peer: it all runs under the
endpoint's cap of pending handshakes, within connect_timeout_s in all, TLS handshake included.
"""
from __future__ import annotations

import dataclasses
import logging
import ssl
import time
from typing import Any, Callable, List, Mapping, Optional, Tuple

import easypyverbs as ev
from easypyverbs.bootstrap import MAGIC as BOOT_MAGIC
from easypyverbs.tls import TLS_RECORD_HANDSHAKE, MutualTLS, first_byte, handshake, names_in, peer_names

from ..config import ChannelConfig
from ..errors import AuthenticationError, ConfigError, RemoteProtocolError
from .auth import MAX_NAME, Identity

log = logging.getLogger("fate_rdma.channel")

URI_PREFIX = "fate-rdma:"


def _party_names(names: List[str]) -> List[str]:
    out = [n[len(URI_PREFIX):] if n.startswith(URI_PREFIX) else n for n in names]
    return [n for i, n in enumerate(out) if n not in out[:i]]


def cert_names(sock: Any) -> List[str]:
    """The party names a verified peer certificate carries (commonName, URI SANs "fate-rdma:<party>")."""
    return _party_names(peer_names(sock))


def certificate_names(path: str) -> Optional[List[str]]:
    """The names in the certificate file at `path`, where this Python can decode it (else None)."""
    try:
        info = ssl._ssl._test_decode_cert(path)  # type: ignore[attr-defined]  # stdlib, no third-party parser
    except (AttributeError, OSError, ssl.SSLError, ValueError):
        return None
    return _party_names(names_in(info))


class ChannelTLS:
    """An endpoint's TLS: its contexts, and the checks that bind a peer's certificate to its name."""

    def __init__(self, config: ChannelConfig, party_names: Optional[Mapping[str, str]] = None) -> None:
        cert, key, ca = config.tls_cert, config.tls_key, config.tls_ca
        assert cert and key and ca  # ChannelConfig checks that tls: true names all three
        try:
            self.contexts = MutualTLS.from_files(cert, key, ca)
        except (ssl.SSLError, OSError) as exc:  # names the files and OpenSSL's reason, never the key
            raise ConfigError(f"fate-rdma: cannot load tls_cert {cert} with tls_key {key} and tls_ca {ca}: {exc}") from exc
        self.cert = cert
        self.party_names = dict(party_names or {})
        self.names = certificate_names(cert)

    def check_own(self, own_name: str) -> None:
        """This endpoint's certificate must name its own party (where a federation says which it is)."""
        own, names = self.party_of(own_name), self.names
        if names is None or own in names:
            return
        if own_name in self.party_names:
            raise ConfigError(f"fate-rdma: tls_cert {self.cert} names {', '.join(map(repr, names))}, not this "
                              f"endpoint's party {own!r}: peers would refuse it; give this site the certificate "
                              f"issued for {own!r}")
        log.info("fate-rdma endpoint %s: its certificate names %s; peers must know its address as one of them",
                 own_name, names)

    def party_of(self, name: str) -> str:
        return self.party_names.get(name, name)

    # -- acceptor -------------------------------------------------------------------------------
    def accept(self, boot: ev.BootstrapConn, timeout_s: float,
               allowed: Optional[Callable[[str], bool]] = None) -> Tuple[ev.BootstrapConn, str]:
        """TLS on an accepted connection, and the dialer's claimed name checked against its certificate.
        Returns the TLS connection (it owns the socket now) and that name; raises AuthenticationError
        (a plaintext peer, a certificate not from tls_ca or naming another party) or RemoteProtocolError."""
        where = f"{boot.peer[0]}:{boot.peer[1]}"
        deadline = time.monotonic() + timeout_s
        first = first_byte(boot.sock, timeout_s)
        if first == BOOT_MAGIC[:1]:  # a plaintext fate-rdma dialer: say why in its own framing
            try:  # its opening frame first: a close with unread bytes would be a reset that drops our answer
                boot.recv(max(0.001, deadline - time.monotonic()))
            except ev.BootstrapError:
                pass
            boot.send({"refused": "this endpoint takes TLS connections only (tls: true); set tls, tls_cert, "
                                  "tls_key and tls_ca at the dialing site too"}, timeout_s)
            raise AuthenticationError(f"refused a plaintext connection from {where}: this endpoint takes TLS "
                                      f"connections only (tls: true)")
        if not first:
            raise RemoteProtocolError(f"peer at {where} closed the connection before it sent anything")
        if first != TLS_RECORD_HANDSHAKE:
            raise RemoteProtocolError(f"peer at {where} speaks neither TLS nor fate-rdma's bootstrap "
                                      f"(first byte {first!r})")
        try:
            ssock = handshake(boot.sock, self.contexts.server, True, max(0.001, deadline - time.monotonic()))
        except ssl.SSLCertVerificationError as exc:
            raise AuthenticationError(f"peer at {where}: its certificate is not signed by this site's tls_ca "
                                      f"({exc.verify_message})") from exc
        except (ssl.SSLError, OSError) as exc:
            raise AuthenticationError(f"TLS handshake with the peer at {where} failed: {exc}") from exc
        try:
            tboot = ev.BootstrapConn(ssock, boot.peer)
        except OSError as exc:
            ssock.close()
            raise AuthenticationError(f"peer at {where} closed the connection after the TLS handshake: {exc}") from exc
        try:
            hello = tboot.recv(max(0.001, deadline - time.monotonic()))
            claimed = hello.get("name")
            if hello.get("tls") != 1 or not isinstance(claimed, str) or not 1 <= len(claimed) <= MAX_NAME:
                raise RemoteProtocolError(f"peer at {where} sent no valid TLS hello (a name of 1-{MAX_NAME} characters)")
            names, party = cert_names(ssock), self.party_of(claimed)
            problem = None
            if allowed is not None and not allowed(claimed):
                problem = f"{claimed!r} is not a party of this endpoint's federation"
            elif party not in names:
                problem = (f"it claims to be {claimed!r} (party {party!r}) but its TLS certificate names "
                           f"{', '.join(map(repr, names)) or 'nobody'}")
            if problem is not None:
                tboot.send({"refused": problem}, timeout_s)
                raise AuthenticationError(f"peer at {where} refused: {problem}")
            tboot.send({"tls": 1, "ok": True}, timeout_s)
            return tboot, claimed
        except BaseException:
            tboot.close()
            raise

    # -- dialer ---------------------------------------------------------------------------------
    def dial(self, boot: ev.BootstrapConn, address: str, me: str, timeout_s: float) -> ev.BootstrapConn:
        """TLS on a connection this side made to `address`; the peer's certificate must name the party at
        `address`. A peer that closes during the handshake (at its cap of pending handshakes) gives a
        BootstrapError saying "closed", which the endpoint retries. `boot`'s patience window (a held peer,
        BootstrapConn.wait_patiently) covers the TLS handshake, and the returned connection keeps it."""
        try:
            ssock = handshake(boot.sock, self.contexts.client, False, timeout_s, boot.patient_until)
        except ssl.SSLCertVerificationError as exc:
            raise AuthenticationError(f"the endpoint at {address} presented a certificate that this site's tls_ca "
                                      f"does not trust ({exc.verify_message})") from exc
        except (ssl.SSLEOFError, ConnectionError) as exc:
            raise ev.BootstrapError(f"the endpoint at {address} closed the connection during the TLS handshake: "
                                    f"{exc}") from exc
        except ssl.SSLError as exc:
            hint = (": it does not speak TLS (tls is on here, off there?)" if exc.reason == "WRONG_VERSION_NUMBER"
                    else "")
            raise AuthenticationError(f"TLS handshake with the endpoint at {address} failed{hint}: {exc}") from exc
        except OSError as exc:  # TimeoutError included
            raise ev.BootstrapError(f"TLS handshake with the endpoint at {address} failed: {exc}") from exc
        try:
            tboot = ev.BootstrapConn(ssock, boot.peer)
        except OSError:
            ssock.close()
            raise
        tboot.keep_patience_of(boot)
        try:
            names, party = cert_names(ssock), self.party_of(address)
            if party not in names:
                raise AuthenticationError(f"the endpoint at {address} must be party {party!r} but its TLS certificate "
                                          f"names {', '.join(map(repr, names)) or 'nobody'}: refused (another "
                                          f"party's certificate)")
            try:  # (this side chose to dial: the TLS hello gets its own timeout, however long the handshake took)
                tboot.send({"tls": 1, "name": me}, timeout_s)
                reply = tboot.recv(timeout_s)
            except ev.BootstrapError as exc:
                # in TLS 1.3 the acceptor checks this side's certificate after this side's handshake is
                # done: one it does not accept shows as an alert, or as the connection closed unanswered
                cause = exc.__cause__
                why = (f"alert: {cause.reason or cause}" if isinstance(cause, ssl.SSLError) else
                       f"{cause}" if isinstance(cause, ConnectionError) else "closed unanswered" if "closed" in str(exc)
                       else None)
                if why is None:
                    raise
                raise AuthenticationError(f"the endpoint at {address} refused this side's certificate ({why}): is it "
                                          f"issued by that site's tls_ca?") from exc
            if "refused" in reply:
                raise AuthenticationError(f"the endpoint at {address} refused this side: {reply['refused']}")
            if reply.get("tls") != 1 or reply.get("ok") is not True:
                raise RemoteProtocolError(f"the endpoint at {address} sent no valid TLS hello answer")
            return tboot
        except BaseException:
            tboot.close()
            raise

    @staticmethod
    def bind(who: Identity, claimed: Optional[str]) -> Identity:
        """The peer's identity once its certificate was checked: the name it proved in the auth exchange
        must be the one its certificate was checked for (`claimed`; the dialed address on a dialer)."""
        if claimed is not None and who.name != claimed:
            raise AuthenticationError(f"peer checked by its certificate as {claimed!r} names itself {who.name!r}")
        return dataclasses.replace(who, authenticated=True)
