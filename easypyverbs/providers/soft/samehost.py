"""The soft provider's same-host data path: when both ends of a QP run on one machine, the responder
copies a WRITE's or SEND's bytes straight out of the requester's memory with process_vm_readv(2):
one copy by the kernel, no socket, the GIL released, instead of the requester pushing them through
loopback TCP (two copies and the TCP stack); a large copy is split across COPY_THREADS threads (the
kernel's copy runs at memory speed per core, so two move it almost twice as fast). Only the request headers
and answers still travel over the QP's TCP connection, so ordering, completions and errors are unchanged.

Who reads what: the responder reads only the addresses the requester names for that request (its
own posted buffers), checked against the length it announced, and writes them only into its own MR
after the usual rkey and bounds checks. Both ends must be able to see each other (same host, same
PID namespace, permission to read the other's memory): the requester puts 16 random bytes in its
memory and the responder must read them back through process_vm_readv before the path is used,
so a pid that names another process, or a peer on another host, falls back to TCP; so does a
peer in another network namespace (it stands for another site: its bytes must cross that network).
Where the requester's bytes lie in shared memory it allocated (shm.py), the responder copies them
from a mapping of it instead (`read_from(src=...)`), the same split across threads.
Off with `EASYPYVERBS_SOFT_SAME_HOST=off` or `open_device(provider="soft", same_host=False)`; never
used with a link model (that emulates a WAN).
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import functools
import os
import secrets
import socket
import sys
import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

Span = Tuple[int, int]  # (address, length)

#: a copy is split across this many threads (the kernel copies; the GIL is released), each part at least
#: SPLIT_MIN_BYTES: one thread's process_vm_readv moves about 8-9 GB/s here, two about 15
COPY_THREADS = max(1, min(2, os.cpu_count() or 1))
SPLIT_MIN_BYTES = 1 << 20

#: libc's process_vm_readv; None: not looked up yet, False: not to be had here
_readv: Any = None
_helpers: Optional[concurrent.futures.ThreadPoolExecutor] = None
_helpers_lock = threading.Lock()
_idle = threading.Semaphore(0)  # helper threads free now (set with the pool)


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _fn() -> Optional[Callable[..., int]]:
    global _readv
    if _readv is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            f = libc.process_vm_readv
        except (OSError, AttributeError):
            _readv = False
            return None
        f.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                      ctypes.c_ulong]
        f.restype = ctypes.c_ssize_t
        _readv = f
    return _readv or None


def _iovecs(spans: Sequence[Span]) -> "ctypes.Array[_IOVec]":
    arr = (_IOVec * len(spans))()
    for i, (addr, n) in enumerate(spans):
        arr[i].iov_base, arr[i].iov_len = addr, n
    return arr


def _advance(spans: List[Span], n: int) -> List[Span]:
    out = []
    for addr, length in spans:
        if n >= length:
            n -= length
            continue
        out.append((addr + n, length - n))
        n = 0
    return out


def _split(spans: List[Span], sizes: List[int]) -> List[List[Span]]:
    """`spans` cut into consecutive pieces of `sizes` bytes (summing to theirs), in one pass: a copy of many
    pieces over many spans costs pieces + spans steps, not their product (cutting 950 pieces of a 148-array
    payload each from the start took about 40 % of the time the copy did)."""
    out: List[List[Span]] = []
    i, off = 0, 0
    for n in sizes:
        cur: List[Span] = []
        while n > 0:
            addr, length = spans[i]
            k = min(n, length - off)
            cur.append((addr + off, k))
            n, off = n - k, off + k
            if off == length:
                i, off = i + 1, 0
        out.append(cur)
    return out


def _helper_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _helpers, _idle
    with _helpers_lock:
        if _helpers is None:
            workers = max(1, COPY_THREADS - 1)
            _idle = threading.Semaphore(workers)
            _helpers = concurrent.futures.ThreadPoolExecutor(max_workers=workers,
                                                             thread_name_prefix="easypyverbs-soft-copy")
        return _helpers


Piece = Tuple[List[Span], List[Span], int, int]  # (remote spans, local spans, offset in the copy, length)


Reader = Callable[[List[Span], List[Span]], None]  # copies remote spans into local ones


def _helped(read: Reader, part: List[Piece], on_piece: Optional[Callable[[int, int], None]]) -> None:
    try:
        _copy(read, part, on_piece)
    finally:
        _idle.release()


def _copy(read: Reader, part: List[Piece], on_piece: Optional[Callable[[int, int], None]]) -> None:
    for r, l, at, n in part:
        read(r, l)
        if on_piece is not None:
            on_piece(at, n)


def _groups(pieces: Sequence[Tuple[int, int, bool]], parts: int, total: int) -> List[List[Tuple[int, int]]]:
    """`pieces` in at most `parts` runs of about equal bytes, each run beginning at a piece that begins a
    block (or the first)."""
    out: List[List[Tuple[int, int]]] = [[]]
    step, acc = -(-total // parts), 0
    for at, n, first in pieces:
        if first and out[-1] and acc >= step * len(out) and len(out) < parts:
            out.append([])
        out[-1].append((at, n))
        acc += n
    return out


def read_from(pid: int, remote: Sequence[Span], local: Sequence[Span], threads: int = 0,
              pieces: Optional[Sequence[Tuple[int, int, bool]]] = None,
              on_piece: Optional[Callable[[int, int], None]] = None, src: Optional[Any] = None) -> None:
    """Copy the bytes at `remote` in process `pid` into `local` here (equal totals); OSError on failure.
    `src` (shm.Mapped, holding every remote span): copy from that mapping of the peer's shared region
    instead of with process_vm_readv.
    A large copy is split into `threads` parts (default COPY_THREADS) done at once: this thread does the
    first, idle helper threads the rest; a part no helper is free for (other copies hold them) is done
    here too, so concurrent copies never queue behind each other. `pieces` ((offset, length, begins a
    block) covering the copy in order): copy piece by piece, calling `on_piece(offset, length)` after
    each in the thread that copied it; a part begins only where a block does, so each block's pieces
    are copied by one thread, in order."""
    rem, loc = [s for s in remote if s[1]], [s for s in local if s[1]]
    total = sum(n for _, n in rem)
    read: Reader = src.copy if src is not None else (lambda r, l: _read(pid, r, l))
    parts = max(1, min(threads or COPY_THREADS, total // SPLIT_MIN_BYTES))
    if total != sum(n for _, n in loc) or (pieces is None and parts == 1):
        read(rem, loc)
        return
    if pieces is None:
        step = -(-total // parts)
        step += -step % 4096  # parts start on page boundaries of the payload
        runs = [[(off, min(step, total - off))] for off in range(0, total, step)]
    else:
        runs = _groups(pieces, parts, total)
    sizes = [n for run in runs for _, n in run]  # (the runs cover the copy in order)
    if sum(sizes) != total:
        raise ValueError(f"read_from: pieces cover {sum(sizes)} of the copy's {total} bytes")
    rem_cut, loc_cut = iter(_split(rem, sizes)), iter(_split(loc, sizes))
    work = [[(next(rem_cut), next(loc_cut), at, n) for at, n in run] for run in runs]
    pool, futures, mine = _helper_pool(), [], [work[0]]
    for part in work[1:]:
        if not _idle.acquire(blocking=False):
            mine.append(part)
            continue
        try:
            futures.append(pool.submit(_helped, read, part, on_piece))
        except RuntimeError:  # the pool is shut down (interpreter exit): this thread copies it
            _idle.release()
            mine.append(part)
    try:
        for part in mine:
            _copy(read, part, on_piece)
    finally:
        errors = [f.exception() for f in futures]  # every part ends before the caller reuses the memory
    for e in errors:
        if e is not None:
            raise e


def _read(pid: int, remote: List[Span], local: List[Span]) -> None:
    f = _fn()
    if f is None:
        raise OSError(38, "process_vm_readv is not available")  # ENOSYS
    rem, loc = remote, local
    while rem and loc:
        n = f(pid, _iovecs(loc), len(loc), _iovecs(rem), len(rem), 0)
        if n <= 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err) if err else 'no progress'}")
        rem, loc = _advance(rem, n), _advance(loc, n)
    if rem or loc:
        raise OSError(22, "process_vm_readv: remote and local spans differ in length")


class Probe:
    """16 random bytes in this process that a peer must read back to prove it can use the path."""

    def __init__(self) -> None:
        self.value = secrets.token_bytes(16)
        self._buf = ctypes.create_string_buffer(self.value, 16)
        self.addr = ctypes.addressof(self._buf)


def usable(pid: int, addr: int, expect: bytes) -> bool:
    """Can this process read `expect` at `addr` in `pid`? (The peer's proof of the same host.)"""
    got = ctypes.create_string_buffer(len(expect))
    try:
        read_from(pid, [(addr, len(expect))], [(ctypes.addressof(got), len(expect))])
    except OSError:
        return False
    return got.raw == expect


def _proc_tcp_address(family: int, host: str, port: int) -> str:
    """`host`:`port` as /proc/net/tcp{,6} writes it (each 32-bit word of the address in host byte order, hex)."""
    raw = socket.inet_pton(family, host)
    words = [raw[i:i + 4] for i in range(0, len(raw), 4)]
    return "".join(int.from_bytes(w, sys.byteorder).to_bytes(4, "big").hex().upper() for w in words) + f":{port:04X}"


def peer_owns(pid: int, sock: Any) -> bool:
    """Does process `pid` hold the other end of our TCP connection `sock` (a socket, or a TLS stream over one)?
    The socket whose local and remote addresses are ours swapped is looked up in /proc/net/tcp{,6} (this
    network namespace), and its inode among /proc/<pid>/fd. A pid named by a peer must pass this before
    either side copies memory of that process: our probe bytes in its memory alone would not prove it is the
    peer (the peer could have written them into a third process it talks to)."""
    s = getattr(sock, "sock", sock)
    try:
        family = s.family
        mine, theirs = s.getsockname()[:2], s.getpeername()[:2]
        want = (_proc_tcp_address(family, *theirs), _proc_tcp_address(family, *mine))
        inode = None
        with open("/proc/net/tcp6" if family == socket.AF_INET6 else "/proc/net/tcp") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if len(cols) > 9 and (cols[1], cols[2]) == want and cols[9] != "0":  # (0: a TIME_WAIT entry)
                    inode = cols[9]
                    break
        if inode is None:
            return False
        target = f"socket:[{inode}]"
        for fd in os.listdir(f"/proc/{int(pid)}/fd"):
            try:
                if os.readlink(f"/proc/{int(pid)}/fd/{fd}") == target:
                    return True
            except OSError:
                continue
    except (OSError, ValueError, AttributeError):
        return False
    return False


def same_network_namespace(pid: int) -> bool:
    """Is process `pid` in this process's network namespace? Peers in different namespaces stand for
    different sites (e.g. a WAN testbed): their bytes must cross the network between them."""
    try:
        return os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net")
    except OSError:
        return False


def self_test() -> Tuple[bool, str]:
    """Whether the path works here at all (doctor): read our own probe through the syscall, and find this
    process at the other end of a loopback connection (peer_owns: where /proc does not show sockets, no peer
    can be proven, so the path stays off)."""
    if _fn() is None:
        return False, "process_vm_readv not found in libc"
    p = Probe()
    if not usable(os.getpid(), p.addr, p.value):
        return False, f"process_vm_readv refused (errno {ctypes.get_errno()}: {os.strerror(ctypes.get_errno())})"
    if not _finds_own_sockets():
        return False, "a peer's pid cannot be checked here (/proc/net/tcp or /proc/<pid>/fd unreadable)"
    return True, "process_vm_readv works"


@functools.lru_cache(maxsize=1)
def _finds_own_sockets() -> bool:
    """peer_owns on a loopback connection of this process's own (once per process)."""
    try:
        with socket.create_server(("127.0.0.1", 0)) as srv, socket.create_connection(srv.getsockname(), 5) as c:
            a, _ = srv.accept()
            with a:
                return peer_owns(os.getpid(), c)
    except OSError:
        return False


def available() -> Tuple[bool, str]:
    """Whether an endpoint opened now with the default may take the path: not switched off in the environment,
    and working here (self_test), with the reason."""
    if not enabled_by_env():
        return False, "switched off by EASYPYVERBS_SOFT_SAME_HOST"
    return self_test()


def enabled_by_env() -> bool:
    from .wire import switched_on

    return switched_on("EASYPYVERBS_SOFT_SAME_HOST")

