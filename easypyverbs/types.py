"""Plain data types shared by every provider: work completions, QP and MR descriptors."""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Dict, Optional, Tuple

from .enums import WCOpcode, WCStatus
from .errors import BootstrapError


class DataPath(enum.Enum):
    """How a QP's payloads move (QP.path_kind), as a flow-control policy needs to know it: a provider reports
    it, and a policy reads its properties rather than the provider's name."""

    #: a NIC places them (real RDMA): sent at line rate, each completion one round trip after its post
    RDMA = "rdma"
    #: verbs emulated over one TCP stream per QP and direction: TCP's congestion control paces them
    TCP_EMULATED = "tcp-emulated"
    #: as TCP_EMULATED, through an emulated link (rate, delay, loss) that paces them as a wire would
    LINK_EMULATED = "link-emulated"
    #: verbs emulated between two processes of one host: the peer copies the bytes (no wire); requests and
    #: answers still travel a TCP stream
    SAME_HOST_EMULATED = "same-host-emulated"

    @property
    def emulated(self) -> bool:
        """Verbs emulated in software (not RDMA)."""
        return self is not DataPath.RDMA

    @property
    def paced_by_nic(self) -> bool:
        """A NIC sends the bytes and completes them (else software over TCP does, completion by completion)."""
        return self is DataPath.RDMA

    @property
    def paced_by_tcp(self) -> bool:
        """The bytes cross a TCP stream paced by nothing but TCP (no NIC, no emulated link)."""
        return self is DataPath.TCP_EMULATED

    @property
    def has_link(self) -> bool:
        """A link lies between the two ends that a first small transfer may bring up (a NIC's, or an emulated
        one); not a TCP stream, which is up since connect, nor a copy on one host."""
        return self in (DataPath.RDMA, DataPath.LINK_EMULATED)

    @property
    def same_host(self) -> bool:
        """The payload is a copy between two processes of one host."""
        return self is DataPath.SAME_HOST_EMULATED


@dataclasses.dataclass(frozen=True)
class WC:
    """A work completion (`ibv_wc`)."""

    wr_id: int
    status: WCStatus
    opcode: WCOpcode
    byte_len: int = 0
    imm_data: Optional[int] = None
    qp_num: int = 0
    vendor_err: int = 0
    #: why the provider failed this WR, when it knows more than the status says (soft provider)
    reason: str = dataclasses.field(default="", compare=False)

    @property
    def ok(self) -> bool:
        return self.status == WCStatus.SUCCESS


@dataclasses.dataclass(frozen=True)
class QPCap:
    """Queue pair capacities (`ibv_qp_cap`). Defaults suit a window of a few hundred chunks."""

    max_send_wr: int = 512
    max_recv_wr: int = 512
    max_send_sge: int = 8
    max_recv_sge: int = 8
    max_inline_data: int = 0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"QPCap.{f.name} must be a non-negative int, got {v!r}")
        if self.max_send_wr < 1 or self.max_recv_wr < 1 or self.max_send_sge < 1 or self.max_recv_sge < 1:
            raise ValueError("QPCap: queue depths and SGE counts must be at least 1")


def _need(d: Dict[str, Any], key: str, kind: type, what: str) -> Any:
    if key not in d:
        raise BootstrapError(f"{what}: field {key!r} missing")
    v = d[key]
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise BootstrapError(f"{what}: field {key!r} must be an integer, got {type(v).__name__}")
    if kind is not int and not isinstance(v, kind):
        raise BootstrapError(f"{what}: field {key!r} must be {kind.__name__}, got {type(v).__name__}")
    return v


@dataclasses.dataclass(frozen=True)
class QPInfo:
    """What a peer needs to connect to a QP (what perftest exchanges out of band).

    `gid` is the port GID for pyverbs; for the soft provider it is the `host:port` of the
    emulated NIC.
    """

    provider: str
    qpn: int
    psn: int
    gid: str
    lid: int = 0
    mtu: int = 4096
    max_msg_bytes: int = 1 << 30
    #: soft provider: the secret a requester must present to attach to this QP (hex); "" elsewhere
    token: str = dataclasses.field(default="", repr=False)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> "QPInfo":  # (a peer's: checked here)
        what = "QPInfo from peer"
        if not isinstance(d, dict):
            raise BootstrapError(f"{what}: expected an object, got {type(d).__name__}")
        info = cls(
            provider=_need(d, "provider", str, what),
            qpn=_need(d, "qpn", int, what),
            psn=_need(d, "psn", int, what),
            gid=_need(d, "gid", str, what),
            lid=_need(d, "lid", int, what),
            mtu=_need(d, "mtu", int, what),
            max_msg_bytes=_need(d, "max_msg_bytes", int, what),
            token=d.get("token", ""),
        )
        if not isinstance(info.token, str) or len(info.token) > 64 \
                or any(c not in "0123456789abcdef" for c in info.token):
            raise BootstrapError(f"{what}: token must be at most 64 lowercase hex digits")
        if not (0 <= info.qpn < 1 << 24 and 0 <= info.psn < 1 << 24):
            raise BootstrapError(f"{what}: qpn/psn out of the 24-bit range")
        return info


@dataclasses.dataclass(frozen=True)
class RemoteMR:
    """A peer's memory region as this side may address it: address, rkey and length."""

    addr: int
    rkey: int
    length: int

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> "RemoteMR":  # (a peer's: checked here)
        what = "RemoteMR from peer"
        if not isinstance(d, dict):
            raise BootstrapError(f"{what}: expected an object, got {type(d).__name__}")
        r = cls(_need(d, "addr", int, what), _need(d, "rkey", int, what), _need(d, "length", int, what))
        if r.addr < 0 or r.length < 0 or not 0 <= r.rkey < 1 << 32:
            raise BootstrapError(f"{what}: negative address/length or rkey out of range")
        return r

    def slice(self, offset: int, length: int) -> Tuple[int, int]:
        """(remote address, rkey) for `length` bytes at `offset`, bounds-checked on this side."""
        if offset < 0 or length < 0 or offset + length > self.length:
            from .errors import UsageError

            raise UsageError(f"remote range [{offset}, {offset + length}) outside remote MR of {self.length} bytes")
        return self.addr + offset, self.rkey


@dataclasses.dataclass(frozen=True)
class PortInfo:
    port_num: int
    state: str
    mtu: int
    max_msg_bytes: int
    lid: int
    link_layer: str
    gids: Tuple[Tuple[int, str, str], ...] = ()  # (index, gid, type)


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    provider: str
    name: str
    emulated: bool
    max_mr_bytes: int
    max_qp_wr: int
    max_sge: int
    max_cqe: int
    ports: Tuple[PortInfo, ...] = ()
    notes: str = ""
    #: memory windows the device can allocate (`ibv_device_attr.max_mw`; 0: none, or unknown)
    max_mw: int = 0
