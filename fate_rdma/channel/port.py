"""What a transfer mode (fedrdma.py, fedrdma_e.py) sees of its connection: a small port, so that a mode
imports neither the connection nor its engine and a test can drive it against a fake (tests/test_channel_port.py).

The engine (engine.py) implements both sides. A sending mode posts WRITEs and headers on the connection's
QPs, sends control frames and settles its transfers through `SendPort`; a receiving mode sends control frames,
refuses transfers and delivers messages through `RecvPort`. Both are called with the engine's turn lock held,
but for `RecvPort.release_slot`, which an application's thread calls.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import easypyverbs as ev

from .. import protocol as P
from ..protocol.frames import ErrorCode
from .outgoing import Outgoing


@dataclass(frozen=True)
class Plan:
    """How the engine starts a transfer in a mode: the window and chunk the policy gives the connection's path
    now, the QPs chunks are striped over, and the machine's clock reading and deadlines."""

    now: float
    window: int
    chunk_bytes: int
    qps: int
    first_chunk_bytes: int
    no_progress_s: float
    total_s: float


class SendPort(Protocol):
    """The connection as a sending mode uses it."""

    def next_qp(self) -> ev.QP:
        """The next data QP, round robin over those in use."""

    def control_qp(self) -> ev.QP:
        """QP 0: control frames, and FedRDMA-E's chunk 0 and header."""

    def batched(self) -> contextlib.AbstractContextManager[None]:
        """Every QP's WRs posted inside go in one batch, after the control frames the turn holds."""

    def post_data(self, qp: ev.QP, o: Outgoing, c: P.Chunk, remote: ev.RemoteMR, roff: int, signal_last: bool,
                  seq: int, in_place: bool = False) -> None:
        """WRITE chunk `c` of `o` to `remote` at `roff`; `signal_last`: its completion comes back to the mode
        (FedRDMA-E's on_write_complete); `in_place`: into a FedRDMA-E slot, the payload's final place."""

    def post_header(self, qp: ev.QP, o: Outgoing, hdr: P.Header, seq: int, remote: ev.RemoteMR, roff: int,
                    imm: int) -> None:
        """WRITE_WITH_IMM `hdr` (with chunk 0's metadata) to `remote` at `roff`."""

    def send_ctrl(self, c: P.Ctrl) -> None:
        """Send a control frame to the peer (it leaves with the turn's WRITEs)."""

    def wake(self) -> None:
        """Wake the engine (any thread): something a transfer waits for is ready."""

    def finish(self, o: Outgoing) -> None:
        """`o` is done: its future gets its result."""

    def step_aside(self, o: Outgoing) -> None:
        """`o` is placed and waits for the peer's verdict: the next transfer may start."""

    def fail(self, o: Outgoing, exc: BaseException, tell_peer: bool) -> None:
        """`o` failed with `exc` (the peer is told with a CANCEL if `tell_peer`)."""


class RecvPort(Protocol):
    """The connection as a receiving mode uses it."""

    def send_ctrl(self, c: P.Ctrl) -> None:
        """Send a control frame to the peer."""

    def refuse(self, tid: int, code: ErrorCode, reason: str) -> None:
        """Tell the peer (ERROR) that its transfer `tid` is refused, and why."""

    def deliver(self, tid: int, meta: bytes, view: memoryview, mode: str, releaser: Optional[Callable[[], None]],
                lend: Optional[Callable[[], bool]] = None) -> None:
        """Hand a complete transfer to the application: `releaser` gives its memory back, `lend` asks whether
        the application may keep it in place (transfer.Message)."""

    def release_slot(self, slot: int) -> None:
        """The application released a FedRDMA-E message in `slot` (any thread): the engine hands it back."""
