"""The soft provider's same-host path, second way: memory that the requester allocated as shared (a memfd,
`shared_array`) is read by the responder through a read-only mapping of it, with a plain memcpy, instead
of through process_vm_readv. The kernel's cross-process copy pins every page it reads and copies at half to
two thirds of memcpy's speed (a 1 GiB copy with an XXH3 of each piece took about 1.5 x as long by
process_vm_readv as from the mapping on a 2-core machine).

Requester: `shared_array(n)` gives a numpy byte array over a memfd named "easypyverbs-shm", sealed against
shrinking; while it lives, `region_of(spans)` names the region that holds a request's spans as (fd,
inode, base address, size), which rides after the request's spans on the wire (wire.PULL_REGION). The
region leaves the registry before its memory is unmapped (so a later allocation at the same address is
never taken for it).

Responder: `PeerRegions` takes a duplicate of the named fd from the requester with pidfd_getfd(2) (which
needs the permission process_vm_readv needs: the path's proof already showed it; no file is reopened, so
nothing can block or be opened with the responder's credentials), and maps it read-only once it is a
regular file on the kernel's internal shmem mount (not hugetlbfs: a hole there faults a reader with
SIGBUS; mount and inode read from /proc/self/fdinfo before its filesystem is asked anything), named as
this provider's, of the inode and exact size named, and sealed against shrinking (a file cut short
under the mapping would fault this process). Every span must lie inside the region, or the request is
refused; while the file has a hole anywhere (a buffer not yet written whole), requests are read with
process_vm_readv instead (a read fault on a hole would allocate memory charged to the responder). A
region that cannot be mapped is read with process_vm_readv as before. The mappings belong to the
responder thread of one QP: at most MAX_MAPPED, one per inode, each at most MAX_REGION_BYTES; a region
the peer has freed (its fd, seen in /proc/<pid>/fdinfo, closed or another file) is unmapped within
PRUNE_EVERY_S, between requests or while the responder waits for one, and all are unmapped when the
thread ends (a peer that dies mid-transfer leaves nothing mapped here; a memfd holds no name in /dev/shm
or anywhere else, its memory goes with the last mapping). What a peer can still do:
punch a hole between the check and the copy (F_SEAL_SHRINK allows it), and the read there allocates a
page charged to the responder: at most the region's size.
"""
from __future__ import annotations

import bisect
import collections
import contextlib
import ctypes
import fcntl
import functools
import logging
import mmap
import os
import stat
import threading
import time
import weakref
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

log = logging.getLogger("easypyverbs.soft")

NAME = "easypyverbs-shm"
#: regions a responder keeps mapped at once (least recently used unmapped first)
MAX_MAPPED = 16
#: regions a responder remembers it could not map (each is then read with process_vm_readv)
MAX_REFUSED = 64
#: a responder looks this often (between requests, and while it waits for one) for regions the peer has freed
PRUNE_EVERY_S = 1.0
#: the largest region a responder maps (a peer cannot make us map more address space than this)
MAX_REGION_BYTES = 256 << 30
_SYS_PIDFD_GETFD = 438  # the same number on every architecture (the unified syscall table)

Span = Tuple[int, int]
Region = Tuple[int, int, int, int]  # (fd in the requester, inode, base address there, size)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.syscall.restype = ctypes.c_long
_MAP_FAILED = ctypes.c_void_p(-1).value

_lock = threading.RLock()  # (a collection inside the lock may release a region on the same thread)
_bases: List[int] = []  # sorted base addresses of live regions in this process
_regions: Dict[int, Region] = {}  # base -> region


def _release(base: int, n: int, fd: int) -> None:
    """The last view of a region is gone: forget it, then unmap it, then close its fd (in that order: an
    address that is reused after the unmap never finds the old region)."""
    with _lock:
        i = bisect.bisect_left(_bases, base)
        if i < len(_bases) and _bases[i] == base:
            del _bases[i]
        _regions.pop(base, None)
    _libc.munmap(base, n)
    try:
        os.close(fd)
    except OSError:
        pass


def shared_array(nbytes: int) -> np.ndarray:
    """A zeroed byte array of `nbytes` (at least 1) in shared memory (a memfd) that a same-host peer's soft
    NIC can map to read it without process_vm_readv; otherwise like np.zeros, except that a child made by
    fork() shares it. The region is forgotten, unmapped and its fd closed once the array (and every view
    of it) is gone. OSError where memfds cannot be made (the caller may fall back to private memory)."""
    n = max(1, int(nbytes))
    fd = os.memfd_create(NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    base = None
    try:
        os.ftruncate(fd, n)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)  # see PeerRegions._map
        base = _libc.mmap(None, n, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if base is None or base == _MAP_FAILED:
            base = None
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of a {n}-byte memfd: {os.strerror(err)}")
        region = (fd, os.fstat(fd).st_ino, base, n)  # (built outside the lock: it may run a collection)
        owner = (ctypes.c_uint8 * n).from_address(base)
        # holds `owner` (through the memoryview): the region lives as long as any view of it
        arr = np.frombuffer(memoryview(owner), dtype=np.uint8)
    except BaseException:
        if base is not None:
            _libc.munmap(base, n)
        os.close(fd)
        raise
    with _lock:
        bisect.insort(_bases, base)
        _regions[base] = region
    # not at interpreter exit: a daemon thread (a NIC's copy) may still touch the memory then; the kernel frees it
    weakref.finalize(owner, _release, base, n, fd).atexit = False
    return arr


def own_inode(ino: int) -> bool:
    """Is `ino` the inode of a live shared region of this process (a region a peer names must never be one of
    ours: a forked child holds our memfds too)?"""
    with _lock:
        return any(r[1] == ino for r in _regions.values())


def region_of(spans: Sequence[Span]) -> Optional[Region]:
    """The live shared region of this process that holds every one of `spans`, if one does."""
    if not spans or not _bases:
        return None
    lo = min(a for a, _ in spans)
    hi = max(a + n for a, n in spans)
    with _lock:
        i = bisect.bisect_right(_bases, lo) - 1
        r = _regions.get(_bases[i]) if i >= 0 else None
    return r if r is not None and hi <= r[2] + r[3] else None


_memmove = ctypes.memmove  # a foreign call: runs without the GIL
_shmem_mount: List[int] = []


def _fd_identity(pid: str, fd: int) -> Optional[Tuple[int, int]]:
    """(mount id, inode) of file descriptor `fd` of process `pid` ("self" for this one), from
    /proc/<pid>/fdinfo: read from the open file itself, so no filesystem is asked (a stat through a hung
    NFS or FUSE mount would block); None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/fdinfo/{int(fd)}", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        return int(fields[b"mnt_id"]), int(fields[b"ino"])
    except (OSError, KeyError, ValueError):
        return None


def _internal_shmem_mount() -> int:
    """The mount id of the kernel's internal shmem mount, where every memfd without MFD_HUGETLB lives."""
    if not _shmem_mount:
        fd = os.memfd_create("easypyverbs-probe", os.MFD_CLOEXEC)
        try:
            ident = _fd_identity("self", fd)
        finally:
            os.close(fd)
        if ident is None:
            raise OSError(2, "/proc/self/fdinfo shows no mount id or inode")
        _shmem_mount.append(ident[0])
    return _shmem_mount[0]


class Mapped:
    """One region of the peer, mapped read-only here (with our duplicate of its fd, to see whether it has holes)."""

    def __init__(self, m: mmap.mmap, fd: int, region: Region, writable: bool = False) -> None:
        self.map, self.fd, self.region, self.writable = m, fd, region, writable
        self._arr: Optional[np.ndarray] = np.frombuffer(m, dtype=np.uint8)
        self.addr = int(self._arr.ctypes.data)

    def holds(self, spans: Sequence[Span]) -> bool:
        base, size = self.region[2], self.region[3]
        return all(base <= a and n >= 0 and a + n <= base + size for a, n in spans)

    def allocated(self) -> bool:
        """Is every page of the file allocated (no hole anywhere)? One fstat: the file's block count (SEEK_HOLE
        or mincore over the spans cost 0.5-1.7 ms per 32 MiB request here, a fifth of the copy)."""
        try:
            return os.fstat(self.fd).st_blocks * 512 >= self.region[3]
        except OSError:
            return False

    def copy(self, remote: List[Span], local: List[Span]) -> None:
        """Copy the peer's bytes at `remote` (its addresses, inside this region) to `local` (ours); with a
        writable mapping (a push), ours at `local` to the peer's at `remote`."""
        base, into = self.region[2], self.writable
        ri = li = 0
        roff = loff = 0
        while ri < len(remote) and li < len(local):
            (ra, rn), (la, ln) = remote[ri], local[li]
            k = min(rn - roff, ln - loff)
            if into:
                _memmove(self.addr + (ra - base) + roff, la + loff, k)
            else:
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
        except BufferError:  # cannot happen (no view is handed out); the mapping then goes with the object
            pass
        try:
            os.close(self.fd)
        except OSError:
            pass


class PeerRegions:
    """The regions of process `pid` that one responder has mapped (used by that responder's thread only)."""

    def __init__(self, pid: int, writable: bool = False) -> None:
        """`writable`: map the regions for writing into them (a requester pushing a WRITE), not reading."""
        self.pid, self.writable = pid, writable
        self._pidfd: Optional[int] = None
        self._maps: "collections.OrderedDict[int, Mapped]" = collections.OrderedDict()  # by inode
        self._refused: "collections.OrderedDict[Region, None]" = collections.OrderedDict()
        self.mapped_total = 0  # regions ever mapped (tests, doctor)
        self._pruned = time.monotonic()

    def source(self, region: Region, spans: Sequence[Span]) -> Tuple[bool, Optional[Mapped]]:
        """(spans lie inside the region, the mapping to copy them from or None to use process_vm_readv)."""
        m = self.get(region)
        if m is None:
            return True, None
        if not m.holds(spans):
            return False, None
        return True, m if m.allocated() else None

    def get(self, region: Region) -> Optional[Mapped]:
        """The mapping of `region`, made on first use; None if it cannot be mapped (read the memory with
        process_vm_readv instead)."""
        self.maybe_prune()
        got = self._maps.get(region[1])
        if got is not None:
            if got.region != region:
                return None  # the same file named otherwise (another fd, base or size): not this mapping
            self._maps.move_to_end(region[1])
            return got
        if region in self._refused:
            return None
        try:
            got = self._map(region)
        except (OSError, ValueError) as exc:
            if not self._refused:  # once per QP: a peer must not be able to fill the log
                log.info("soft: cannot map region fd %d of pid %d (%s); reading it with process_vm_readv",
                         region[0], self.pid, exc)
            self._refused[region] = None
            while len(self._refused) > MAX_REFUSED:
                self._refused.popitem(last=False)
            return None
        self._prune()
        self._maps[region[1]] = got
        self.mapped_total += 1
        while len(self._maps) > MAX_MAPPED:
            self._maps.popitem(last=False)[1].close()
        return got

    def _prune(self) -> None:
        """Unmap the regions the peer has freed (its fd closed or now another file), so that a mapping here
        does not keep memory alive that the peer let go of."""
        self._pruned = time.monotonic()
        for ino, m in list(self._maps.items()):
            ident = _fd_identity(str(self.pid), m.region[0])
            if ident is None or ident != (_internal_shmem_mount(), ino):
                self._maps.pop(ino).close()

    @property
    def mapped(self) -> int:
        return len(self._maps)

    def maybe_prune(self) -> None:
        """Prune if PRUNE_EVERY_S has passed (the responder calls it between requests and while idle)."""
        if self._maps and time.monotonic() - self._pruned > PRUNE_EVERY_S:
            self._prune()

    def _map(self, region: Region) -> Mapped:
        fd_no, ino, _base, size = region
        if not 0 < size <= MAX_REGION_BYTES:
            raise ValueError(f"region of {size} bytes")
        if self._pidfd is None:
            self._pidfd = os.pidfd_open(self.pid)
        fd = _libc.syscall(_SYS_PIDFD_GETFD, self._pidfd, int(fd_no), 0)  # a duplicate: nothing is reopened
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pidfd_getfd: {os.strerror(err)}")
        try:
            # who the file is, before asking its filesystem anything (an fstat on a hung mount would block)
            if _fd_identity("self", fd) != (_internal_shmem_mount(), ino):
                raise ValueError("not the memfd named (another mount or inode)")
            if not os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{NAME}"):
                raise ValueError("not a shared region of this provider")
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError("not a regular file")
            # a file that could shrink under the mapping would fault this process (SIGBUS) on a read
            if not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
                raise ValueError("the region is not sealed against shrinking")
            if st.st_size != size:
                raise ValueError(f"the file holds {st.st_size} bytes, the region names {size}")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if self.writable else 0)
            return Mapped(mmap.mmap(fd, size, mmap.MAP_SHARED, prot), fd, region, self.writable)
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        while self._maps:
            self._maps.popitem()[1].close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


@functools.lru_cache(maxsize=1)
def works() -> bool:
    """self_test, once per process."""
    return self_test()[0]


def push_enabled() -> bool:
    """May large WRITEs into a peer's shared memory be copied by the requester (push)? Where shared regions
    work here, unless EASYPYVERBS_SOFT_PUSH is off (each side offers or takes it in the HELLO exchange)."""
    from .wire import switched_on

    return switched_on("EASYPYVERBS_SOFT_PUSH") and works()


def push_always() -> bool:
    """EASYPYVERBS_SOFT_PUSH=always: a receiver takes every push offered, even with nothing else to copy."""
    return os.environ.get("EASYPYVERBS_SOFT_PUSH", "").strip().lower() == "always"


_placing = 0  # same-host WRITEs this process's responders are placing now (pulling or being pushed)
_placing_lock = threading.Lock()


@contextlib.contextmanager
def placing() -> Iterator[int]:
    """Count a same-host WRITE being placed by this process's NIC while the block runs; yields how many others
    were being placed when it began."""
    global _placing
    with _placing_lock:
        others = _placing
        _placing += 1
    try:
        yield others
    finally:
        with _placing_lock:
            _placing -= 1


def take_push(others_placing: int) -> bool:
    """Should a receiver let the sender copy a WRITE in (push) rather than read it itself? Only while this
    process copies another WRITE already (a FATE arbiter that two clients upload to at once): its cores are
    taken, the sender's are not. With nothing else to copy the receiver reads it faster itself: split over
    its copy threads, the next WRITE's request already queued, where a push copies on one sender thread and
    costs a round trip (PUSH_AT) per WRITE: a pushed 1 GiB took about 1.5 x as long as one the receiver read
    itself (`bench transfer --scenarios loopback`). EASYPYVERBS_SOFT_PUSH=always: take every push."""
    return others_placing > 0 or push_always()


def self_test() -> Tuple[bool, str]:
    """Whether shared regions can be mapped here (doctor): one of ours, through pidfd_getfd, read back."""
    try:
        arr = shared_array(4096)
        arr[:16] = np.frombuffer(b"easypyverbs-shm!", dtype=np.uint8)
        base = int(arr.ctypes.data)
        regions = PeerRegions(os.getpid())
        try:
            region = region_of([(base, 16)])
            m = regions.get(region) if region is not None else None
            if m is None:
                return False, "a memfd region could not be mapped (pidfd_getfd); process_vm_readv is used"
            got = np.zeros(16, dtype=np.uint8)
            m.copy([(base, 16)], [(int(got.ctypes.data), 16)])
        finally:
            regions.close()
        ok = got.tobytes() == b"easypyverbs-shm!"
        return ok, "memfd regions map and read back" if ok else "a mapped memfd region read back wrong bytes"
    except (OSError, ValueError, AttributeError) as exc:  # no memfd_create, no sealing, no pidfd_getfd
        return False, f"shared memory unusable ({exc}); process_vm_readv is used"
