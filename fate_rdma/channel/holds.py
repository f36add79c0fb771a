"""What an endpoint says when its process stood still: no Python ran for a while (easypyverbs.stalls: code holding
the GIL, or the process stopped), so neither did the soft provider nor the channel."""
from __future__ import annotations

import logging
import weakref
from typing import Callable, List, Protocol

from ..config import ChannelConfig

log = logging.getLogger("fate_rdma.channel")


class Holding(Protocol):
    """What the report counts on and reads of its endpoint (endpoint.Endpoint)."""

    holds: int
    held_s: float
    longest_hold_s: float

    @property
    def name(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    @property
    def config(self) -> ChannelConfig: ...

    def peers(self) -> List[str]: ...


def hold_reporter(ref: "weakref.ReferenceType[Holding]") -> Callable[[float, float], None]:
    """For easypyverbs.stalls: counts each hold of this process for the endpoint and says what it did to its
    transfers (a warning once a hold reaches a quarter of what a peer waits for progress before giving up)."""
    def report(seconds: float, _ended: float) -> None:
        ep = ref()
        if ep is None or ep.closed:
            return
        ep.holds += 1
        ep.held_s += seconds
        ep.longest_hold_s = max(ep.longest_hold_s, seconds)
        peers = ep.peers()
        if not peers:
            return
        limit = ep.config.no_progress_timeout_s
        (log.warning if seconds >= limit / 4 else log.info)(
            "fate-rdma endpoint %s: this process ran no Python for %.1f s (code holding the GIL, such as FATE's secure "
            "aggregation of a large model, or the process stopped); the soft provider and the channel of %s stood "
            "still meanwhile. A peer gives up after no_progress_timeout_s (%g s) without progress: keep it above the "
            "longest hold", ep.name, seconds, ", ".join(peers), limit)
    return report
