"""Receive-side memory that is not registered: FedRDMA reassembly buffers, recycled across rounds."""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Set

import numpy as np
from numpy.typing import NDArray

from easypyverbs import buffers as ev_buffers

from .. import metrics

log = logging.getLogger("fate_rdma.channel")
_shared_failed: List[BaseException] = []  # the first failure to allocate shared memory (warned once)


def _unreferenced(buf: NDArray[Any], extra: int = 0) -> bool:
    """True if nothing but the cache's list refers to `buf` (plus `extra` local names of the caller).

    Every view handed out of a cached buffer (a numpy slice, a memoryview of it, an array built on
    that memoryview) keeps a reference to the buffer itself, because numpy collapses a view's base to
    the array that owns the memory: so the buffer's reference count says whether any of them is
    alive, where a weak reference to the handed-out slice would not (a slice of a slice does not keep
    the first slice alive). References expected: the list, this function's parameter, getrefcount's
    argument, and `extra`."""
    return sys.getrefcount(buf) == 3 + extra


def fresh(n: int, shared: bool = False) -> NDArray[Any]:
    """n bytes of new memory, not yet faulted in; `shared`: in a memfd (easypyverbs.buffers.shared_array),
    which a peer's soft NIC on this host reads through a mapping, at memcpy's speed (a send source).

    Its pages are faulted in by the copies that fill it (`copy_into`), which run without the GIL, so
    first-touch costs are spread over the transfer and never stall other threads. Faulting up front
    with MAP_POPULATE held the GIL for the whole mmap call: 13 s for 2 GiB on a fresh VM, whose
    memory the hypervisor backs on first touch, long enough for every peer of the process to see
    its QPs time out (RETRY_EXC_ERR)."""
    if shared:
        try:
            return ev_buffers.shared_array(n)
        except OSError as exc:  # no memfd here (or no fds left): private memory, read by process_vm_readv
            if not _shared_failed:
                _shared_failed.append(exc)
                log.warning("fate-rdma: cannot allocate shared memory (%s); same-host peers read this process's "
                            "payloads with process_vm_readv instead (slower)", exc)
    return np.empty(max(n, 1), dtype=np.uint8)


def zero_fill(buf: Any, piece_bytes: int = 64 << 20) -> None:
    """Zero `buf` (and fault every page of it in) without holding the GIL: reading /dev/zero into it
    makes the kernel write each page inside the read() call, which releases the GIL, a piece at a time."""
    view = memoryview(buf).cast("B")
    try:
        with open("/dev/zero", "rb", buffering=0) as zero:
            for off in range(0, view.nbytes, piece_bytes):
                piece = view[off:off + piece_bytes]
                while piece.nbytes:
                    n = zero.readinto(piece)
                    if not n:
                        raise OSError("short read from /dev/zero")
                    piece = piece[n:]
    except OSError:
        view[:] = bytes(view.nbytes)


def clear(buf: Any) -> None:
    """Zero `buf`, whose pages are already in memory (a released receive slot), without holding the GIL:
    numpy's fill releases it for the whole call and stores in user space. On a warm 1 GiB slot (4 KiB
    pages) it took 0.023 s where zero_fill's reads of /dev/zero took 0.13 s beside a busy thread (each
    64 MiB read takes the GIL back; a thread that holds it costs the switch interval each time) and
    0.04 s alone; on fresh pages /dev/zero faults them in faster (0.44 s against 0.54 s per GiB),
    so zero_fill stays for those."""
    np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8).fill(0)


#: pieces smaller than this are copied holding the GIL; larger ones without it. numpy lets go of the GIL for
#: every copy above a few hundred bytes, and where another thread of the process wants the GIL (a connection
#: thread handling completions and credits) each piece then waits to take it back: a put of LoRA adapters is
#: tens of pieces of 24-576 KiB (float64, ranks 4-32), and such a copy took about ten times as long inside a
#: `bench fate` round as alone. Held, a piece this size blocks the other threads for at most ~0.1 ms (a
#: memcpy at ~10 GB/s), far below the 5 ms switch interval; LoRA rounds got shorter (docs/benchmarks.md).
GIL_COPY_BYTES = 1 << 20


def copy_into(dest: NDArray[Any], offset: int, src: memoryview) -> None:
    """dest[offset:offset+len(src)] = src (`dest` uint8, `src` any C-contiguous buffer). A piece of
    GIL_COPY_BYTES or more is copied without holding the GIL (numpy releases it for the copy, and for the
    page faults the copy takes on fresh memory); a smaller one holding it (GIL_COPY_BYTES)."""
    n = src.nbytes
    if n < GIL_COPY_BYTES:
        flat = src if src.format == "B" and src.ndim == 1 else src.cast("B")
        dest.data[offset:offset + n] = flat
        return
    np.copyto(dest[offset:offset + n], np.frombuffer(src, dtype=np.uint8, count=n))


class RecvBuffers:
    """FedRDMA reassembly buffers, recycled: a buffer is handed out again once no message view and no
    array made from one refers to it any more (CPython reference count), so round after round of
    same-sized payloads lands in memory that is already faulted in. At most `max_bytes` are kept, and
    `trim` lets go of those unused for a while (an idle endpoint holds little: FATE jobs spend minutes
    training between two exchanges). `shared`: buffers in shared memory (fresh(shared=True)), for what
    is sent to same-host peers."""

    #: `trim` looks at the buffers at most this often (its callers tick more often than that)
    TRIM_EVERY_S = 1.0

    def __init__(self, max_bytes: int, shared: bool = False) -> None:
        self.max_bytes, self.shared = max_bytes, shared
        self._bufs: List[NDArray[Any]] = []
        self._used_at: List[float] = []  # when each of `_bufs` was last handed out (time.monotonic)
        self._lock = threading.Lock()
        self._trimmed_at = time.monotonic()
        self.reused = 0
        #: bytes handed out in recycled (already faulted-in) memory, and in fresh memory
        self.reused_bytes = 0
        self.fresh_bytes = 0
        #: bytes let go of by `trim`, in all
        self.trimmed_bytes = 0

    @property
    def held_bytes(self) -> int:
        """Bytes of the buffers kept for reuse now (in use by a message or an array, or free)."""
        with self._lock:
            return sum(b.nbytes for b in self._bufs)

    def get(self, n: int) -> NDArray[Any]:
        with self._lock:
            for i in range(len(self._bufs)):
                b = self._bufs[i]
                if n <= b.nbytes <= 2 * n + (1 << 20) and _unreferenced(b, extra=1):
                    self.reused += 1
                    self.reused_bytes += n
                    self._used_at[i] = time.monotonic()
                    return b[:n]
            self.fresh_bytes += n
            if n > self.max_bytes:
                return fresh(n, self.shared)
            while self._bufs and sum(x.nbytes for x in self._bufs) + n > self.max_bytes:
                idle = [j for j in range(len(self._bufs)) if _unreferenced(self._bufs[j])]
                if not idle:
                    return fresh(n, self.shared)
                del self._bufs[idle[0]], self._used_at[idle[0]]
            b = fresh(n, self.shared)
            self._bufs.append(b)
            self._used_at.append(time.monotonic())
            return b[:n]

    def trim(self, idle_s: float, force: bool = False) -> int:
        """Let go of every buffer nothing refers to that was last handed out `idle_s` or more ago (0: never);
        the bytes let go of. At most once every TRIM_EVERY_S unless `force`."""
        now = time.monotonic()
        if not idle_s or (not force and now - self._trimmed_at < self.TRIM_EVERY_S):
            return 0
        with self._lock:
            self._trimmed_at = now
            keep = [i for i in range(len(self._bufs))
                    if now - self._used_at[i] < idle_s or not _unreferenced(self._bufs[i], extra=0)]
            if len(keep) == len(self._bufs):
                return 0
            freed = sum(self._bufs[i].nbytes for i in range(len(self._bufs)) if i not in keep)
            self._bufs = [self._bufs[i] for i in keep]
            self._used_at = [self._used_at[i] for i in keep]
            self.trimmed_bytes += freed
        return freed

    def clear(self) -> None:
        with self._lock:
            self._bufs, self._used_at = [], []


class Budget:
    """The endpoint's receive-memory budget: pools, staging areas and reassembly buffers in flight
    reserve from it before they are allocated, and give back when freed. Each peer may hold at most
    `peer_limit_bytes` of it (ChannelConfig.peer_budget_fraction), on all of its connections together (a
    peer that dials while being dialed has two): one peer cannot take what the others need."""

    def __init__(self, limit_bytes: int, peer_limit_bytes: Optional[int] = None) -> None:
        self.limit_bytes = limit_bytes
        self.peer_limit_bytes = limit_bytes if peer_limit_bytes is None else min(peer_limit_bytes, limit_bytes)
        self.held_bytes = 0
        self._metered = 0  # of held_bytes, what the registered_bytes gauge counts (metrics.memory)
        self._by_peer: Dict[str, int] = {}
        self._told: Set[str] = set()  # peers whose refusal this endpoint's log has explained
        self._lock = threading.Lock()

    def held_by(self, peer: str) -> int:
        with self._lock:
            return self._by_peer.get(peer, 0)

    def free_for(self, peer: str) -> int:
        """What `peer` could still reserve: the least of what is left of its part and of the budget."""
        with self._lock:
            return max(0, min(self.peer_limit_bytes - self._by_peer.get(peer, 0), self.limit_bytes - self.held_bytes))

    def reserve(self, nbytes: int, peer: str) -> bool:
        with self._lock:
            mine = self._by_peer.get(peer, 0)
            if nbytes < 0 or self.held_bytes + nbytes > self.limit_bytes or mine + nbytes > self.peer_limit_bytes:
                refused = True
            else:
                refused = False
                self.held_bytes += nbytes
                self._by_peer[peer] = mine + nbytes
                if metrics.memory(nbytes):
                    self._metered += nbytes
            first = refused and peer not in self._told
            if first:
                self._told.add(peer)
            held = self.held_bytes
        if first:  # the detail stays here: what the peer is told names neither the budget nor what is left
            log.warning("fate-rdma: refused %d bytes of receive memory to %s: it holds %d of the %d bytes one peer "
                        "may hold (peer_budget_fraction), and all peers %d of %d (memory_budget_bytes); further "
                        "refusals of this peer are logged at debug level", nbytes, peer, mine, self.peer_limit_bytes,
                        held, self.limit_bytes)
        elif refused:
            log.debug("fate-rdma: refused %d bytes of receive memory to %s (it holds %d, all peers %d)", nbytes, peer,
                      mine, held)
        return not refused

    def release(self, nbytes: int, peer: str) -> None:
        with self._lock:
            counted = min(nbytes, self._metered)
            if counted:
                metrics.memory(-counted)
                self._metered -= counted
            self.held_bytes = max(0, self.held_bytes - nbytes)
            left = self._by_peer.get(peer, 0) - nbytes
            if left > 0:
                self._by_peer[peer] = left
            else:
                self._by_peer.pop(peer, None)


class Share:
    """One connection's part of the endpoint's Budget, reserved under its peer's name (so within what that
    peer may hold): its receive memory (staging buffers, FedRDMA-E slots as they grow and shrink, FedRDMA
    reassembly buffers in flight), reserved and released through here, and all of it given back at once when
    the connection ends."""

    def __init__(self, budget: Budget, peer: str) -> None:
        self.budget, self.peer = budget, peer
        self.held_bytes = 0
        self._lock = threading.Lock()  # (the engine thread grows slots while a user thread may lend one)

    @property
    def free_bytes(self) -> int:
        """What this connection could still reserve (Budget.free_for its peer)."""
        return self.budget.free_for(self.peer)

    def reserve(self, nbytes: int) -> bool:
        with self._lock:
            if not self.budget.reserve(nbytes, self.peer):
                return False
            self.held_bytes += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.budget.release(nbytes, self.peer)
            self.held_bytes -= nbytes

    def release_all(self) -> None:
        with self._lock:
            self.budget.release(self.held_bytes, self.peer)
            self.held_bytes = 0
