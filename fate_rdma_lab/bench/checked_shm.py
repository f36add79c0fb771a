"""The same-host baselines: a copy straight out of the sender's shared memory, plain and with the channel's check.

`bench transfer`'s same-host rows (`loopback`) are measured against raw loopback TCP, but what bounds them on
a machine is the cheapest way one process can take another's bytes at all: one memcpy out of a mapping of
the sender's memfd, split over the soft provider's copy threads, the GIL released (ctypes). `shm_copy` is
that copy alone. `shm_copy_checked` adds the channel's end-to-end check done as cheaply as Python can: the
receiving threads digest each piece (the soft provider's PIECE_BYTES) right after copying it, from cache,
while the sender digests its blocks from memory at the same time (it has no copy of its own to fold them
into, as the channel's sender of a payload it did not fill has not), sends them over the baselines' TCP
connection, and the receiver compares. No protocol, no frames: what the check costs a same-host move on
this machine, a baseline for the channel's same-host row that pays for it too.

The receiver maps the sender's region exactly as the soft provider's responder does (shm.PeerRegions:
pidfd_getfd of the named memfd, checked before it is mapped); where that is refused the row says so.
"""
from __future__ import annotations

import socket
import threading
from typing import Any, Dict, List, Optional, cast

import numpy as np

from easypyverbs.providers.soft import shm
from easypyverbs.providers.soft.landing import PIECE_BYTES
from easypyverbs.providers.soft.samehost import COPY_THREADS

from fate_rdma_lab.bench import checked_tcp
from fate_rdma.protocol.integrity import BLOCK_BYTES

METHODS = ("shm_copy", "shm_copy_checked")


def sender_region(data: np.ndarray) -> Optional[List[int]]:
    """The shared region (fd, inode, base, size) holding `data`, as the peer is told it; None if `data` is not in
    memory from `shared_array`."""
    addr = int(data.ctypes.data)
    region = shm.region_of([(addr, data.nbytes)])
    return list(region) if region is not None else None


def send_digests(sock: socket.socket, payload: memoryview, kind: str) -> None:
    """The sender's part of a checked copy: digest every block of `payload` (from memory) and send the digests
    as checked_tcp does after its payload."""
    blob, _ = checked_tcp.digest(payload, kind)
    checked_tcp.send_blob(sock, blob)


class Receiver:
    """The peer's end: the sender's regions mapped once (kept across repetitions), a pre-touched buffer."""

    def __init__(self) -> None:
        self.regions: Optional[shm.PeerRegions] = None
        self.buf = np.empty(0, dtype=np.uint8)

    def receive(self, cmd: Dict[str, Any], sock: socket.socket) -> Dict[str, Any]:
        """Copy `total_bytes` from the sender's region at `addr` into our buffer, split over COPY_THREADS
        threads by block; with `check`, digest each piece after its copy and compare with the sender's
        digests read from `sock`. Answers b"r" on `sock` when it starts, b"k" (or b"x") when done."""
        pid = int(cmd["pid"])
        # the sender's sender_region: (fd, inode, base, size), a list in JSON
        region = cast(shm.Region, tuple(int(x) for x in cmd["region"]))
        addr, total = int(cmd["addr"]), int(cmd["total_bytes"])
        kind = cmd.get("check")
        if self.regions is None or self.regions.pid != pid:
            self.regions = shm.PeerRegions(pid)
        try:
            src = self.regions.get(region)
        except Exception as exc:  # (get logs and refuses what it cannot map; anything else is the same answer)
            src, why = None, f"{type(exc).__name__}: {exc}"
        else:
            why = "the sender's region could not be mapped (see the peer's log)"
        if src is None or not src.holds([(addr, total)]):
            sock.sendall(b"n")
            return {"ok": False, "error": why if src is None else "the payload is not inside the region named"}
        if self.buf.nbytes != total:
            self.buf = np.ones(total, dtype=np.uint8)  # touched, like the raw TCP buffer
        view, local = self.buf.data, int(self.buf.ctypes.data)
        blocks = -(-total // BLOCK_BYTES)
        digests: List[bytes] = [b""] * blocks
        failed: List[BaseException] = []
        start = checked_tcp.starter(kind, total) if kind else None

        def work(first: int) -> None:
            try:
                for b in range(first, blocks, COPY_THREADS):
                    h = start(b) if start is not None else None
                    for _, off, n in checked_tcp.pieces_of_block(b, total, PIECE_BYTES):
                        src.copy([(addr + off, n)], [(local + off, n)])
                        if h is not None:
                            h.update(view[off:off + n])
                    if h is not None:
                        digests[b] = checked_tcp.encode(h.digest())
            except BaseException as exc:  # (reported below)
                failed.append(exc)

        sock.sendall(b"r")  # ready: the sender starts its clock after this
        threads = [threading.Thread(target=work, args=(k,), name=f"shm-copy-{k}") for k in range(1, COPY_THREADS)]
        for t in threads:
            t.start()
        work(0)
        for t in threads:
            t.join()
        error = f"copy failed: {failed[0]!r}" if failed else None
        if kind and error is None:
            error = checked_tcp.compare(sock, b"".join(digests), blocks, kind)
        sock.sendall(b"x" if error else b"k")
        return {"ok": False, "error": error} if error else {"ok": True}

    def close(self) -> None:
        if self.regions is not None:
            self.regions.close()
