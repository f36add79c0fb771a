"""The soft provider's same-host data path: when both ends of a QP run on one machine, the responder
copies a WRITE's or SEND's bytes straight out of the requester's memory with process_vm_readv(2):
one copy by the kernel, no socket, the GIL released, instead of the requester pushing them through
loopback TCP (two copies and the TCP stack). Only the request headers and answers still travel
over the QP's TCP connection, so ordering, completions and errors are unchanged.

Who reads what: the responder reads only the addresses the requester names for that request (its
own posted buffers), checked against the length it announced, and writes them only into its own MR
after the usual rkey and bounds checks. Both ends must be able to see each other (same host, same
PID namespace, permission to read the other's memory): the requester puts 16 random bytes in its
memory and the responder must read them back through process_vm_readv before the path is used,
so a pid that names another process, or a peer on another host, falls back to TCP; so does a
peer in another network namespace (it stands for another site: its bytes must cross that network).
Off with `EASYPYVERBS_SOFT_SAME_HOST=off` or `open_device(provider="soft", same_host=False)`; never
used with a link model (that emulates a WAN).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import secrets
from typing import List, Optional, Sequence, Tuple

Span = Tuple[int, int]  # (address, length)

_readv = None


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _fn() -> Optional[object]:
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


def read_from(pid: int, remote: Sequence[Span], local: Sequence[Span]) -> None:
    """Copy the bytes at `remote` in process `pid` into `local` here (equal totals); OSError on failure."""
    f = _fn()
    if f is None:
        raise OSError(38, "process_vm_readv is not available")  # ENOSYS
    rem, loc = [s for s in remote if s[1]], [s for s in local if s[1]]
    while rem and loc:
        n = f(pid, _iovecs(loc), len(loc), _iovecs(rem), len(rem), 0)  # type: ignore[operator]
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


def same_network_namespace(pid: int) -> bool:
    """Is process `pid` in this process's network namespace? Peers in different namespaces stand for
    different sites (e.g. a WAN testbed): their bytes must cross the network between them."""
    try:
        return os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net")
    except OSError:
        return False


def self_test() -> Tuple[bool, str]:
    """Whether the path works here at all (doctor): read our own probe through the syscall."""
    if _fn() is None:
        return False, "process_vm_readv not found in libc"
    p = Probe()
    if usable(os.getpid(), p.addr, p.value):
        return True, "process_vm_readv works"
    return False, f"process_vm_readv refused (errno {ctypes.get_errno()}: {os.strerror(ctypes.get_errno())})"


def enabled_by_env() -> bool:
    return os.environ.get("EASYPYVERBS_SOFT_SAME_HOST", "auto").strip().lower() not in ("off", "0", "no", "false")
