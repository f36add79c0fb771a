"""The memory behind one connection's FedRDMA-E receive slots, which grows and shrinks with the traffic
(the protocol's side: protocol/pool.py), and reports of what the pools hold.

Each slot's whole range (its largest size, the offer's slot_bytes) is reserved at connect as an
anonymous private mapping without swap reservation (MAP_NORESERVE): address space only, no memory.
Only the slot's current extent (header, metadata area, `capacity` payload bytes) is registered as its
MR: on a NIC that pins what is registered (pyverbs), that extent is what the slot holds; on the soft
provider, only the pages a transfer wrote are resident. Growing registers a longer extent at the same
address (so a grant is an rkey and a capacity, never an address); shrinking deregisters, gives the
pages past the smaller extent back (MADV_DONTNEED: they read as zeros if ever touched again) and
registers the smaller extent. Fresh pages are zeros, so a grown slot never shows stale bytes.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import sys
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

import numpy as np
from numpy.typing import NDArray

import easypyverbs as ev
from easypyverbs.capabilities import PlacesWrites

from ..protocol.integrity import BLOCK_BYTES
from ..protocol.pool import ReceivePool
from .buffers import Budget, RecvBuffers, zero_fill
from ..protocol.hello import PoolOffer

log = logging.getLogger(__name__)
PAGE = mmap.PAGESIZE
#: what a peer may do to receive memory: write it, never read it (a released slot holds what the
#: application last made of its payload, in place: the peer must not read that back)
WRITE_ONLY = ev.Access.LOCAL_WRITE | ev.Access.REMOTE_WRITE
#: Linux's value: Python's mmap module does not name it
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


#: frees a shared mapping's pages in its file (MADV_DONTNEED would only drop this mapping of them)
MADV_REMOVE = getattr(mmap, "MADV_REMOVE", 9)


def _shared(n: int) -> Optional[NDArray[Any]]:
    """`n` bytes of sparse shared memory for a slot, or None where a memfd cannot be made."""
    try:
        return ev.buffers.shared_array(n)
    except OSError:
        return None


def _placing_after_close(mr: ev.MR) -> bool:
    """Was a WRITE still being placed when `mr`'s remote access ended (where the provider places WRITEs itself)?"""
    return isinstance(mr, PlacesWrites) and mr.placing_after_close


def _pages(n: int) -> int:
    """`n` rounded up to whole pages."""
    return -(-n // PAGE) * PAGE


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def resident_bytes(arr: NDArray[Any]) -> Optional[int]:
    """Bytes of `arr` (page-aligned) in memory now, by mincore(2); None where that cannot be asked."""
    n = arr.nbytes
    if not n:
        return 0
    try:
        libc = _libc()
        vec = np.zeros(_pages(n) // PAGE, dtype=np.uint8)
        if libc.mincore(ctypes.c_void_p(arr.ctypes.data), ctypes.c_size_t(n),
                        vec.ctypes.data_as(ctypes.c_void_p)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return int(np.count_nonzero(vec & 1)) * PAGE


class SlotMemory:
    """One connection's receive slots: each its own mapping and MR. `pin`: registration pins memory
    (a real NIC): fault a new extent in before registering it, without holding the GIL (zero_fill),
    so that other connections' threads keep running while a large slot grows."""

    def __init__(self, pd: ev.PD, offer: PoolOffer, initial_payload_bytes: int, pin: bool,
                 track: Optional[Callable[[int], Any]] = None, shared: bool = False) -> None:
        """`track`: a block hasher (checksum.block_hasher): each slot's MR digests the peer's WRITEs per
        checksum block as they land, where the provider can (`landed`). `shared`: each slot a memfd
        (easypyverbs.buffers.shared_array, sparse: pages only where written), so that a peer's soft NIC
        on this host may copy its large WRITEs in itself (the soft provider's push); private memory where
        memfds cannot be made."""
        self._pd, self.offer, self.pin, self.track = pd, offer, pin, track
        #: each slot's digests of the blocks its current grant's WRITEs placed (PlacesWrites.track_writes), or None
        self.landed: List[Optional[Any]] = []
        self._untracked: Set[int] = set()
        #: slots whose MR is registered with no remote access (revoked, kept for MR.rekey at the next grant)
        self._keyless: Set[int] = set()
        self.initial_payload_bytes = min(initial_payload_bytes, offer.slot_payload_bytes)
        self._maps: List[Optional[mmap.mmap]] = []  # (None: a shared slot, unmapped with its last view)
        self._arrs: List[NDArray[Any]] = []
        self.capacity: List[int] = []
        self.mrs: List[Optional[ev.MR]] = []
        try:
            for _ in range(offer.slots):
                arr = _shared(_pages(offer.slot_bytes)) if shared else None
                mm = None
                if arr is None:
                    mm = mmap.mmap(-1, _pages(offer.slot_bytes), flags=mmap.MAP_PRIVATE | MAP_NORESERVE,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
                    arr = np.frombuffer(mm, dtype=np.uint8)
                self._maps.append(mm)
                self._arrs.append(arr)
                self.capacity.append(self.initial_payload_bytes)
                self.mrs.append(None)
                self.landed.append(None)
                self.mrs[-1] = self._register(len(self.mrs) - 1, 0)
        except BaseException:
            self.close()
            raise

    def slot_bytes(self, slot: int) -> int:
        """The slot's current extent: header, metadata area and payload room."""
        return self.offer.offset_in_slot(self.capacity[slot])

    @property
    def reserved_bytes(self) -> int:
        """What the slots hold registered now (and reserve of the endpoint's memory budget)."""
        return sum(self.offer.offset_in_slot(c) for c in self.capacity)

    def resident_bytes(self) -> Optional[int]:
        """What the slots hold in memory now (soft provider: the pages written since they last shrank)."""
        total = 0
        for arr, cap in zip(self._arrs, self.capacity):  # (lists a concurrent close replaces, never changes)
            r = resident_bytes(arr[:_pages(self.offer.offset_in_slot(cap))])
            if r is None:
                return None
            total += r
        return total

    def view(self, slot: int) -> memoryview:
        return self._arrs[slot].data[:self.slot_bytes(slot)]

    def array(self, slot: int) -> NDArray[Any]:
        """The slot's memory (its largest extent): it outlives `close` for as long as this array or a view of it."""
        return self._arrs[slot]

    def _register(self, slot: int, faulted_bytes: int) -> ev.MR:
        n = self.slot_bytes(slot)
        if self.pin and n > faulted_bytes:
            zero_fill(self._arrs[slot][faulted_bytes:n])  # fresh pages are zeros already: this only faults them in
        mr = self._pd.reg_mr(self._arrs[slot][:n], WRITE_ONLY, revocable=True)
        try:
            self._track(slot, mr)
        except BaseException:
            mr.close()
            raise
        return mr

    def _track(self, slot: int, mr: ev.MR) -> None:
        """Before the rkey is granted: every WRITE under it is seen; never again for a slot whose MR was
        revoked with a WRITE still being placed (that WRITE may change bytes after they are digested)."""
        self.landed[slot] = None
        if self.track is not None and slot not in self._untracked and isinstance(mr, PlacesWrites):
            self.landed[slot] = mr.track_writes(self.offer.offset_in_slot(0), BLOCK_BYTES, self.track)

    def revoke(self, slot: int) -> None:
        """From now on the peer's WRITEs to the slot fail (remote access error). Where the provider can
        (MR.revoke_remote: the soft provider; pyverbs through a memory window, easypyverbs pyverbs_windows), the
        slot stays registered and `grant` gives it a new rkey, which costs a fraction of registering it anew (on
        a NIC, no pinning and mapping of its pages again); else its MR is closed."""
        mr = self.mrs[slot]
        if mr is None or slot in self._keyless:
            return
        if not mr.closed and mr.revoke_remote() and not _placing_after_close(mr):
            self._keyless.add(slot)
        else:  # (a WRITE still being placed past the bound stays with that MR: the next grant registers anew)
            self._close(slot)

    def _close(self, slot: int) -> None:
        mr, self.mrs[slot] = self.mrs[slot], None
        self._keyless.discard(slot)
        if mr is not None:
            mr.close()
            if _placing_after_close(mr):
                self._untracked.add(slot)

    def grant(self, slot: int) -> int:
        """Give the slot out again as it is, under a new rkey (returned): a revoked slot's MR takes a new key
        (MR.rekey) where the provider kept it registered, else the slot is registered anew."""
        mr = self.mrs[slot]
        if mr is not None and slot in self._keyless:
            try:
                rkey = mr.rekey()
            except ev.UsageError:
                raise
            except ev.EasyVerbsError as exc:  # (a window that cannot be bound: the provider logged it)
                log.warning("fate-rdma: receive slot %d: a new key could not be given (%s): registered anew", slot, exc)
                self._close(slot)
                return self.resize(slot, self.capacity[slot])
            self._keyless.discard(slot)
            try:
                self._track(slot, mr)
            except BaseException:
                self._close(slot)  # (as a failed registration: the next grant registers it anew)
                raise
            return rkey
        return self.resize(slot, self.capacity[slot])

    def resize(self, slot: int, capacity: int) -> int:
        """Register the slot anew with room for `capacity` payload bytes; returns the new rkey. If the
        new registration fails, the slot is registered as it was and the error raised."""
        old_cap, old_bytes = self.capacity[slot], self.slot_bytes(slot)
        self._close(slot)
        self.capacity[slot] = capacity
        new_bytes = self.slot_bytes(slot)
        if new_bytes < old_bytes:
            self._discard(slot, new_bytes, old_bytes)
        try:
            mr = self._register(slot, old_bytes)
        except BaseException:
            self.capacity[slot] = old_cap
            self.mrs[slot] = self._register(slot, old_bytes)
            raise
        self.mrs[slot] = mr
        return mr.rkey

    def _discard(self, slot: int, lo: int, hi: int) -> None:
        """Give the pages of [lo, hi) back to the system (whole pages only; a shared slot's from its file)."""
        mm = self._maps[slot]
        start, end = _pages(lo), min(_pages(hi), self._arrs[slot].nbytes)
        if end <= start:
            return
        if mm is not None:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)
        elif _libc().madvise(ctypes.c_void_p(self._arrs[slot].ctypes.data + start), ctypes.c_size_t(end - start),
                             MADV_REMOVE) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_REMOVE) of a shared receive slot")

    def close(self) -> None:
        for i in range(len(self.mrs)):
            self._close(i)
        self.mrs, self.capacity = [], []
        arrs, maps = self._arrs, self._maps
        self._arrs, self._maps = [], []
        del arrs
        for mm in maps:
            if mm is None:
                continue  # a shared slot: unmapped when its last view goes (shared_array)
            try:
                mm.close()  # now, unless a message the application still holds views the slot
            except BufferError:
                pass  # unmapped when the last view goes


def pool_policy(cfg: Any) -> Dict[str, Any]:
    """What a ChannelConfig lets FedRDMA-E receive pools hold, per peer and in all (for `doctor`)."""
    from ..protocol.frames import HEADER, MAX_META

    area = HEADER.size + MAX_META
    initial = min(cfg.slot_initial_bytes, cfg.slot_bytes)
    return {"mode": cfg.mode, "pool_slots": cfg.pool_slots, "slot_bytes": cfg.slot_bytes,
            "slot_initial_bytes": initial, "pool_idle_s": cfg.pool_idle_s,
            "idle_bytes_per_peer": cfg.pool_slots * (area + initial) if cfg.mode == "fedrdma-e" else 0,
            "max_bytes_per_peer": cfg.pool_slots * (area + cfg.slot_bytes) if cfg.mode == "fedrdma-e" else 0,
            "memory_budget_bytes": cfg.budget_bytes, "peer_budget_bytes": cfg.peer_budget_bytes,
            "recv_cache_bytes": cfg.recv_cache_bytes}


def pool_report(pools: Iterable[Tuple[str, SlotMemory, ReceivePool, Set[int]]], budget: Budget,
                recycled: Optional[RecvBuffers] = None) -> Dict[str, Any]:
    """What these FedRDMA-E receive pools hold now (each: its peer, its memory, its grants, the slots the
    application holds in place): per peer and in all, registered (reserved from the memory budget) and resident
    bytes, and each slot's room and state; with `recycled`, the reassembly and copy buffers kept for reuse."""
    peers: Dict[str, Any] = {}
    for peer, slots, pool, lent in pools:
        # "lent": held by the application in place (Message.detach), "held": a message not yet released
        peers[peer] = {"reserved_bytes": slots.reserved_bytes, "resident_bytes": slots.resident_bytes(),
                         # slots whose grants are memory windows (pyverbs, EASYPYVERBS_MEMORY_WINDOWS=on)
                         "windowed_slots": sum(m is not None and m.windowed for m in slots.mrs),
                         "slots": [{"payload_bytes": pool.capacity[i], "state": "lent" if i in lent else pool.state[i].value}
                                   for i in range(pool.nslots)]}
    resident = [p["resident_bytes"] for p in peers.values()]
    return {"reserved_bytes": sum(p["reserved_bytes"] for p in peers.values()),
            "resident_bytes": None if None in resident else sum(resident),
            "budget_held_bytes": budget.held_bytes, "budget_limit_bytes": budget.limit_bytes, "peers": peers,
            "recycled_bytes": recycled.held_bytes if recycled is not None else 0,
            "recycled_trimmed_bytes": recycled.trimmed_bytes if recycled is not None else 0}


def describe(policy: Dict[str, Any], live: Optional[Dict[str, Any]] = None) -> List[str]:
    """Lines for `doctor`: the pool policy, and (for a running endpoint) what the pools hold."""
    mib = 1 << 20
    if policy["mode"] != "fedrdma-e":
        lines = [f"receive memory: mode {policy['mode']} (staging and reassembly buffers), "
                 f"budget {policy['memory_budget_bytes'] / mib:.0f} MiB, one peer at most "
                 f"{policy['peer_budget_bytes'] / mib:.0f} MiB of it"]
    else:
        idle = f"after {policy['pool_idle_s']:g} s idle" if policy["pool_idle_s"] else "never (pool_idle_s: 0)"
        lines = [f"FedRDMA-E receive pool per peer: {policy['pool_slots']} slots; "
                 f"{policy['idle_bytes_per_peer'] / mib:.1f} MiB at connect and when idle, up to "
                 f"{policy['max_bytes_per_peer'] / mib:.1f} MiB under load (slot_bytes "
                 f"{policy['slot_bytes'] / mib:.1f} MiB); shrinks {idle}; all peers together within the "
                 f"memory budget of {policy['memory_budget_bytes'] / mib:.0f} MiB, one peer within "
                 f"{policy['peer_budget_bytes'] / mib:.0f} MiB of it"]
    idle = f"{policy['pool_idle_s']:g} s" if policy["pool_idle_s"] else "never (pool_idle_s: 0)"
    lines.append(f"reassembly and small-message copy buffers: kept for reuse up to "
                 f"{policy['recv_cache_bytes'] / mib:.0f} MiB (recv_cache_bytes), let go of once unused for {idle}; "
                 f"a FATE party's put copies (put_buffer_bytes) likewise")
    return lines + (describe_live(live) if live is not None else [])


def describe_live(live: Dict[str, Any]) -> List[str]:
    """Lines saying what a running endpoint's pools and buffers hold (pool_report; logged at its close)."""
    mib, res = 1 << 20, live["resident_bytes"]
    lines = [f"pools now: {live['reserved_bytes'] / mib:.1f} MiB registered, "
             f"{'?' if res is None else f'{res / mib:.1f}'} MiB resident, for {len(live['peers'])} peer(s); "
             f"budget {live['budget_held_bytes'] / mib:.1f} of {live['budget_limit_bytes'] / mib:.0f} MiB held",
             f"reassembly and copy buffers now: {live.get('recycled_bytes', 0) / mib:.1f} MiB kept, "
             f"{live.get('recycled_trimmed_bytes', 0) / mib:.1f} MiB let go of when unused"]
    for name, p in sorted(live["peers"].items()):
        rooms = ", ".join(f"{s['payload_bytes'] / mib:.1f} MiB {s['state']}" for s in p["slots"])
        lines.append(f"  {name}: {rooms}")
    return lines
