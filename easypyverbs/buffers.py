"""Turn user buffers (bytearray, mmap, numpy array, CPU torch tensor, memoryview) into flat byte views.

No copies: the view aliases the caller's memory, which is what makes zero-copy registration possible.
"""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from .errors import UsageError


#: types that are never torch tensors (checked first: the module test costs more than the rest of a view)
_PLAIN = frozenset({np.ndarray, memoryview, bytes, bytearray})


def as_byte_view(obj: Any, writable: bool = False) -> memoryview:
    """A flat, C-contiguous `memoryview` of unsigned bytes over `obj`'s memory."""
    kind = type(obj)
    if kind not in _PLAIN and kind.__module__.split(".")[0] == "torch":
        if getattr(obj, "device", None) is not None and obj.device.type != "cpu":
            raise UsageError(f"only CPU tensors can be registered here, got a tensor on {obj.device}")
        if not obj.is_contiguous():
            raise UsageError("tensor is not contiguous; call .contiguous() first")
        obj = obj.detach().numpy()  # shares memory with the tensor
    try:
        mv = memoryview(obj)
    except TypeError as exc:
        raise UsageError(f"{type(obj).__name__} does not expose a buffer; pass bytearray, mmap, numpy array, CPU "
                         f"tensor or memoryview") from exc
    if not mv.c_contiguous:
        raise UsageError("buffer is not C-contiguous")
    if writable and mv.readonly:
        raise UsageError("buffer is read-only but write access was requested")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def address_of(mv: memoryview) -> int:
    """Virtual address of the first byte of `mv` (0 for an empty view)."""
    if mv.nbytes == 0:
        return 0
    if not mv.readonly:  # (ctypes takes only writable buffers; about 7 x quicker than through numpy)
        return ctypes.addressof(ctypes.c_char.from_buffer(mv))
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data)


def shared_array(nbytes: int) -> np.ndarray:
    """A zeroed byte array in shared memory (a sealed memfd): registered and sent by the soft provider's
    same-host path, a peer's NIC on this machine copies it through a read-only mapping, at memcpy's speed,
    instead of with process_vm_readv. Any provider takes it like any other buffer."""
    from .providers.soft import shm

    return shm.shared_array(nbytes)
