"""Array frames: FATE objects made of containers, scalars, numpy arrays and CPU torch tensors (model
weights, FedAvg's mixed arrays) sent without FATE's serialization copies.

FATE pickles every array into a safetensors blob, the blobs into a BytesIO, copies that out and
prefixes a mode byte (four copies of the weights before a byte moves), and does three more on the
way in. A frame is instead a small pickle of the object's structure, in which each array is only a
reference (offset, dtype, shape), followed by the arrays' own memory: the channel gathers it straight
from the arrays (zero copy) and the receiver makes arrays that are views of the received buffer.

    frame := MAGIC | u64 header_len | header (pickle) | pad to 64 | array 0 | pad | array 1 | ...

The receiving side unpickles the header with FATE's own restricted unpickler class (its allow-list
of classes applies unchanged). Objects holding anything else FATE serializes specially (tables,
contexts) or arrays of object/structured dtypes are not framed: they take FATE's path untouched.
"""
from __future__ import annotations

import io
import math
import pickle
import pickletools
import re
import struct
from typing import Any, Dict, List, Optional, Tuple

import crc32c
import numpy as np

from ..errors import IntegrityError

MAGIC = b"FRDMAfr1"
ALIGN = 64
_HDR = struct.Struct("<8sQ")
_PID = "fate-rdma/array"
_KINDS = set("biufc")  # bool, signed, unsigned, float, complex
_MAX_DIMS = 32  # (numpy 1.x allows 32 dimensions, 2.x 64)
#: built-in types pickled as they are (never arrays, tensors or FATE objects)
_PLAIN = frozenset({str, int, float, bool, type(None), tuple, list, dict, bytes})


class NotFramable(Exception):
    """The object holds something a frame cannot carry; FATE's own path is used."""


def _pad(n: int) -> int:
    return (-n) % ALIGN


class _FramePickler(pickle.Pickler):
    def __init__(self, f: io.BytesIO) -> None:
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.arrays: List[np.ndarray] = []
        self.array_bytes = 0

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) in _PLAIN:  # (called for every object pickled, the arrays' references too)
            return None
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind not in _KINDS or obj.dtype.fields is not None:
                raise NotFramable(f"numpy dtype {obj.dtype}")
            return self._add(obj, "np")
        kind = type(obj).__module__.split(".")[0]
        if kind == "torch":
            import torch

            if isinstance(obj, torch.Tensor):
                if obj.layout != torch.strided or obj.is_quantized or type(obj) is not torch.Tensor:
                    raise NotFramable(f"torch tensor ({obj.layout}, {type(obj).__name__})")
                t = obj.detach().cpu().contiguous()
                name = str(t.dtype).replace("torch.", "")
                arr = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
                return self._add(arr, "torch:" + name)
            return None
        if kind == "fate":  # tables, contexts: FATE's own persistent ids
            raise NotFramable(type(obj).__name__)
        return None

    def _add(self, arr: np.ndarray, kind: str) -> Tuple[Any, ...]:
        arr = np.ascontiguousarray(arr)
        self.arrays.append(arr)
        self.array_bytes += arr.nbytes
        return (_PID, len(self.arrays) - 1, arr.dtype.str, arr.shape, kind)


class OutFrame:
    """A framed object ready to send: `buffers` (gathered by the channel), `nbytes` in all. `value`
    is kept so FATE's own path can still carry it (fallback)."""

    def __init__(self, value: Any, buffers: List[Any], nbytes: int, array_bytes: int) -> None:
        self.value, self.buffers, self.nbytes, self.array_bytes = value, buffers, nbytes, array_bytes

    def __len__(self) -> int:
        return self.nbytes


def encode(value: Any, min_array_bytes: int) -> Optional[OutFrame]:
    """Frame `value`, or None when it is not worth it (arrays below `min_array_bytes`) or not possible."""
    f = io.BytesIO()
    p = _FramePickler(f)
    try:
        p.dump(value)
    except NotFramable:
        return None
    if not p.arrays or p.array_bytes < min_array_bytes:
        return None
    header = f.getvalue()
    # the pickle refers to arrays by index; their offsets follow from the layout below
    offsets, pos = [], _HDR.size + len(header)
    pos += _pad(pos)
    for a in p.arrays:
        offsets.append(pos)
        pos += a.nbytes + _pad(a.nbytes)
    head = _HDR.pack(MAGIC, len(header)) + header
    index = np.asarray(offsets, dtype="<u8").tobytes()
    # the offsets table rides at the end so the header pickle need not be rewritten
    buffers: List[Any] = [head + bytes(_pad(len(head)))]
    for a in p.arrays:
        if a.nbytes:
            buffers.append(a)
        if _pad(a.nbytes):
            buffers.append(bytes(_pad(a.nbytes)))
    buffers.append(index + struct.pack("<Q", len(p.arrays)))
    total = pos + len(index) + 8
    return OutFrame(value, buffers, total, p.array_bytes)


def is_frame(view: Any) -> bool:
    return len(view) >= _HDR.size and bytes(view[:len(MAGIC)]) == MAGIC


def checked(data: Any, length: int, crc: Optional[int], frame: bool, what: str) -> Any:
    """`data` as FATE's get returns it, once its length, checksum (if any) and kind match what was announced
    (`what`: the object and its sender, for the errors)."""
    if len(data) != length:
        raise IntegrityError(f"fate-rdma: {what}: {len(data)} bytes arrived, descriptor says {length}")
    if crc is not None and crc32c.crc32c(data) != crc:
        raise IntegrityError(f"fate-rdma: {what}: checksum does not match its descriptor")
    if frame:
        if not is_frame(data):
            raise IntegrityError(f"fate-rdma: {what}: descriptor announces an array frame, payload is not one")
        return InFrame(data)
    return data


class InFrame:
    """A received frame (a view of the channel's buffer), decoded by FATE's unpickler class."""

    def __init__(self, view: memoryview) -> None:
        self.view = view

    def __len__(self) -> int:
        return self.view.nbytes


#: what unpickling a peer's structure pickle raises on bytes that are not one, or that name what they may not:
#: the pickle machine's own errors (UnicodeDecodeError is a ValueError), FATE's allow-list refusing a class
#: (ValueError), an allowed class or reducer given arguments it does not take (TypeError, ValueError,
#: AttributeError, IndexError, KeyError, OverflowError), and MemoryError (lengths and memo indexes are bounded by
#: `_scan` first; an allowed reducer could still ask for much)
_UNPICKLE_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError, IndexError,
                    KeyError, OverflowError, RecursionError, MemoryError)


def decode(frame: InFrame, unpickler_cls: Any, *unpickler_args: Any) -> Any:
    """The object of `frame`; `unpickler_cls(*unpickler_args, f)` is FATE's restricted unpickler. A frame that is
    not one of ours, or whose structure pickle does not load, is an IntegrityError naming why."""
    view = frame.view
    try:
        magic, hlen = _HDR.unpack_from(view, 0)
        (count,) = struct.unpack_from("<Q", view, view.nbytes - 8)
        if magic != MAGIC or _HDR.size + hlen > view.nbytes or 8 * count + 8 > view.nbytes:
            raise ValueError("bad frame header")
        # a list: indexing a numpy array for every array's offset cost more than the array itself
        offsets = np.frombuffer(view, dtype="<u8", count=count, offset=view.nbytes - 8 - 8 * count).tolist()
    except (struct.error, ValueError) as exc:
        raise IntegrityError(f"fate-rdma: malformed array frame ({view.nbytes} bytes): {exc}") from exc
    limit = view.nbytes - 8 - 8 * count

    _scan(view[_HDR.size:_HDR.size + hlen])
    u = _unpickler(unpickler_cls)(*unpickler_args, io.BytesIO(view[_HDR.size:_HDR.size + hlen]))
    u.frame = (view, offsets, limit)
    try:
        return u.load()
    except _UNPICKLE_ERRORS as exc:
        raise IntegrityError(f"fate-rdma: array frame's structure ({hlen} bytes of pickle) does not load: "
                             f"{type(exc).__name__}: {str(exc)[:300]}") from exc
    finally:
        u.frame = None


#: opcodes that store into the unpickler's memo at the index they name
_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def _scan(header: memoryview) -> None:
    """Walks the structure pickle's opcodes before the unpickler runs them: pickle's C unpickler allocates what
    an opcode claims before it checks the claim, so 5 flipped bytes could make it take gigabytes (a memo grown
    and zeroed to a LONG_BINPUT's index, a BINBYTES8/BYTEARRAY8 length allocated before its bytes are read).
    Here a counted argument must lie within the pickle (pickletools checks) and a memo index below its length
    (each memo entry takes an opcode); the walk costs about a microsecond per opcode."""
    n = header.nbytes
    try:
        for op, arg, pos in pickletools.genops(header.tobytes()):
            if op.name in _MEMO_PUTS and not (isinstance(arg, int) and 0 <= arg < n):
                raise ValueError(f"{op.name} at {pos} names memo index {arg} in a pickle of {n} bytes")
    except Exception as exc:  # (ValueError mostly; any error the walk meets means the same: not a valid pickle)
        raise IntegrityError(f"fate-rdma: array frame's structure ({n} bytes of pickle) is not a valid pickle: "
                             f"{type(exc).__name__}: {str(exc)[:200]}") from exc


_UNPICKLERS: Dict[type, type] = {}


def _unpickler(base: Any) -> Any:
    """`base` (FATE's unpickler class) taught to load a frame's arrays; one subclass per base, made once.

    The frame travels on the instance, not in a class made per call: a class is in a reference cycle
    with itself, so a closure over the frame's buffer kept the whole payload alive until the next
    garbage collection, and the next round's payload landed in fresh memory instead of that buffer."""
    cls = _UNPICKLERS.get(base)
    if cls is None:
        class _FrameUnpickler(base):
            frame: Optional[Tuple[memoryview, List[int], int]] = None

            def persistent_load(self, pid: Any) -> Any:
                if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == _PID and self.frame is not None:
                    return _array(*self.frame, *pid[1:])
                return super().persistent_load(pid)

        cls = _UNPICKLERS[base] = _FrameUnpickler
    return cls


def _dtype(name: str) -> np.dtype:
    """The numpy dtype a frame names (`dtype.str`, e.g. '<f8'), if a frame may carry it."""
    dt = _DTYPES.get(name) if type(name) is str else None
    if dt is None:
        # only a dtype's `str` ('<f8', '|b1', '<M8[ns]'): numpy parses other strings itself (comma lists through
        # ast.literal_eval), which a peer's bytes must not reach
        if type(name) is not str or not _DTYPE_STR.match(name):
            raise IntegrityError(f"fate-rdma: array frame names dtype {str(name)[:80]!r}, not a dtype's str")
        try:
            dt = np.dtype(name)
        except Exception as exc:  # (TypeError, ValueError: a kind numpy does not know)
            raise IntegrityError(f"fate-rdma: array frame names dtype {name!r}: {exc}") from exc
        if dt.kind not in _KINDS:
            raise IntegrityError(f"fate-rdma: array frame names dtype {dt}")
        if len(_DTYPES) < 64:  # (a peer naming ever new dtypes does not grow it)
            _DTYPES[name] = dt
    return dt


#: what a dtype's `str` looks like: byte order, kind, size, a datetime's unit
_DTYPE_STR = re.compile(r"^[<>|=][a-zA-Z][0-9]{1,4}(\[[0-9]{0,3}[a-zA-Z]{1,3}\])?$")
#: dtypes seen in frames, by their `str`: np.dtype(name) once, not for every array of every frame
_DTYPES: Dict[str, np.dtype] = {}


def _array(view: memoryview, offsets: List[int], limit: int, idx: int, dtype: str, shape: Tuple[int, ...],
           kind: str) -> Any:
    dt = _dtype(dtype)
    if not isinstance(shape, tuple) or len(shape) > _MAX_DIMS or not all(type(d) is int and 0 <= d < 1 << 63
                                                                          for d in shape):
        raise IntegrityError(f"fate-rdma: array frame names shape {str(shape)[:200]}")
    if type(idx) is not int or not (kind == "np" or (type(kind) is str and kind.startswith("torch:"))):
        raise IntegrityError(f"fate-rdma: array frame names array {idx!r} of kind {kind!r}")
    count = math.prod(shape)
    if not 0 <= idx < len(offsets) or offsets[idx] + count * dt.itemsize > limit:
        raise IntegrityError(f"fate-rdma: array {idx} of a frame lies outside it ({view.nbytes} bytes)")
    arr = np.frombuffer(view, dtype=dt, count=count, offset=offsets[idx]).reshape(shape)
    if kind == "np":
        return arr
    if kind == "torch:bfloat16" and dt != np.int16:  # (sent as int16: numpy has no bfloat16)
        raise IntegrityError(f"fate-rdma: array frame names a bfloat16 tensor of dtype {dt}")
    try:
        import torch
    except ImportError as exc:
        raise IntegrityError("fate-rdma: array frame holds a torch tensor, and torch is not installed here") from exc
    try:
        t = torch.from_numpy(arr)
    except (TypeError, ValueError) as exc:  # (a dtype torch lacks, or a byte order not this host's)
        raise IntegrityError(f"fate-rdma: array frame names a torch tensor of dtype {dt}: {exc}") from exc
    return t.view(torch.bfloat16) if kind == "torch:bfloat16" else t
