"""What the channel hands its users: TransferFuture (outgoing) and Message (incoming), and the
payload helper that turns a list of buffers into registered MRs and SGE lists without copying."""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
from numpy.typing import NDArray

import easypyverbs as ev

from ..errors import TransferCancelled
from ..protocol.integrity import BLOCK_BYTES, blocks
from .buffers import copy_into

log = logging.getLogger("fate_rdma.channel")

Buffers = Union[bytes, bytearray, memoryview, Any, Sequence[Any]]
#: smallest FedRDMA-E payload that `Message.detach` lends in place; below it a copy costs little and the
#: slot is better kept circulating for the next transfer
LEND_MIN_BYTES = 1 << 20
#: a payload buffer's registration: local reads only (the NIC gathers it; no peer may touch it)
_LOCAL_READ = ev.Access(0)


class Fill:
    """A payload whose bytes are still being copied in, back to front (the order FedRDMA-E writes its
    chunks in), so that a buffered put's copy and its transfer overlap: [ready_from, total) is final.
    `run` copies (or a copier calls `advance` as it goes and `fail` if it cannot finish); the channel
    posts a chunk only once its bytes are final and finishes the checksum once all are. With `digest`
    (checksum.block_digest: crc32c or XXH3, unkeyed, so one copy serves every peer) the copier also
    takes each checksum block's digest while the block it just wrote is still in cache."""

    def __init__(self, total: int, digest: Optional[Tuple[str, Callable[[int, memoryview], Any]]] = None) -> None:
        self.total = total
        self.ready_from = total
        self.error: Optional[BaseException] = None
        #: (checksum kind, block index -> digest of that block) for `digests`
        self.digest = digest
        #: block index -> its digest, filled by `run` (complete once `done` without an error)
        self.digests: Dict[int, Any] = {}
        self._lock = threading.Lock()
        self._wakers: List[Callable[[], None]] = []
        self._when_done: List[Callable[[], None]] = []

    @property
    def done(self) -> bool:
        return self.ready_from == 0 or self.error is not None

    def on_change(self, wake: Callable[[], None]) -> None:
        """`wake()` (any thread, must not block) after every advance and on failure."""
        with self._lock:
            self._wakers.append(wake)

    def when_done(self, fn: Callable[[], None]) -> None:
        """`fn()` once every byte is final or the copy failed (at once if it already is)."""
        with self._lock:
            if not self.done:
                self._when_done.append(fn)
                return
        fn()

    def advance(self, ready_from: int) -> None:
        """Every byte from `ready_from` to the end is final now."""
        if not 0 <= ready_from <= self.ready_from:
            raise ValueError(f"a fill goes back to front: {ready_from} after {self.ready_from}")
        self._move(ready_from, None)

    def fail(self, exc: BaseException) -> None:
        """The copy cannot finish: every transfer of this payload fails (nothing, once every byte is final)."""
        if self.ready_from:
            self._move(self.ready_from, exc)

    def run(self, dest: NDArray[Any], sources: Sequence[Any], block_bytes: int) -> None:
        """Copy `sources`, one after another, into `dest` (numpy's copy, without the GIL), back to front
        in blocks of `block_bytes` (the checksum's blocks), advancing after each; on any error the fill
        fails (its transfers fail, none hangs) and the error is raised."""
        try:
            if dest.dtype != np.uint8 or (self.digest is not None and block_bytes != BLOCK_BYTES):
                raise ValueError(f"a fill copies into bytes (uint8, not {dest.dtype}), in blocks of {BLOCK_BYTES} "
                                 f"bytes where it takes their digests (not {block_bytes})")
            pieces = blocks([memoryview(b).cast("B") for b in sources], block_bytes)
            at = sum(p.nbytes for block in pieces for p in block)
            if at != self.total or dest.nbytes < at:
                raise ValueError(f"a fill of {self.total} bytes from {at} bytes of sources into {dest.nbytes}")
            for i in range(len(pieces) - 1, -1, -1):
                lo = pos = i * block_bytes
                for p in pieces[i]:
                    copy_into(dest, pos, p)
                    pos += p.nbytes
                if self.digest is not None:
                    self.digests[i] = self.digest[1](i, dest[lo:pos].data)
                self.advance(lo)
        except BaseException as exc:
            self.fail(exc)
            raise

    def _move(self, ready_from: int, exc: Optional[BaseException]) -> None:
        with self._lock:
            self.ready_from, self.error = ready_from, self.error or exc
            wakers = list(self._wakers)
            finished, self._when_done = (self._when_done, []) if self.done else ([], self._when_done)
        for fn in wakers + finished:  # one that raises must not keep the others (other peers' transfers) waiting
            try:
                fn()
            except Exception:
                log.exception("fate-rdma: a callback of a payload's copy failed")


class Payload:
    """The caller's buffers registered (zero copy) as one virtual byte range; with a `fill`, bytes that
    are still being copied in."""

    @staticmethod
    def listed(buffers: Buffers) -> Sequence[Any]:
        """`buffers` as a list of buffers (one buffer: a list of it)."""
        if isinstance(buffers, (bytes, bytearray, memoryview)) or not isinstance(buffers, (list, tuple)):
            return [buffers]
        return buffers

    @staticmethod
    def measure(buffers: Buffers) -> int:
        """The bytes of `buffers` (registering nothing)."""
        return sum(ev.buffers.as_byte_view(b).nbytes for b in Payload.listed(buffers))

    def __init__(self, pd: ev.PD, buffers: Buffers, fill: Optional[Fill] = None) -> None:
        self.fill = fill
        buffers = self.listed(buffers)
        self.mrs: List[ev.MR] = []
        self.starts: List[int] = []
        total = 0
        try:
            for b in buffers:
                view = ev.buffers.as_byte_view(b)
                if view.nbytes == 0:
                    continue
                self.mrs.append(pd.reg_mr(view, _LOCAL_READ))  # local read only: works for read-only bytes too
                self.starts.append(total)
                total += view.nbytes
        except Exception:
            self.close()
            raise
        self.total = total
        if fill is not None and fill.total != total:
            self.close()
            raise ValueError(f"a fill of {fill.total} bytes for a payload of {total}")

    def startable(self, back_to_front: bool) -> bool:
        """May a transfer of this payload start now: yes unless it is still being copied in, and then only
        in a mode that posts chunks back to front as their bytes become final. Raises TransferCancelled
        if the copy failed."""
        fill = self.fill
        if fill is not None and fill.error is not None:
            raise TransferCancelled(f"the payload's copy failed: {fill.error}")
        return fill is None or fill.done or back_to_front

    def ready_from(self) -> int:
        """The lowest offset from which every byte of the payload is final (0: all are)."""
        return 0 if self.fill is None else self.fill.ready_from

    def sges(self, offset: int, length: int) -> List[ev.SGE]:
        """SGEs covering [offset, offset+length) of the virtual payload (across buffer boundaries)."""
        out: List[ev.SGE] = []
        end = offset + length
        for mr, start in zip(self.mrs, self.starts):
            lo, hi = max(offset, start), min(end, start + mr.length)
            if lo < hi:
                out.append(mr.sge(lo - start, hi - lo))
        return out

    def views(self) -> List[memoryview]:
        return [mr.view() for mr in self.mrs]

    def close(self) -> None:
        for mr in self.mrs:
            mr.close()
        self.mrs = []


class TransferFuture(concurrent.futures.Future[Dict[str, Any]]):
    """An outgoing transfer: `result(timeout)`, `cancel()`, `add_done_callback`, progress in bytes."""

    def __init__(self, transfer_id: int, total_bytes: int, canceller: Callable[["TransferFuture"], None]) -> None:
        super().__init__()
        self.transfer_id = transfer_id
        self.total_bytes = total_bytes
        self.progress_bytes = 0
        self.mode = ""
        self.window = 0
        self.chunks = 0
        self.chunk_bytes = 0
        self._canceller = canceller
        self._progress_cbs: List[Callable[[int, int], None]] = []

    def rebind(self, canceller: Callable[["TransferFuture"], None]) -> None:
        """Its cancel goes to `canceller` from now on (the transfer moved: resume.py)."""
        self._canceller = canceller

    def add_progress_callback(self, fn: Callable[[int, int], None]) -> None:
        """fn(progress_bytes, total_bytes), called as chunks complete (from the connection's engine thread, a user's thread that took a turn, or a soft NIC's thread)."""
        self._progress_cbs.append(fn)

    def report_progress(self, nbytes: int) -> None:
        """The channel's word that `nbytes` are through: the progress callbacks learn it."""
        self.progress_bytes = nbytes
        for fn in self._progress_cbs:
            fn(nbytes, self.total_bytes)

    def cancel(self) -> bool:
        """Stop the transfer and tell the peer; the future then raises TransferCancelled."""
        if self.done():
            return False
        self._canceller(self)
        return True


class Message:
    """An incoming transfer: metadata, a zero-copy view of the payload, and `release()`.

    FedRDMA-E: the view is the receive slot itself, read-only (so that a released slot holds nothing but
    what its peer wrote: fedrdma_e.SlotReceiver.release); release it promptly, the sender waits for free
    slots. `detach()` if the data must outlive the message (in place, writable, where the peer's pool can
    spare the slot, else copied).
    """

    def __init__(self, peer: str, transfer_id: int, metadata: Dict[str, Any], view: memoryview, mode: str,
                 releaser: Optional[Callable[[], None]] = None, alloc: Optional[Callable[[int], NDArray[Any]]] = None,
                 lend: Optional[Callable[[], bool]] = None) -> None:
        self.peer = peer
        self.transfer_id = transfer_id
        self.metadata = metadata
        #: a receive slot (`lend` given) is handed out read-only; detach() lends the writable view
        self._slot = view if lend is not None else None
        self.view = view.toreadonly() if lend is not None else view
        self.mode = mode
        self._releaser = releaser
        self._alloc = alloc
        self._lend = lend
        #: detach() lent the receive slot itself (no copy)
        self.lent = False
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self.view.nbytes

    def detach(self, copy_up_to: Optional[int] = None) -> Optional[memoryview]:
        """The payload as a byte view that outlives the message. Zero copy when the payload has a buffer
        of its own (FedRDMA reassembly). A FedRDMA-E receive slot of at least LEND_MIN_BYTES is lent in
        place when its connection can spare it (`lend`: at most all but one of the peer's slots): the
        slot goes back to the sender when the last object made from the view is gone (a weak reference
        on the one array every such object holds). Otherwise one copy, into a recycled buffer of the
        endpoint, and the slot goes back now; with `copy_up_to`, only of at most that many bytes: a larger
        copy is not made (None, the message unchanged: a thread that must not wait for it leaves it to another)."""
        view = self.view
        with self._lock:  # asked and taken at once: a release() meanwhile waits, then finds nothing to do
            fn = self._releaser
            if fn is None or self._lend is None or view.nbytes < LEND_MIN_BYTES or not self._lend():
                fn = None
            else:
                self._releaser = None
        if fn is not None:
            slot, self._slot, self.view, self.lent = self._slot, None, memoryview(b""), True
            assert slot is not None, "a message that lends its slot has one"
            anchor = np.frombuffer(slot, dtype=np.uint8)  # its base is `slot`: every derived object holds it
            del view, slot
            weakref.finalize(anchor, fn).atexit = False  # (at exit the connection is gone with it)
            return anchor.data
        if self._releaser is not None:
            if copy_up_to is not None and view.nbytes > copy_up_to:
                return None
            buf = self._alloc(view.nbytes) if self._alloc is not None else np.empty(view.nbytes, dtype=np.uint8)
            copy_into(buf, 0, view)  # without the GIL: gigabytes into fresh memory take seconds
            view = buf.data.cast("B")
        self.release()
        return view

    def release(self) -> None:
        with self._lock:
            fn, self._releaser = self._releaser, None
        self.view, self._slot = memoryview(b""), None
        if fn is not None:
            fn()

    def __enter__(self) -> "Message":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<Message {self.transfer_id} from {self.peer}: {self.nbytes} bytes, {self.mode}>"
