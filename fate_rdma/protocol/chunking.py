"""How a payload is cut into chunks, with the optional Link-Enable first chunk (paper §4.3)."""
from __future__ import annotations

import dataclasses
from typing import List

from ..errors import LocalProtocolError


@dataclasses.dataclass(frozen=True)
class Chunk:
    seq: int
    offset: int
    length: int


def plan_chunks(total: int, chunk_bytes: int, first_bytes: int = 0, small_last: bool = False) -> List[Chunk]:
    """Cut `total` bytes into chunks of `chunk_bytes`.

    first_bytes: Link-Enable; the first chunk *posted* is this small (one MTU), so the link is
    brought up by a cheap message. FedRDMA posts in ascending order (small chunk at offset 0);
    FedRDMA-E posts back to front, so there `small_last=True` puts the small chunk at the end.
    A zero-byte payload is one empty chunk (its header still carries the metadata).
    """
    if chunk_bytes < 1:
        raise LocalProtocolError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    if total < 0:
        raise LocalProtocolError(f"negative payload size {total}")
    if total == 0:
        return [Chunk(0, 0, 0)]
    lengths: List[int] = []
    body = total
    small = first_bytes if 0 < first_bytes < total and first_bytes < chunk_bytes else 0
    body -= small
    full, rest = divmod(body, chunk_bytes)
    lengths = [chunk_bytes] * full + ([rest] if rest else [])
    lengths = (lengths + [small]) if small and small_last else ([small] + lengths if small else lengths)
    out, off = [], 0
    for i, n in enumerate(lengths):
        out.append(Chunk(i, off, n))
        off += n
    return out
