"""End-to-end checksums of payloads, computed in parallel blocks (crc32c releases the GIL).

A transfer's checksum is crc32c over the big-endian crc32c of each 4 MiB block of the payload, so
both sides can split the work across cores and the sender can compute it while chunks are already
on the wire (the header, which carries it, is posted last).
"""
from __future__ import annotations

import concurrent.futures
import os
import struct
import threading
from typing import Dict, List, Sequence

import crc32c

BLOCK_BYTES = 4 << 20
_POOLS: Dict[str, concurrent.futures.ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool(kind: str) -> concurrent.futures.ThreadPoolExecutor:
    """Two pools, so that no task ever waits on its own pool: "payload" runs whole-payload checksums
    (which wait for their blocks), "block" runs block checksums (which wait for nothing). One shared
    pool deadlocked as soon as every worker held a payload task waiting for blocks queued behind it."""
    with _POOLS_LOCK:
        pool = _POOLS.get(kind)
        if pool is None:
            workers = max(1, min(4, os.cpu_count() or 1))
            pool = _POOLS[kind] = concurrent.futures.ThreadPoolExecutor(max_workers=workers,
                                                                        thread_name_prefix=f"fate-rdma-crc-{kind}")
        return pool


def _blocks(views: Sequence[memoryview]) -> List[List[memoryview]]:
    """Fixed 4 MiB blocks of the concatenated payload, each as the pieces of the buffers it covers (no copy)."""
    out: List[List[memoryview]] = []
    room = 0
    for v in views:
        pos = 0
        while pos < v.nbytes:
            if room == 0:
                out.append([])
                room = BLOCK_BYTES
            take = min(room, v.nbytes - pos)
            out[-1].append(v[pos:pos + take])
            pos += take
            room -= take
    return out


def _crc_pieces(pieces: List[memoryview]) -> int:
    crc = 0
    for p in pieces:
        crc = crc32c.crc32c(p, crc)
    return crc


def payload_checksum(views: Sequence[memoryview]) -> int:
    """crc32c of the per-block crc32c list; independent of how the payload is split into buffers."""
    blocks = _blocks(views)
    if len(blocks) <= 1:
        crcs = [_crc_pieces(b) for b in blocks]
    else:
        crcs = list(_pool("block").map(_crc_pieces, blocks))
    return crc32c.crc32c(struct.pack(f"!{len(crcs)}I", *crcs))


def payload_checksum_async(views: Sequence[memoryview]) -> "concurrent.futures.Future[int]":
    """payload_checksum on a worker thread (the sender overlaps it with the first chunks on the wire)."""
    return _pool("payload").submit(payload_checksum, list(views))
