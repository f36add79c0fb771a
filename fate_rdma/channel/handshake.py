"""The connection handshake: who the peer is and what receive memory it offers, before any QP exists.

Both sides send a hello over the bootstrap connection (JSON, easypyverbs' framing) and read the
peer's; the QPs are then established over the same connection (easypyverbs.establish), and a last
exchange says that both sides have posted their receives. The hello itself (its fields, the check of
every field of the peer's, the checksum and terms agreement) is the protocol's: protocol/hello.py. This is
where peer authentication belongs.
"""
from __future__ import annotations

import dataclasses
import logging
import select
import socket
from typing import Any, Mapping, Optional

import easypyverbs as ev

from ..errors import PeerLeft, RemoteProtocolError
from ..protocol.frames import MAX_META
from ..protocol.hello import HDR_SLOT, Hello, PoolOffer, StagingOffer, agree_checksum, agree_terms
from ..protocol.integrity import BLOCKWISE
from ..protocol.policy import one_host, qps_offer

log = logging.getLogger("fate_rdma.channel")


def exchange_hello(boot: ev.BootstrapConn, mine: Hello, timeout_s: float) -> Hello:
    """Send our hello, read and validate the peer's."""
    return Hello.from_wire(boot.exchange(mine.to_wire(), timeout_s), f"{boot.peer[0]}:{boot.peer[1]}")


@dataclasses.dataclass(frozen=True)
class Agreed:
    """What two sides agreed in their hellos: the peer's hello, this side's receive offers, the QPs to set up."""

    peer: Hello
    pool: Optional[PoolOffer]
    staging: Optional[StagingOffer]
    qps: int
    #: the peer is a process of this host with no link model between (its RTT probe reads scheduling noise)
    near: bool = False


def negotiate(boot: ev.BootstrapConn, cfg: Any, name: str, terms: Optional[Mapping[str, str]], proven: str) -> Agreed:
    """This side's offers (a FedRDMA-E pool, FedRDMA staging, QPs: cfg, a ChannelConfig) and hello, the peer's
    read and checked: it must name the party authentication proved (`proven`) and share the checksum and
    `terms`."""
    pool = PoolOffer(cfg.pool_slots, cfg.slot_bytes, MAX_META) if cfg.mode == "fedrdma-e" else None
    staging = (StagingOffer(cfg.max_window, HDR_SLOT + cfg.chunk_bytes, MAX_META)
               if cfg.mode == "fedrdma" or cfg.too_large == "fedrdma" else None)
    near = one_host(boot.local[0], boot.peer[0]) and not cfg.soft_link
    offer_qps = qps_offer(cfg.qps_per_peer, near)
    peer = exchange_hello(boot, Hello(name, offer_qps, pool, staging, cfg.checksum,
                                      dict(terms) if terms is not None else None,
                                      placed_notes=pool is not None and cfg.checksum in BLOCKWISE), cfg.connect_timeout_s)
    if peer.name != proven:
        raise RemoteProtocolError(f"peer authenticated as {proven!r} names itself {peer.name!r} in its hello")
    agree_checksum(cfg.checksum, peer)
    agree_terms(terms, peer)
    return Agreed(peer, pool, staging, max(1, min(offer_qps, peer.qps)), near)


def confirm_posted(boot: ev.BootstrapConn, timeout_s: float) -> None:
    """Both sides have posted their receives: from now on neither side's first SEND can find none."""
    reply = boot.exchange({"posted": True}, timeout_s)
    if not isinstance(reply, dict) or reply.get("posted") is not True:
        raise RemoteProtocolError(f"peer at {boot.peer} did not finish connection set-up")


def bootstrap_closed(boot: ev.BootstrapConn) -> bool:
    """Both sides keep the bootstrap socket for the connection's lifetime, so its end of file means the
    peer is gone. An RC QP alone notices that only when a WR of ours goes unanswered, which an
    idle sender waiting for ACKs (FedRDMA) never posts: a real NIC's QP would wait for the
    no-progress deadline. A peer whose endpoint closes says goodbye first (say_bye): PeerLeft."""
    sock = boot.sock
    try:
        if not select.select([sock], [], [], 0)[0]:  # (a peek on a socket with a timeout would wait)
            return False
        # the TCP stream itself, also under TLS (an SSLSocket takes no recv flags): nothing but the peer's
        # goodbye and end of file is due there once the connection is set up (tls.py: no session tickets)
        if socket.socket.recv(sock, 1, socket.MSG_PEEK) == b"":
            return True
    except (BlockingIOError, InterruptedError):
        return False
    except (OSError, ValueError):
        return True
    said = boot.recv(timeout_s=BYE_TIMEOUT_S)  # (sealed where the connection is: only the peer says it)
    if said != BYE:
        raise RemoteProtocolError(f"unexpected message on the bootstrap connection after set-up: {str(said)[:80]}")
    raise PeerLeft(f"{boot.peer[0]}:{boot.peer[1]} closed its endpoint")


#: what an endpoint that closes says on each connection's bootstrap (its last message): nothing it was sending
#: will be resumed, so its peers keep nothing of it (holding.py)
BYE = {"bye": 1}
BYE_TIMEOUT_S = 5.0


def say_bye(boot: ev.BootstrapConn) -> None:
    """This endpoint closes: tell the peer (best effort: a peer that does not hear it keeps what arrived of our
    transfers for resume_window_s)."""
    try:
        boot.send(BYE, timeout_s=1.0)
    except Exception as exc:  # (a connection that is gone already)
        log.debug("no goodbye to %s: %s", boot.peer, exc)
