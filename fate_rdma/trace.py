"""Transfer timelines across processes: what happened to each transfer, and when, in every party.

Set FATE_RDMA_TRACE to a folder and every process of a job writes `trace-<pid>.jsonl` there: one JSON line
per event, `{"t": CLOCK_MONOTONIC seconds, "ev": name, "who": party, ...}`. CLOCK_MONOTONIC is one clock for
every process of a host, so the files of a single-host job line up without any clock sync (across hosts
they do not: compare within a party there). `fate-rdma bench timeline FOLDER` reads them back
(the lab's fate_rdma_lab/bench/timeline.py). Unset (the default), an event costs one test of a module global.

The events, by where they happen (`tid`: the channel's transfer id, which both ends see; unique per sending
process, so a timeline joins a sender's events and a receiver's on (party, tid)):
  wrapper, sender:   put (FATE's put began: name, tag, bytes), put_sent (the channel took it: tid, dst, name, tag)
  channel, sender:   c_send (the caller's send began: tid, bytes, peer; written once the channel queued it, with
                     the time the call began), c_start (the connection's active transfer: a slot granted; mode,
                     provider, emulated, path),
                     c_first (its first chunk posted: the first byte on the wire), c_done (the receiver's verdict
                     arrived)
  channel, receiver: c_arrived (every byte placed: FedRDMA-E's header landed, FedRDMA's last chunk), c_verified
                     (the checksum held; traced before the verdict leaves), c_deliver (into the endpoint's inbox)
  wrapper, receiver: stored (the get's store has it: tid, name, tag, src), get (FATE's get began: name, tag, src
                     list), got (FATE's get returns the object, unframed: name, tag, src)
  any process with an endpoint: hold (start, end: a gap of 50 ms or more in which none of its threads ran,
                     easypyverbs.stalls: native code keeping the GIL, as FATE's secure aggregation does, or the
                     process not scheduled; the soft provider's NIC is a thread of the process, so its bytes wait
                     too, where a real NIC's would not; shorter holds pass unseen: a lower bound)
"""
from __future__ import annotations

import json
import logging
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


def start(folder: str) -> Optional[str]:
    """Trace this process into `folder` from now on (as FATE_RDMA_TRACE does from its start); returns the folder
    traced into before (None: none), for `stop` to go back to."""
    global _dir, _file
    with _lock:
        before = _dir
        if _file is not None:
            _file.close()
        _dir, _file = folder, None
        return before


def stop(back_to: Optional[str] = None) -> None:
    """No more events into the current folder (its file is closed: complete for a reader); then trace into
    `back_to` again if given (what `start` returned), else not at all."""
    global _dir, _file
    with _lock:
        if _file is not None:
            _file.close()
        _dir, _file = back_to, None


def set_party(who: str) -> None:
    """Name this process in its events (the FATE party it runs, e.g. "guest:9999")."""
    global _who
    _who = who


def event(ev: str, at: Optional[float] = None, **fields: Any) -> None:
    """Record `ev` now, or as of `at` (a time.monotonic() reading taken earlier; nothing unless tracing is on).
    Never raises: the channel's threads call it. A trace that cannot be written (a full disk, a folder not
    writable) is switched off, once, with a warning; an event whose fields cannot be written is left out."""
    global _dir, _file, _pid
    if _dir is None:
        return
    t = time.monotonic() if at is None else at
    try:
        line = json.dumps({"t": t, "ev": ev, "who": _who, **fields}, separators=(",", ":"), default=str)
        with _lock:
            pid = os.getpid()
            if _file is None or _pid != pid:  # (a forked child writes its own file)
                os.makedirs(_dir, exist_ok=True)
                _file, _pid = open(os.path.join(_dir, f"trace-{pid}.jsonl"), "a", buffering=1), pid
            _file.write(line + "\n")
    except OSError as exc:
        logging.getLogger("fate_rdma").warning("fate-rdma: tracing to %s switched off: %s", _dir, exc)
        _dir = None
    except Exception:  # (a field json cannot take, say): this event only
        pass


_watching_pid = 0


_watch_lock = threading.Lock()


def watch_holds() -> None:
    """Trace this process's holds (easypyverbs.stalls gaps) from now on, once per process; nothing unless on."""
    global _watching_pid
    if _dir is None:
        return
    from easypyverbs import stalls

    with _watch_lock:
        if _watching_pid == os.getpid():
            return
        _watching_pid = os.getpid()
        stalls.watch_gaps(lambda start, end: event("hold", start=start, end=end))


def _after_fork() -> None:
    """A child forked while another thread held a lock gets its own (and its own file)."""
    global _lock, _file, _watch_lock
    _lock, _file, _watch_lock = threading.Lock(), None, threading.Lock()


os.register_at_fork(after_in_child=_after_fork)
