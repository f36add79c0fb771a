"""Peer authentication, first thing on a bootstrap connection: nothing is allocated for a peer
before it has proved who it is.

Mutual challenge-response over the federation's shared secret (HMAC-SHA256):

    1. both sides send  {"auth": "hmac-sha256" | "none", "v": 1, "name": <own name>, "nonce": <32 random bytes, hex>}
    2. both sides send  {"proof": HMAC(secret, transcript(own role))}
    3. each side checks the other's proof in constant time

The transcript binds a protocol label, the prover's role (dialer or acceptor), both names and both
nonces: a proof cannot be replayed (both nonces are fresh for this connection), reflected (the role
differs) or moved to another name. A peer is known by the name it proved, never by its address.

Session key: both sides derive

    session = HMAC-SHA256(secret, "fate-rdma session v1" || dialer name || acceptor name
                                  || dialer nonce || acceptor nonce)        (each part length-prefixed)

so it is fresh per connection (both nonces), bound to both proved names, and known only to holders of
the secret. It stays in this process (Identity never prints it; nothing logs it). Under TLS without a
secret, the same exchange runs inside the TLS connection (auth "none"), so its nonces are known to the
two ends only, and the session key is derived from them alike (label "fate-rdma tls session v1").

`direction_keys` splits the session key into one key per direction and purpose, so a message reflected
back to its sender, or moved from one use to another, does not verify:

    "mac"   the payload MAC of transfers (checksum: blake3 or blake2b; `mac_keys`)
    "boot"  every bootstrap message after the proof (easypyverbs' BootstrapConn.seal)
    "ctrl"  every control frame (protocol/frames.py)

With auth "none" (loopback endpoints only) step 1 is still exchanged, so a mismatch between the
two sides' settings is a clear error rather than a hang.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import secrets
import stat
from typing import Any, Callable, Mapping, Optional, Tuple

import easypyverbs as ev

from ..errors import AuthenticationError, ConfigError, RemoteProtocolError

log = logging.getLogger("fate_rdma.channel")

LABEL = b"fate-rdma auth v1"
SESSION_LABEL = b"fate-rdma session v1"
TLS_SESSION_LABEL = b"fate-rdma tls session v1"
PURPOSES = ("mac", "boot", "ctrl")
NONCE_BYTES = 32
MIN_SECRET_BYTES = 16
MAX_NAME = 256


def load_secret(path: str) -> bytes:
    """The federation's secret from `path`: hex text (64 digits from `fate-rdma secret`) or raw bytes,
    at least 16 bytes. A file other users can read is refused."""
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            raw = f.read(1 << 16)
    except OSError as exc:
        raise ConfigError(f"fate-rdma: cannot read secret_file {path}: {exc}") from exc
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"fate-rdma: secret_file {path} is readable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
                          f"chmod 600 it")
    text = raw.strip()
    try:
        key = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        key = text
    if len(key) < MIN_SECRET_BYTES:
        raise ConfigError(f"fate-rdma: secret_file {path} holds {len(key)} bytes; at least {MIN_SECRET_BYTES} are needed")
    return key


def write_secret(path: str) -> None:
    """A fresh 256-bit secret, hex, readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    os.chmod(path, 0o600)


@dataclasses.dataclass(frozen=True)
class Identity:
    """Who the peer is (the name it proved, or claimed when auth is off) and the session key."""

    name: str
    authenticated: bool
    session_key: bytes = dataclasses.field(default=b"", repr=False)


def _encode(*parts: bytes) -> bytes:
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)


def _transcript(role: str, me: str, peer: str, my_nonce: bytes, peer_nonce: bytes) -> bytes:
    return _encode(LABEL, role.encode(), me.encode(), peer.encode(), my_nonce, peer_nonce)


def session_key(secret: bytes, dialer: str, acceptor: str, dialer_nonce: bytes, acceptor_nonce: bytes) -> bytes:
    """The connection's session key (module docstring); both sides compute the same."""
    return hmac.new(secret, _encode(SESSION_LABEL, dialer.encode(), acceptor.encode(), dialer_nonce, acceptor_nonce),
                    hashlib.sha256).digest()


def direction_keys(session: bytes, dialer: bool, purpose: str) -> Tuple[bytes, bytes]:
    """(key of what this side sends, key of what it receives) for `purpose` (one of PURPOSES), from the
    session key."""
    if purpose not in PURPOSES:
        raise ValueError(f"no session keys for {purpose!r}")
    d2a, a2d = (hmac.new(session, f"fate-rdma {purpose} v1 {way}".encode(), hashlib.sha256).digest()
                for way in ("dialer->acceptor", "acceptor->dialer"))
    return (d2a, a2d) if dialer else (a2d, d2a)


def mac_keys(session: bytes, dialer: bool) -> Tuple[bytes, bytes]:
    """The payload MAC's keys (direction_keys, "mac")."""
    return direction_keys(session, dialer, "mac")


def seal(boot: ev.BootstrapConn, who: Identity, dialer: bool) -> None:
    """From now on every message on `boot` carries a MAC and its number (BootstrapConn.seal), where the
    connection has a session key; without one (auth none on loopback) it stays as it is."""
    if who.session_key:
        boot.seal(*direction_keys(who.session_key, dialer, "boot"))


def _first(obj: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(obj, dict):
        raise RemoteProtocolError(f"auth message from {where} is not an object")
    if "refused" in obj:  # e.g. a TLS-only endpoint answering a plaintext dialer (tls.py)
        raise AuthenticationError(f"peer at {where} refused the connection: {str(obj['refused'])[:300]}")
    kind = obj.get("auth")
    if kind not in ("hmac-sha256", "none") or obj.get("v") != 1:
        raise RemoteProtocolError(f"peer at {where} does not speak fate-rdma auth v1 (auth={kind!r}, v={obj.get('v')!r})")
    name = obj.get("name")
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME:
        raise RemoteProtocolError(f"auth message from {where}: field 'name' must be a string of 1-{MAX_NAME} characters")
    try:
        name.encode()  # (JSON may carry a lone surrogate, which has no UTF-8 form for the transcript)
    except UnicodeEncodeError as exc:
        raise RemoteProtocolError(f"auth message from {where}: field 'name' is not valid Unicode: {exc}") from exc
    nonce = obj.get("nonce")
    try:
        ok = isinstance(nonce, str) and len(bytes.fromhex(nonce)) == NONCE_BYTES
    except ValueError:
        ok = False
    if not ok:
        raise RemoteProtocolError(f"auth message from {where}: field 'nonce' must be {NONCE_BYTES} bytes of hex")
    return obj


def authenticate(boot: ev.BootstrapConn, me: str, secret: Optional[bytes], dialer: bool, timeout_s: float,
                 accept: Optional[Callable[[str], bool]] = None, tls: bool = False) -> Identity:
    """Run the exchange on `boot`; the peer's Identity, or AuthenticationError / RemoteProtocolError.
    `accept` (acceptor side): whether a peer that proved the secret may connect under its name. `tls`:
    `boot` runs inside TLS, so a session key comes from the nonces even without a secret (the peer's
    name is proven by its certificate: tls.bind)."""
    where = f"{boot.peer[0]}:{boot.peer[1]}"
    my_nonce = secrets.token_bytes(NONCE_BYTES)
    mine = {"auth": "hmac-sha256" if secret else "none", "v": 1, "name": me, "nonce": my_nonce.hex()}
    theirs = _first(boot.exchange(mine, timeout_s), where)
    peer, peer_nonce = theirs["name"], bytes.fromhex(theirs["nonce"])
    if (theirs["auth"] == "none") != (secret is None):
        raise AuthenticationError(
            f"peer {peer!r} at {where} {'does not authenticate (auth: none)' if secret else 'requires authentication'}, "
            f"this side {'requires it (secret_file set)' if secret else 'has auth: none'}: give both sides the "
            f"federation's secret_file")
    if secret is None:
        if not tls:
            return Identity(peer, False)
        ends = (me, peer, my_nonce, peer_nonce) if dialer else (peer, me, peer_nonce, my_nonce)
        return Identity(peer, False, session_key(TLS_SESSION_LABEL, *ends))
    role, peer_role = ("dialer", "acceptor") if dialer else ("acceptor", "dialer")
    proof = hmac.new(secret, _transcript(role, me, peer, my_nonce, peer_nonce), hashlib.sha256).hexdigest()
    expect = hmac.new(secret, _transcript(peer_role, peer, me, peer_nonce, my_nonce), hashlib.sha256).hexdigest()

    def check(got: Any) -> None:
        theirs_proof = got.get("proof") if isinstance(got, dict) else None
        # compare_digest takes ASCII strings only (TypeError on any other): a non-ASCII proof is simply wrong
        if not isinstance(theirs_proof, str) or not theirs_proof.isascii() \
                or not hmac.compare_digest(theirs_proof, expect):
            raise AuthenticationError(f"peer at {where} claiming to be {peer!r} failed to prove the federation's secret")

    # the dialer proves first; the acceptor, which faces whoever connects, answers only a valid proof
    if dialer:
        boot.send({"proof": proof}, timeout_s)
        got = boot.recv(timeout_s)
        if isinstance(got, dict) and "refused" in got:
            raise AuthenticationError(f"peer {peer!r} at {where} refused this side's proof: it holds another "
                                      f"secret, or does not accept the name {me!r}")
        check(got)
    else:
        try:
            check(boot.recv(timeout_s))
            if accept is not None and not accept(peer):
                raise AuthenticationError(f"peer at {where} proved the secret as {peer!r}, which is not a party of "
                                          f"this endpoint's federation")
        except AuthenticationError:
            boot.send({"refused": "authentication failed"}, timeout_s)
            raise
        boot.send({"proof": proof}, timeout_s)
    if dialer:
        return Identity(peer, True, session_key(secret, me, peer, my_nonce, peer_nonce))
    return Identity(peer, True, session_key(secret, peer, me, peer_nonce, my_nonce))
