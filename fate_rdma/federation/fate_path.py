"""FATE's own federation path, for an object fate-rdma falls back on (fallback: fate, a peer it cannot
reach): the bytes FATE's serializer makes of it, pushed as FATE pushes them."""
from __future__ import annotations

import io
from typing import Any, Callable, List, Sequence


def serialize(fed: Any, value: Any, name: str, tag: str, parties: Sequence[Sequence[str]]) -> bytes:
    """What FATE's own serializer makes of `value` (a frame that must take FATE's path after all)."""
    from fate.arch.federation.api._serdes import TableRemotePersistentPickler, _FederationBytesCoder

    with io.BytesIO() as f:
        TableRemotePersistentPickler(fed, name, tag, parties, f).dump(value)
        return _FederationBytesCoder.encode_base(f.getvalue())


def push(fed: Any, computing: Any, orig_push: Callable[..., Any], max_bytes: int, tables: List[Any], v: bytes,
         name: str, tag: str, parties: Sequence[Sequence[str]]) -> None:
    """`v` through FATE's own push (`orig_push`), sliced exactly as FATE slices pickles above its max message
    size (`max_bytes`); the slice tables are appended to `tables`, to be kept until the job ends."""
    # FATE's standalone store takes an object of any size in one piece; its slice-table path raced
    # with the peer loading the table ("table not exist"), so standalone gets the pickle whole
    standalone = type(fed).__name__ == "StandaloneFederation"
    if v[:1] != b"\x00" or len(v) - 1 <= max_bytes or standalone:
        return orig_push(v=v, name=name, tag=tag, parties=parties)
    from fate.arch.federation.api._serdes import _FederationBytesCoder, _SplitTableUtil
    from fate.arch.federation.api._table_meta import TableMeta

    body, size = memoryview(v)[1:], max_bytes
    n = (len(body) - 1) // size + 1
    parts = fed.get_default_partition_num()
    table = computing.parallelize([(i, bytes(body[i * size:(i + 1) * size])) for i in range(n)], partition=parts,
                                  key_serdes_type=0, value_serdes_type=0, partitioner_type=0)
    meta = TableMeta(num_partitions=parts, key_serdes_type=0, value_serdes_type=0, partitioner_type=0)
    fed.push_table(table, _SplitTableUtil.get_split_table_key(name), tag=tag, parties=parties)
    # keep the slice table until the job ends: dropping it at once (standalone destroys a table when
    # it is collected) raced with the peer loading the pushed copy ("table not exist")
    tables.append(table)
    orig_push(v=_FederationBytesCoder.encode_split(meta, len(body), n, size), name=name, tag=tag, parties=parties)
