"""Transfer timelines across processes: what happened to each transfer, and when, in every party.

Set FATE_RDMA_TRACE to a folder and every process of a job writes `trace-<pid>.jsonl` there: one JSON line
per event, `{"t": CLOCK_MONOTONIC seconds, "ev": name, "who": party, ...}`. CLOCK_MONOTONIC is one clock for
every process of a host, so the files of a single-host job line up without any clock sync (across hosts
they do not: compare within a party there). `fate-rdma bench timeline FOLDER` reads them back
(fate_rdma/bench/timeline.py). Unset (the default), an event costs one test of a module global.

The events, by where they happen (`tid`: the channel's transfer id, which both ends see):
  wrapper, sender:   put (FATE's put began: name, tag, bytes), put_sent (the channel took it: tid, dst),
                     put_done (its verdict came back, or it failed: tid)
  channel, sender:   c_start (the transfer became the active one: a slot granted), c_first (its first chunk
                     posted: the first byte on the wire), c_header (its header posted: the last), c_done
                     (the receiver's verdict arrived)
  channel, receiver: c_arrived (FedRDMA-E: the header landed, every chunk before it placed), c_verified (the
                     checksum held, the verdict sent), c_deliver (handed to the endpoint's inbox)
  wrapper, receiver: stored (the get's store has it: tid, name, tag, src), get (FATE's get began: name, tag,
                     src), got (FATE's get returns the object, unframed: name, tag, src)
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Optional

ENV = "FATE_RDMA_TRACE"

_dir: Optional[str] = os.environ.get(ENV) or None
_who = ""
_lock = threading.Lock()
_file: Any = None
_pid = 0


def enabled() -> bool:
    return _dir is not None


def set_party(who: str) -> None:
    """Name this process in its events (the FATE party it runs, e.g. "guest:9999")."""
    global _who
    _who = who


def party(p: Any) -> str:
    """A FATE party ((role, id) or an object with role and party_id) as "role:id"."""
    if isinstance(p, (tuple, list)) and len(p) == 2:
        return f"{p[0]}:{p[1]}"
    role, pid = getattr(p, "role", None), getattr(p, "party_id", None)
    return f"{role}:{pid}" if role is not None else str(p)


def event(ev: str, **fields: Any) -> None:
    """Record `ev` now (nothing unless FATE_RDMA_TRACE is set)."""
    if _dir is None:
        return
    t = time.monotonic()
    global _file, _pid
    line = json.dumps({"t": t, "ev": ev, "who": _who, **fields}, separators=(",", ":"), default=str)
    with _lock:
        pid = os.getpid()
        if _file is None or _pid != pid:  # (a forked child writes its own file)
            os.makedirs(_dir, exist_ok=True)
            _file, _pid = open(os.path.join(_dir, f"trace-{pid}.jsonl"), "a", buffering=1), pid
        _file.write(line + "\n")
