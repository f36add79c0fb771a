"""Capabilities some providers' objects have beyond the verbs API (api.py): hooks that only a provider which moves
the bytes itself can offer (the soft provider: its emulated NIC is threads of this process). Each is a
runtime-checkable Protocol: a caller asks `isinstance(obj, Capability)` and uses the hook where the answer is
yes, and works without it elsewhere (a NIC's DMA moves bytes without this process).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, runtime_checkable

from .api import SGEs
from .types import RemoteMR

#: `on_leave(offset, piece)`: a piece of a WRITE's bytes (`offset` from its first byte) about to go
OnLeave = Callable[[int, memoryview], None]


class LandedDigests(Protocol):
    """Digests of the WRITEs that landed in an MR, per block (PlacesWrites.track_writes)."""

    def take(self, block: int, length: int) -> Optional[Any]:
        """The digest of `length` bytes from the block's start, or None where no single WRITE placed them alone."""


@runtime_checkable
class PlacesWrites(Protocol):
    """An MR whose provider places the peer's WRITEs into it itself (not a NIC's DMA)."""

    #: remote access was revoked (or the MR closed) while a WRITE was still being placed, past the provider's
    #: bound: that WRITE may still change the memory, so no later registration of it should trust digests
    #: taken as bytes land
    placing_after_close: bool

    def track_writes(self, origin: int, block_bytes: int, start: Callable[[int], Any]) -> Optional[LandedDigests]:
        """Digest the peer's WRITEs into this MR as they land, per block of `block_bytes` from `origin`
        (`start(block)` makes a block's hasher: `update(view)`, `digest()`), with each piece still in cache.
        Call before the peer can write (right after registering, or after `rekey`)."""


@runtime_checkable
class LeavingWrites(Protocol):
    """A QP that sends a WRITE's bytes itself, and can hand each piece to a hook shortly before it goes."""

    @property
    def calls_on_leave(self) -> bool:
        """Does this QP call a WRITE's `on_leave` (it may not: a same-host path whose peer reads the bytes)?
        Fixed once the QP is connected."""

    def post_write(self, sges: SGEs, remote: RemoteMR, remote_offset: int = 0, wr_id: int = 0, signaled: bool = True,
                   on_leave: Optional[OnLeave] = None) -> None:
        """QP.post_write; `on_leave(offset, piece)`, where `calls_on_leave`, is called with each piece of the
        WRITE's bytes, in order, by the thread that sends them (a few pieces a system call), so that the caller
        can read them (a digest) while they are in cache. It must not raise (an exception is logged and the
        hook is not called again for that WRITE) nor block."""


@runtime_checkable
class ArrivalHook(Protocol):
    """A CQ whose completions are queued by a thread of this process (the emulated NIC's), which can hand them
    to the consumer there: `on_arrival` is called once a request's completions are queued; it returns True if
    it handled them, else waiters are woken as without it. It must not block."""

    on_arrival: Optional[Callable[[], bool]]


@runtime_checkable
class AttachToken(Protocol):
    """A QP whose peer attaches to it over a connection of its own (the soft provider's data connections) by
    presenting a token: by default a random one that its QPInfo hands out. `bind_attach(derive)`, called before
    `info()`, replaces it with tokens both ends derive from their session (`derive(qpn, mine)`:
    BootstrapConn.attach_token of a sealed connection): this QP's own (`mine`) for the peer to present, and the
    peer's QP's, taken at `connect`; the QPInfo then carries none, so a reader of the bootstrap learns nothing
    that attaches to the QP."""

    def bind_attach(self, derive: Callable[[int, bool], bytes]) -> None:
        """Take the attach tokens from `derive` from now on (before `info()` and `connect`)."""
