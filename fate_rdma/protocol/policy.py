"""Decisions the protocol makes before and during a transfer, kept here so in-memory tests reach them:
which mode carries a payload, how many chunks may be in flight, how small the Link-Enable chunk is,
how far a FedRDMA-E slot grows, and the sender's credit for the peer's FedRDMA staging buffers.
"""
from __future__ import annotations

import enum
import ipaddress
from typing import List, Optional, Protocol, Set, Union

from ..errors import ConfigError, LocalProtocolError, PayloadTooLarge, RemoteProtocolError

#: assumed when neither the configuration nor a link model gives the rate: a nominal 10 Gbit/s WAN
NOMINAL_RATE_BPS = 10e9
#: Link-Enable pays off from about 4 Gbit/s up (paper §4.3: no gain measured below)
LINK_ENABLE_FROM_BPS = 4e9
#: the Link-Enable chunk: one page, cheap enough to bring the path up before the bulk follows
LINK_ENABLE_BYTES = 4096


class PathTraits(Protocol):
    """What the policy reads of a connection's data path: easypyverbs' DataPath, which its provider reports (the
    policy never asks which provider it is)."""

    @property
    def paced_by_nic(self) -> bool:
        """A NIC sends the bytes at line rate and completes each one round trip after its post."""

    @property
    def paced_by_tcp(self) -> bool:
        """The bytes cross a TCP stream paced by nothing but TCP (no NIC, no emulated link)."""

    @property
    def has_link(self) -> bool:
        """A link lies between the ends that a first small transfer may bring up (not a TCP stream, which is up
        since connect, nor a copy on one host)."""

    @property
    def same_host(self) -> bool:
        """The payload is a copy between two processes of one host."""


class Mode(str, enum.Enum):
    FEDRDMA = "fedrdma"
    FEDRDMA_E = "fedrdma-e"


def choose_mode(configured: str, total: int, peer_slot_payload_bytes: Optional[int], peer_staging: bool,
                too_large: str, transfer_id: int = 0, peer: str = "the peer") -> Mode:
    """The mode that carries a `total`-byte payload to this peer.

    FedRDMA-E needs the payload to fit the peer's receive slot; one that does not either falls back
    to FedRDMA (`too_large: fedrdma`, when the peer offers staging buffers) or is refused with
    PayloadTooLarge. FedRDMA needs the peer's staging buffers (else ConfigError).
    """
    mode = Mode(configured)
    if mode is Mode.FEDRDMA_E and (peer_slot_payload_bytes is None or total > peer_slot_payload_bytes):
        if too_large == "fedrdma" and peer_staging:
            mode = Mode.FEDRDMA
        else:
            raise PayloadTooLarge(f"payload of {total} bytes exceeds {peer}'s FedRDMA-E receive slot of "
                                  f"{peer_slot_payload_bytes or 0} bytes (raise slot_bytes, or set too_large: fedrdma)",
                                  transfer_id)
    if mode is Mode.FEDRDMA and not peer_staging:
        raise ConfigError(f"{peer} offers no FedRDMA staging buffers (its mode is fedrdma-e, this side's fedrdma): "
                          "configure both sides with the same mode, or the receiver with too_large: fedrdma")
    return mode


#: a FedRDMA-E slot grows to the payload that needs it rounded up to this (at most the slot's maximum): a
#: payload a few bytes larger than the last (a pickle of the same model) reuses the grant instead of
#: asking again; costs at most this much more memory per slot
GROW_GRANULE_BYTES = 1 << 20


def slot_room(wanted: int, max_payload_bytes: int) -> int:
    """The capacity a slot grows to for a `wanted`-byte payload."""
    return min(max_payload_bytes, -(-wanted // GROW_GRANULE_BYTES) * GROW_GRANULE_BYTES)


#: how long a transfer waits for a slot in use that has room, per GiB of payload, before it grows a
#: free slot instead (about what faulting that much fresh memory in costs on a small VM)
ROOM_WAIT_S_PER_GIB = 0.5


def wait_for_room(waited_s: float, total: int) -> bool:
    """Does a `total`-byte payload that has waited `waited_s` for a slot still wait for one in use that has
    room (SlotRing.acquire's `wait_for_room`)? Such a slot comes back within a release and a CREDIT, while
    growing another faults that much fresh memory in: it waits up to about what that would cost."""
    return waited_s < ROOM_WAIT_S_PER_GIB * total / (1 << 30)


def may_lend(lent: int, nslots: int, budget_free_bytes: int, slot_bytes: int) -> bool:
    """May the application keep one more of a pool's `nslots` slots in place (`lent` are)? Yes while another
    slot stays in circulation (all but one may be lent, so transfers always progress) and the memory budget
    (`budget_free_bytes` left to this peer: the less of what is left of its part and of the whole) could grow
    that one as large as this one's `slot_bytes` (else a copy, and the slot goes back at once: the sender's
    next payload of this size is not refused for want of room)."""
    return lent + 1 < nslots and budget_free_bytes >= slot_bytes


#: how many bandwidth-delay products the automatic window keeps in flight. A path paced by a NIC needs
#: one: it sends at line rate and a completion comes one RTT after its post. An emulated path runs each
#: QP over a TCP connection, whose congestion control (BBR or CUBIC) holds an app-limited stream below
#: the link's rate unless several BDPs are in flight (`eval link --study window`; docs/RESULTS.md
#: has the figures). Chunks in flight cost no memory in FedRDMA-E (they are written in place) and
#: FedRDMA's are bounded by the peer's staging credits, so an emulated path keeps 6.
DEFAULT_WINDOW_BDPS = 1.0
SOFTWARE_WINDOW_BDPS = 6.0


def auto_window(rate_bps: float, rtt_s: float, chunk_bytes: int, min_window: int, max_window: int,
                bdps: float = DEFAULT_WINDOW_BDPS) -> int:
    """Chunks in flight that fill `bdps` bandwidth-delay products, plus one to cover the gap between a
    completion and the next post; clamped to [min_window, max_window]."""
    if chunk_bytes < 1 or not 1 <= min_window <= max_window or bdps <= 0:
        raise LocalProtocolError(f"bad window bounds: chunk {chunk_bytes}, min {min_window}, max {max_window}, "
                                 f"bdps {bdps}")
    bdp_bytes = max(rate_bps, 0.0) / 8 * max(rtt_s, 0.0) * bdps
    return max(min_window, min(max_window, int(-(-bdp_bytes // chunk_bytes)) + 1))


def window_bdps(path: PathTraits) -> float:
    """The bandwidth-delay products the automatic window fills on `path`: one where a NIC paces it, else
    SOFTWARE_WINDOW_BDPS."""
    return DEFAULT_WINDOW_BDPS if path.paced_by_nic else SOFTWARE_WINDOW_BDPS


def path_rate_bps(configured_bps: Optional[float], link_rate_bps: Optional[float]) -> float:
    """The rate the window and Link-Enable assume for a path: the configured one, else its emulated link's
    (Context.link_rate_bps), else NOMINAL_RATE_BPS."""
    return configured_bps or link_rate_bps or NOMINAL_RATE_BPS


def window_for(window: Union[int, str], rate_bps: float, rtt_s: float, chunk_bytes: int, min_window: int,
               max_window: int, path: PathTraits) -> int:
    """Chunks in flight: the configured number, or under "auto" auto_window with `path`'s BDPs."""
    if isinstance(window, int):
        return window
    return auto_window(rate_bps, rtt_s, chunk_bytes, min_window, max_window, window_bdps(path))


#: qps_per_peer "auto": how many QPs are set up, and from which measured RTT all of them are used
AUTO_QPS_MAX = 4
LONG_PATH_RTT_S = 0.010


def auto_qps(rtt_s: float, available: int) -> int:
    """QPs to stripe chunks over under qps_per_peer "auto": one on a short path (loopback, one site:
    extra streams only add threads), all `available` on a long one. What this buys is fairness between
    clients that share a link (`eval fairness`: a smaller gap between clients with four than with one),
    for a few per cent less aggregate rate. It no longer buys throughput on a lossy long link: with the
    6-BDP automatic window one QP was the fastest there (`eval link --study qps`; docs/RESULTS.md)."""
    return max(1, available) if rtt_s >= LONG_PATH_RTT_S else 1


def one_host(local_ip: str, peer_ip: str) -> bool:
    """Is the peer a process of this host: a loopback address, or this side's own address (which the
    kernel routes locally)? Addresses of other network namespaces (the WAN testbed's sites) are not."""
    try:
        peer = ipaddress.ip_address(peer_ip.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(peer, "ipv4_mapped", None)
    return bool(peer.is_loopback or (mapped is not None and mapped.is_loopback) or peer_ip == local_ip)


def qps_offer(setting: Union[int, str], near: bool) -> int:
    """The QPs a connection sets up: `setting`, or under "auto" AUTO_QPS_MAX, except to a peer `near`
    (on this host, no link model): there is no path to stripe over, and with four QPs set up a same-host
    FATE round took 0.41 s against 0.25 s (cause not traced: a probe reading >= 10 ms under load, or the
    extra QPs' threads), so one QP, as the peer also decides (it sees the same addresses)."""
    if setting != "auto":
        return int(setting)
    return 1 if near else AUTO_QPS_MAX


def qps_in_use(setting: Union[int, str], rtt_s: Optional[float], available: int) -> int:
    """The QPs chunks are striped over: all `available`, or under "auto" what the measured RTT calls for
    (one until the probe has measured it)."""
    if setting != "auto":
        return available
    return auto_qps(rtt_s, available) if rtt_s is not None else 1


def slot_chunk_bytes(chunk_bytes: int, same_host_chunk_bytes: int, same_host: bool,
                     tcp_chunk_bytes: int = 0, short_tcp: bool = False) -> int:
    """The chunk FedRDMA-E writes into a slot: chunk_bytes; on a same-host path (`same_host`: a copy between
    two processes) same_host_chunk_bytes if larger, and on a short path paced by TCP alone (`short_tcp`:
    short_tcp_path) tcp_chunk_bytes if larger. On both a chunk is only a unit of a copy or of a
    TCP write and costs a request, an answer, thread switches and Python time at the sender, which only
    a fast path feels (`bench transfer`, docs/benchmarks.md). (FedRDMA's chunk stays
    chunk_bytes: the peer's staging buffers hold one each; a NIC, an emulated link and a long path keep the
    paper's chunk.)"""
    if same_host:
        return max(chunk_bytes, same_host_chunk_bytes)
    return max(chunk_bytes, tcp_chunk_bytes) if short_tcp else chunk_bytes


def short_tcp_path(paced_by_tcp: bool, rtt_s: Optional[float]) -> bool:
    """Is a connection paced by TCP alone (`paced_by_tcp`: PathTraits; no NIC, no emulated link) a short path,
    measured (`rtt_s`, None until the probe has) below LONG_PATH_RTT_S: a LAN or this host, where a chunk's
    CPU shows. On a long one the wire's time per chunk dwarfs it, and a larger chunk would only make progress
    (and the no-progress deadline) coarser on a slow link."""
    return paced_by_tcp and rtt_s is not None and rtt_s < LONG_PATH_RTT_S


def first_chunk_bytes(link_enable: object, rate_bps: float, no_link: bool = False) -> int:
    """Link-Enable's first chunk size (0 = off); `link_enable` is True, False or "auto". "auto" is off where
    the path has no link to bring up (`no_link`: not PathTraits.has_link): a copy between processes of one
    host, and TCP streams without an emulated link (TCP was up since connect; the WAN testbed showed no effect,
    docs/RESULTS.md section 3). There the small chunk only costs a WRITE of its own and, where WRITEs are
    digested as they land, the payload's last integrity block hashed again from memory (a small message's
    only block: a LoRA upload's whole payload)."""
    if link_enable == "auto":
        on = rate_bps >= LINK_ENABLE_FROM_BPS and not no_link
    else:
        on = bool(link_enable)
    return LINK_ENABLE_BYTES if on else 0


class StagingCredits:
    """The sender's credit for the peer's FedRDMA staging buffers: one buffer per chunk in flight,
    handed back by the ACK that names it. An ACK for a buffer we do not hold is the peer's fault."""

    def __init__(self, count: int) -> None:
        if count < 0:
            raise LocalProtocolError(f"negative staging buffer count {count}")
        self.count = count
        self._free: List[int] = list(range(count - 1, -1, -1))
        self._lent: Set[int] = set()

    def take(self) -> int:
        if not self._free:
            raise LocalProtocolError("no staging buffer free: the window exceeds the peer's staging buffers")
        i = self._free.pop()
        self._lent.add(i)
        return i

    def give_back(self, index: int) -> None:
        if index not in self._lent:
            raise RemoteProtocolError(f"ACK returns staging buffer {index}, which is not in use "
                                      f"(the peer has {self.count})")
        self._lent.discard(index)
        self._free.append(index)

    @property
    def available(self) -> int:
        return len(self._free)
