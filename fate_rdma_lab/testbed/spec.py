"""What a WAN testbed is: its sites' links and names, checked on construction (no side effects).
Building, shaping and removing one is fate_rdma_lab.testbed.bed; this module is what results and commands name."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from fate_rdma.errors import FateRdmaError

SITE_NAMES = "abc"
PAPER_NOTE = "the 10 Gbit/s x 20 ms of the paper cannot be reproduced on 2 cores"
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,11}$")


class WanError(FateRdmaError):
    """The testbed could not be built, measured or removed; the message says which step and why."""


class WanUnavailable(WanError):
    """This host cannot build a testbed at all (not root, no iproute2, no namespaces)."""


@dataclass(frozen=True)
class LinkSpec:
    """One site's access link. Defaults: a scaled WAN that 2 shared cores carry with room to spare."""

    rate_bps: Optional[int] = 100_000_000   # None: unshaped
    delay_ms: float = 5.0                    # one-way, on packets leaving the site
    loss_pct: float = 0.0                    # random drop of packets leaving the site
    reorder_pct: float = 0.0                 # share of packets leaving the site held reorder_gap_ms longer
    reorder_gap_ms: float = 2.0

    def __post_init__(self) -> None:
        if self.rate_bps is not None and not 8_000 <= self.rate_bps <= 100_000_000_000:
            raise WanError(f"rate must be 8 kbit/s .. 100 Gbit/s, got {self.rate_bps} bit/s")
        if not 0 <= self.delay_ms <= 10_000 or not 0 <= self.reorder_gap_ms <= 10_000:
            raise WanError("delay_ms and reorder_gap_ms must be 0 .. 10000")
        if not 0 <= self.loss_pct < 100 or not 0 <= self.reorder_pct <= 100:
            raise WanError("loss_pct must be 0 .. <100 and reorder_pct 0 .. 100")

    @property
    def needs_helper(self) -> bool:
        """Delay and reordering are the helper's; loss is nft's, on the helper's output (per MTU frame)."""
        return self.delay_ms > 0 or self.reorder_pct > 0 or self.loss_pct > 0

    def describe(self) -> str:
        return (f"rate {fmt_rate(self.rate_bps)}, delay {self.delay_ms:g} ms one-way, loss {self.loss_pct:g} %, "
                f"reorder {self.reorder_pct:g} % (+{self.reorder_gap_ms:g} ms)")


@dataclass(frozen=True)
class Testbed:
    links: Tuple[LinkSpec, ...] = (LinkSpec(), LinkSpec())
    prefix: str = "frwan"
    queue_ms: float = 50.0              # tbf queue = 50 ms of the link's rate: about 2 BDPs at 20 ms RTT
    helper_limit_pkts: int = 20000      # packets the delay helper may hold: 1 Gbit/s x 240 ms of 1500 B
    tcp_cc: Optional[str] = None        # TCP congestion control in every site (None: the host's default)

    def __post_init__(self) -> None:
        if not 2 <= len(self.links) <= len(SITE_NAMES):
            raise WanError(f"a testbed has 2 or 3 sites, got {len(self.links)}")
        check_prefix(self.prefix)
        if not 1 <= self.queue_ms <= 10_000:
            raise WanError("queue_ms must be 1 .. 10000")
        if self.tcp_cc is not None and not re.fullmatch(r"[a-z0-9_]{1,16}", self.tcp_cc):
            raise WanError(f"tcp_cc must name a congestion control (e.g. cubic, bbr), got {self.tcp_cc!r}")

    @property
    def router(self) -> str:
        return f"{self.prefix}-r"

    def site_ns(self, i: int) -> str:
        return f"{self.prefix}-{SITE_NAMES[i]}"

    def site_addr(self, i: int) -> str:
        return f"198.18.{i + 1}.2"

    def path_rate_bps(self, src: int, dst: int) -> Optional[int]:
        """The shaped rate of the path src -> dst: the slower of the two access links (None: unshaped)."""
        rates = [l.rate_bps for l in (self.links[src], self.links[dst]) if l.rate_bps is not None]
        return min(rates) if rates else None

    def to_dict(self) -> Dict[str, Any]:
        return {"prefix": self.prefix, "queue_ms": self.queue_ms, "helper_limit_pkts": self.helper_limit_pkts,
                "tcp_cc": self.tcp_cc, "links": [dataclasses.asdict(l) for l in self.links]}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Testbed":
        return cls(links=tuple(LinkSpec(**l) for l in d["links"]), prefix=d["prefix"], queue_ms=d["queue_ms"],
                   helper_limit_pkts=d["helper_limit_pkts"], tcp_cc=d.get("tcp_cc"))


def check_prefix(prefix: str) -> None:
    """Prefixes name namespaces and state files: a lowercase letter, then up to 11 letters or digits."""
    if not _PREFIX_RE.match(prefix):
        raise WanError(f"prefix must be a lowercase letter then up to 11 letters/digits, got {prefix!r}")


def fmt_rate(bps: Optional[float]) -> str:
    if bps is None:
        return "unshaped"
    for unit, div in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= div:
            return f"{bps / div:.4g} {unit}"
    return f"{bps:.0f} bit/s"


def testbed_note(tb: Optional[Testbed], path: Optional[Tuple[int, int]] = None) -> str:
    """The line every result of the testbed carries: the (path's) scaled rate, and why it is scaled."""
    if tb is None:
        rate = "unknown"
    elif path is not None:
        rate = fmt_rate(tb.path_rate_bps(*path))
    else:
        rates = sorted({fmt_rate(l.rate_bps) for l in tb.links})
        rate = " / ".join(rates)
    return f"testbed: real packets, scaled rate {rate} ({PAPER_NOTE})"
