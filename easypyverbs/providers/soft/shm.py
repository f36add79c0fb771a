"""The soft provider's same-host path, second way: memory that the requester allocated as shared (a memfd,
`shared_array`) is read by the responder through a read-only mapping of it, with a plain memcpy, instead
of through process_vm_readv. The kernel's cross-process copy pins every page it reads and copies at about
half memcpy's speed here (1 GiB with an XXH3 of each piece, two threads: 146 ms by process_vm_readv, 95 ms
from the mapping; `/tmp`-free scratch measurement on the 2-core test machine, 2026-11-26).

Requester: `shared_array(n)` gives a numpy byte array backed by a memfd named "easypyverbs-shm"; while it
lives, `region_of(spans)` names the region that holds a request's spans as (fd, inode, base address,
size), which rides after the request's spans on the wire (wire.PULL_REGION).

Responder: `PeerRegions` maps a named region of the requester's process read-only, once, through
/proc/<pid>/fd/<fd> (which needs the same permission as process_vm_readv: the path's proof already
showed it), after checking that the file is that inode, a memfd of this provider, and at least `size`
bytes long, and sealed against shrinking (F_SEAL_SHRINK: a file cut short under the mapping would
fault this process on a read); every span must lie inside the region, or the request is refused. A region that cannot be
mapped is read with process_vm_readv as before. The mappings belong to the responder thread of one
QP and are unmapped when it ends (a peer that dies mid-transfer leaves nothing mapped here; a memfd holds
no name in /dev/shm or anywhere else, its memory goes with the last mapping), and a region the peer has
freed is unmapped at the next request that names a region once PRUNE_EVERY_S has passed, or when a new
region is mapped; at most MAX_MAPPED stay mapped.
"""
from __future__ import annotations

import bisect
import collections
import ctypes
import fcntl
import logging
import mmap
import os
import stat
import threading
import time
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

log = logging.getLogger("easypyverbs.soft")

NAME = "easypyverbs-shm"
#: regions a responder keeps mapped at once (least recently used unmapped first)
MAX_MAPPED = 16
#: a responder looks this often (at its next request naming a region) for regions the peer has freed
PRUNE_EVERY_S = 1.0
#: the largest region a responder maps (a peer cannot make us map more address space than this)
MAX_REGION_BYTES = 1 << 40

Span = Tuple[int, int]
Region = Tuple[int, int, int, int]  # (fd in the requester, inode, base address there, size)

_lock = threading.Lock()
_bases: List[int] = []  # sorted base addresses of live regions in this process
_regions: Dict[int, Region] = {}  # base -> region


def _forget(base: int, fd: int) -> None:
    with _lock:
        i = bisect.bisect_left(_bases, base)
        if i < len(_bases) and _bases[i] == base:
            del _bases[i]
        _regions.pop(base, None)
    try:
        os.close(fd)
    except OSError:
        pass


def shared_array(nbytes: int) -> np.ndarray:
    """A zeroed byte array of `nbytes` in shared memory (a memfd) that a same-host peer's soft NIC can map
    to read it without process_vm_readv; like np.zeros otherwise. The region is forgotten and its fd
    closed once the array (and every view of it) is gone."""
    n = max(1, int(nbytes))
    fd = os.memfd_create(NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, n)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)  # see PeerRegions._map
        m = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    arr = np.frombuffer(m, dtype=np.uint8)  # holds `m`: the region lives as long as any view of it
    base, ino = int(arr.ctypes.data), os.fstat(fd).st_ino
    with _lock:
        bisect.insort(_bases, base)
        _regions[base] = (fd, ino, base, n)
    weakref.finalize(m, _forget, base, fd)
    return arr


def region_of(spans: Sequence[Span]) -> Optional[Region]:
    """The live shared region of this process that holds every one of `spans`, if one does."""
    if not spans or not _bases:
        return None
    lo = min(a for a, _ in spans)
    hi = max(a + n for a, n in spans)
    with _lock:
        i = bisect.bisect_right(_bases, lo) - 1
        if i < 0:
            return None
        r = _regions[_bases[i]]
    return r if hi <= r[2] + r[3] else None


_memmove = ctypes.memmove  # a foreign call: runs without the GIL


class Mapped:
    """One region of the peer, mapped read-only here."""

    def __init__(self, m: mmap.mmap, region: Region) -> None:
        self.map, self.region = m, region
        self._arr: Optional[np.ndarray] = np.frombuffer(m, dtype=np.uint8)
        self.addr = int(self._arr.ctypes.data)

    def holds(self, spans: Sequence[Span]) -> bool:
        base, size = self.region[2], self.region[3]
        return all(base <= a and n >= 0 and a + n <= base + size for a, n in spans)

    def copy(self, remote: List[Span], local: List[Span]) -> None:
        """Copy the peer's bytes at `remote` (its addresses, inside this region) to `local` (ours)."""
        base = self.region[2]
        ri = li = 0
        roff = loff = 0
        while ri < len(remote) and li < len(local):
            (ra, rn), (la, ln) = remote[ri], local[li]
            k = min(rn - roff, ln - loff)
            _memmove(la + loff, self.addr + (ra - base) + roff, k)
            roff += k
            loff += k
            if roff == rn:
                ri, roff = ri + 1, 0
            if loff == ln:
                li, loff = li + 1, 0
        if ri < len(remote) or li < len(local):
            raise OSError(22, "shared region copy: remote and local spans differ in length")

    def close(self) -> None:
        self._arr = None
        try:
            self.map.close()
        except BufferError:  # a copy helper still holds a view: the mapping goes when it does
            pass


class PeerRegions:
    """The regions of process `pid` that one responder has mapped (used by that responder's thread)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._maps: "collections.OrderedDict[Region, Mapped]" = collections.OrderedDict()
        self._refused: set = set()
        self.mapped_total = 0  # regions ever mapped (tests, doctor)
        self._pruned = time.monotonic()

    def get(self, region: Region) -> Optional[Mapped]:
        """The mapping of `region`, made on first use; None if it cannot be mapped (read the memory
        with process_vm_readv instead)."""
        now = time.monotonic()
        if now - self._pruned > PRUNE_EVERY_S:
            self._prune()
        got = self._maps.get(region)
        if got is not None:
            self._maps.move_to_end(region)
            return got
        if region in self._refused:
            return None
        try:
            got = Mapped(self._map(region), region)
        except (OSError, ValueError) as exc:
            self._refused.add(region)
            log.info("soft: cannot map region fd %d of pid %d (%s); reading it with process_vm_readv",
                     region[0], self.pid, exc)
            return None
        self._prune()
        self._maps[region] = got
        self.mapped_total += 1
        while len(self._maps) > MAX_MAPPED:
            self._maps.popitem(last=False)[1].close()
        return got

    def _prune(self) -> None:
        """Unmap the regions the peer has freed (its fd closed or now another file), so that a mapping here
        does not keep memory alive that the peer let go of (longer than until its next request naming a region,
        or PRUNE_EVERY_S, or the end of the QP)."""
        self._pruned = time.monotonic()
        for r in list(self._maps):
            try:
                gone = os.stat(f"/proc/{self.pid}/fd/{int(r[0])}").st_ino != r[1]
            except OSError:
                gone = True
            if gone:
                self._maps.pop(r).close()

    def _map(self, region: Region) -> mmap.mmap:
        fd_no, ino, _base, size = region
        if not 0 < size <= MAX_REGION_BYTES:
            raise ValueError(f"region of {size} bytes")
        path = f"/proc/{self.pid}/fd/{int(fd_no)}"
        if not os.readlink(path).startswith(f"/memfd:{NAME}"):
            raise ValueError("not a shared region of this provider")
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_ino != ino or st.st_size < size:
                raise ValueError("the fd is not the region named (inode or size differ)")
            # a file that could shrink under the mapping would fault this process (SIGBUS) on a read
            if not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
                raise ValueError("the region is not sealed against shrinking")
            return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)

    def close(self) -> None:
        while self._maps:
            self._maps.popitem()[1].close()


def self_test() -> Tuple[bool, str]:
    """Whether shared regions can be mapped here (doctor): one of ours, through /proc, read back."""
    try:
        arr = shared_array(4096)
        arr[:16] = np.frombuffer(b"easypyverbs-shm!", dtype=np.uint8)
        base = int(arr.ctypes.data)
        regions = PeerRegions(os.getpid())
        try:
            region = region_of([(base, 16)])
            m = regions.get(region) if region is not None else None
            if m is None:
                return False, "a memfd region could not be mapped through /proc (process_vm_readv is used)"
            got = np.zeros(16, dtype=np.uint8)
            m.copy([(base, 16)], [(int(got.ctypes.data), 16)])
        finally:
            regions.close()
        ok = got.tobytes() == b"easypyverbs-shm!"
        return ok, "memfd regions map and read back" if ok else "a mapped memfd region read back wrong bytes"
    except (OSError, ValueError, AttributeError) as exc:  # no memfd_create, no sealing, /proc unreadable
        return False, f"shared memory unusable ({exc}); process_vm_readv is used"
