"""Decisions the protocol makes before and during a transfer, kept here so in-memory tests reach them:
which mode carries a payload, how many chunks may be in flight, how small the Link-Enable chunk is,
how far a FedRDMA-E slot grows, and the sender's credit for the peer's FedRDMA staging buffers.
"""
from __future__ import annotations

import enum
import ipaddress
from typing import List, Optional, Set, Union

from ..errors import ConfigError, LocalProtocolError, PayloadTooLarge, RemoteProtocolError

#: assumed when neither the configuration nor a link model gives the rate: a nominal 10 Gbit/s WAN
NOMINAL_RATE_BPS = 10e9
#: Link-Enable pays off from about 4 Gbit/s up (paper §4.3: no gain measured below)
LINK_ENABLE_FROM_BPS = 4e9
#: the Link-Enable chunk: one page, cheap enough to bring the path up before the bulk follows
LINK_ENABLE_BYTES = 4096


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


#: how many bandwidth-delay products the automatic window keeps in flight, per provider. A real RC QP
#: needs one: the NIC sends at line rate and a completion comes one RTT after its post. The soft
#: provider runs each QP over a TCP connection, whose congestion control (BBR or CUBIC) holds an
#: app-limited stream below the link's rate: on the WAN testbed (64 KiB chunks, medians of 3, eval link
#: --study window) fedrdma-e reached 48 / 76 / 94 Mbit/s of 100 at 1 / 4 / 6 BDP in flight (100 Mbit/s x
#: 20 ms), and 31 / 46 of 50 at 2 / 3 BDP (50 Mbit/s x 80 ms), one TCP stream 92 and 40. Chunks in
#: flight cost no memory in FedRDMA-E (they are written in place) and FedRDMA's are bounded by the
#: peer's staging credits, so the soft provider keeps 6.
WINDOW_BDPS = {"soft": 6.0}
DEFAULT_WINDOW_BDPS = 1.0


def auto_window(rate_bps: float, rtt_s: float, chunk_bytes: int, min_window: int, max_window: int,
                bdps: float = DEFAULT_WINDOW_BDPS) -> int:
    """Chunks in flight that fill `bdps` bandwidth-delay products, plus one to cover the gap between a
    completion and the next post; clamped to [min_window, max_window]."""
    if chunk_bytes < 1 or not 1 <= min_window <= max_window or bdps <= 0:
        raise LocalProtocolError(f"bad window bounds: chunk {chunk_bytes}, min {min_window}, max {max_window}, "
                                 f"bdps {bdps}")
    bdp_bytes = max(rate_bps, 0.0) / 8 * max(rtt_s, 0.0) * bdps
    return max(min_window, min(max_window, int(-(-bdp_bytes // chunk_bytes)) + 1))


def window_bdps(provider: str) -> float:
    """The bandwidth-delay products the automatic window fills on `provider` (WINDOW_BDPS)."""
    return WINDOW_BDPS.get(provider, DEFAULT_WINDOW_BDPS)


def path_rate_bps(configured_bps: Optional[float], link_model: object) -> float:
    """The rate the window and Link-Enable assume for a path: the configured one, else the soft link
    model's, else NOMINAL_RATE_BPS."""
    return configured_bps or getattr(link_model, "rate_bps", None) or NOMINAL_RATE_BPS


def window_for(window: Union[int, str], rate_bps: float, rtt_s: float, chunk_bytes: int, min_window: int,
               max_window: int, provider: str) -> int:
    """Chunks in flight: the configured number, or under "auto" auto_window with `provider`'s BDPs."""
    if isinstance(window, int):
        return window
    return auto_window(rate_bps, rtt_s, chunk_bytes, min_window, max_window, window_bdps(provider))


#: qps_per_peer "auto": how many QPs are set up, and from which measured RTT all of them are used
AUTO_QPS_MAX = 4
LONG_PATH_RTT_S = 0.010


def auto_qps(rtt_s: float, available: int) -> int:
    """QPs to stripe chunks over under qps_per_peer "auto": one on a short path (loopback, one site:
    extra streams only add threads), all `available` on a long one. What this buys is fairness between
    clients that share a link (eval fairness, 50 Mbit/s x 20 ms, bbr: a median gap of 6.8 % with four
    against 16.5 % with one, 2026-11-26), for 2-3 % less aggregate rate. It no longer buys throughput
    on a lossy long link: with the 6-BDP automatic window one QP was the fastest there (eval link
    --study qps, 100 Mbit/s x 80 ms, 1 % loss, bbr: 1 / 2 / 4 QPs 85 / 73 / 63 Mbit/s, 2026-11-26;
    29 / 43 / 48 with the old one-BDP window, 2026-11-23)."""
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
    """The chunk FedRDMA-E writes into a slot: chunk_bytes; on a same-host path (the soft provider's
    process_vm_readv copy) same_host_chunk_bytes if larger, and on a short path over the soft provider's TCP
    (`short_tcp`: short_tcp_path) tcp_chunk_bytes if larger. On both a chunk is only a unit of a copy or of a
    TCP write and costs a request, an answer, thread switches and ~0.2 ms of Python at the sender (perf), which only
    a fast path feels: 1 GiB warm, 2 cores, checksum none, same host: 4 MiB chunks 0.18 s, 16 MiB 0.13 s,
    64 MiB 0.12 s; over loopback TCP against raw TCP (`bench transfer`, medians of 9 pairs, 2026-11-29):
    4 MiB 0.86 / 0.87 x, 16 MiB 0.98 / 0.95 / 0.94 / 0.95 x, 32 MiB 0.97 / 1.01 x. (FedRDMA's chunk stays
    chunk_bytes: the peer's staging buffers hold one each; an RDMA device, the link model and a long path
    keep the paper's chunk.)"""
    if same_host:
        return max(chunk_bytes, same_host_chunk_bytes)
    return max(chunk_bytes, tcp_chunk_bytes) if short_tcp else chunk_bytes


def short_tcp_path(soft_tcp: bool, rtt_s: Optional[float]) -> bool:
    """Is a connection over the soft provider's TCP streams with no link model (`soft_tcp`) a short path,
    measured (`rtt_s`, None until the probe has) below LONG_PATH_RTT_S: a LAN or this host, where a chunk's
    CPU shows. On a long one the wire's time per chunk dwarfs it, and a larger chunk would only make progress
    (and the no-progress deadline) coarser on a slow link."""
    return soft_tcp and rtt_s is not None and rtt_s < LONG_PATH_RTT_S


def first_chunk_bytes(link_enable: object, rate_bps: float, no_link: bool = False) -> int:
    """Link-Enable's first chunk size (0 = off); `link_enable` is True, False or "auto". "auto" is off where
    the path has no link to bring up (`no_link`): the soft provider's copy between processes of one host, and
    its TCP streams without its link model (TCP was up since connect; the WAN testbed showed no effect,
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
