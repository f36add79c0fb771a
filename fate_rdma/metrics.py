"""Prometheus metrics of this process's endpoints, for the site's exporter (docs/operations.md#metrics).

Off unless a site sets `metrics_dir` (ChannelConfig): then an endpoint calls `enable(dir)` and every call below
writes its samples into files of that folder through prometheus-client's multiprocess mode (one set of
memory-mapped files per process). FATE starts a process per task and party, most of them short-lived, so
no task serves HTTP itself: the site's one long-lived `fate-rdma exporter` sums every process's files on each
scrape, and a finished task's counters stay counted (its live gauges go). Off, each call is one test of a
module global. Nothing here ever fails a transfer or an endpoint: a folder that cannot be used leaves metrics off
with one warning, and a hook that fails (a full disk) logs once and switches them off.

Enabling sets PROMETHEUS_MULTIPROC_DIR in this process (and its children): other prometheus-client metrics that
the process makes afterwards (FATE's, if any) land in the same folder and are served by the exporter too.

What is counted, where (labels: `peer` the other endpoint's name, its `host:port`; `mode` fedrdma or
fedrdma-e; `provider` soft or pyverbs; `path` how the payloads moved (easypyverbs.DataPath): rdma,
tcp-emulated, link-emulated or same-host-emulated):
  sender:   a transfer whose receiver confirmed it (sent_bytes, sent_transfers, sent_chunks,
            transfer_duration_seconds), or that failed (errors_total{side="send", kind});
            in_flight_bytes while it is queued or moving
  receiver: a message delivered to the application (received_bytes, received_transfers), or a transfer it
            refused (errors_total{side="receive", kind})
  both:     authentication_failures_total{side}, connect_duration_seconds (the dialer: TCP, TLS, proof and
            queue-pair set-up), connect_retries_total, registered_bytes (receive memory reserved from the
            endpoints' budgets), connections (live peer connections), build_info{version, provider}

There are no retransmissions at this level: RC queue pairs recover losses in the NIC (its own counters say how
often: `rdma statistic`), the soft provider over TCP in the kernel.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import stat
import threading
from typing import Any, Callable, Dict, Optional, TypeVar

log = logging.getLogger("fate_rdma.metrics")

#: the `kind` label of errors_total: a bounded set (kind_of maps every error onto one of them)
ERROR_KINDS = ("integrity", "too_large", "protocol", "timeout", "unreachable", "cancelled", "authentication",
               "config", "other")
#: transfer_duration_seconds' buckets: a small message on loopback to a 2 GB model between sites
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
RESUME_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
CONNECT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PREFIX = "fate_rdma_"

_lock = threading.Lock()
_dir: Optional[str] = None
_m: Optional["_Metrics"] = None  # the metrics while on
_made: Optional["_Metrics"] = None  # (made once per process)
_T = TypeVar("_T")


class _Metrics:
    """The metric objects, made once the multiprocess folder is set (registered nowhere: the exporter reads the
    files, so a failed first attempt leaves nothing behind that a second would collide with)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        r: Any = {"registry": None}
        tl = ("peer", "mode", "provider", "path")
        self.sent_bytes = Counter(PREFIX + "sent_bytes", "Payload bytes of transfers the receiver confirmed", tl, **r)
        self.received_bytes = Counter(PREFIX + "received_bytes", "Payload bytes delivered to the application", tl,
                                      **r)
        self.sent_transfers = Counter(PREFIX + "sent_transfers", "Transfers the receiver confirmed", tl, **r)
        self.received_transfers = Counter(PREFIX + "received_transfers", "Transfers delivered to the application",
                                          tl, **r)
        self.sent_chunks = Counter(PREFIX + "sent_chunks", "Chunks of the confirmed transfers", ("peer", "mode"), **r)
        self.duration = Histogram(PREFIX + "transfer_duration_seconds",
                                  "Seconds from a transfer's start (its receive slot granted) to the receiver's "
                                  "verdict", ("peer", "mode"), buckets=DURATION_BUCKETS, **r)
        self.errors = Counter(PREFIX + "errors", "Transfers that failed, by side and kind", ("side", "kind"), **r)
        self.auth_failures = Counter(PREFIX + "authentication_failures",
                                     "Connections refused or failed in TLS or the proof, by this side's role",
                                     ("side",), **r)
        self.connect = Histogram(PREFIX + "connect_duration_seconds",
                                 "Seconds to dial a peer: TCP, TLS, proof and queue-pair set-up",
                                 buckets=CONNECT_BUCKETS, **r)
        self.connect_retries = Counter(PREFIX + "connect_retries", "Dials tried again (the peer busy or not up yet)",
                                       **r)
        self.resumes = Counter(PREFIX + "resumes", "Transfers resumed on a new connection after theirs broke",
                               ("peer",), **r)
        self.resent_bytes = Counter(PREFIX + "resent_bytes", "Payload bytes sent again on resuming: they had left "
                                    "before the connection broke, but the receiver did not hold them", ("peer",), **r)
        self.resume_seconds = Histogram(PREFIX + "resume_duration_seconds", "Seconds from a connection breaking "
                                        "under a transfer to its resumption on a new one", buckets=RESUME_BUCKETS, **r)
        self.in_flight = Gauge(PREFIX + "in_flight_bytes", "Payload bytes of transfers queued or moving now",
                               multiprocess_mode="livesum", **r)
        self.registered = Gauge(PREFIX + "registered_bytes",
                                "Receive memory reserved from the endpoints' budgets now (pools, staging, reassembly)",
                                multiprocess_mode="livesum", **r)
        self.connections = Gauge(PREFIX + "connections", "Live connections to peers", multiprocess_mode="livesum", **r)
        self.build = Gauge(PREFIX + "build_info", "fate-rdma's version and the verbs provider of the running "
                           "processes that opened an endpoint (1)", ("version", "provider"),
                           multiprocess_mode="livemax", **r)


def folder_problem(directory: str) -> Optional[str]:
    """Why `directory` must not take metrics files (a symlink, or others may write into it: they could plant
    links that the files' writers follow), or None."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a folder"
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        return "any user may write into it"
    if st.st_uid not in (os.getuid(), 0):
        return f"it belongs to another user (uid {st.st_uid})"
    return None


def enable(directory: str) -> bool:
    """Write this process's metrics into `directory` (made if missing) from now on; False (and one warning) where
    that cannot be. Once per process: a second folder is refused with a warning (prometheus-client's multiprocess
    mode has one folder per process)."""
    global _dir, _m, _made
    directory = os.path.abspath(directory)
    with _lock:
        if _dir is not None:
            if directory != _dir:
                log.warning("fate-rdma metrics: this process already writes to %s; not also to %s", _dir, directory)
            _m = _made
            return _m is not None
        try:
            problem = folder_problem(directory)
            if problem is not None:
                raise ValueError(f"metrics_dir {directory}: {problem}")
            os.makedirs(directory, mode=0o755, exist_ok=True)
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
            from prometheus_client import multiprocess, values

            # a dead process of this pid may have left live gauges, which this one would start from
            multiprocess.mark_process_dead(os.getpid(), directory)
            values.ValueClass = values.get_value_class()  # (chosen at import: maybe before the folder was set)
            made = _Metrics()
            made.connections.inc(0)  # (opens the files now: a folder that cannot take them fails here)
        except Exception as exc:
            log.warning("fate-rdma metrics: off, %s", exc)
            return False
        _m = _made = made
        _dir = directory
    log.info("fate-rdma metrics: writing to %s for the site's exporter (fate-rdma exporter)", directory)
    return True


def enabled() -> bool:
    return _m is not None


def disable() -> None:
    """Count nothing more until the next `enable` (which resumes in the same folder): for a bench that measures
    the same transfer with metrics off and on in one process."""
    global _m
    _m = None


def _guarded(fn: Callable[..., _T]) -> Callable[..., Optional[_T]]:
    """A hook that never raises into the data path: a failure logs once and switches metrics off."""

    @functools.wraps(fn)
    def hook(*args: Any, **kw: Any) -> Optional[_T]:
        global _m
        try:
            return fn(*args, **kw)
        except Exception:
            if _m is not None:
                _m = None
                log.warning("fate-rdma metrics: off after a failure in %s", fn.__name__, exc_info=True)
            return None

    return hook


def kind_of(exc: BaseException) -> str:
    """The errors_total kind of `exc` (one of ERROR_KINDS)."""
    from . import errors as E

    pairs = ((E.IntegrityError, "integrity"), (E.PayloadTooLarge, "too_large"), (E.TransferCancelled, "cancelled"),
             (E.TransferTimeout, "timeout"), (E.AuthenticationError, "authentication"),
             (E.PeerUnreachable, "unreachable"), (E.ConfigError, "config"), (E.RemoteProtocolError, "protocol"),
             (E.LocalProtocolError, "protocol"))
    for cls, kind in pairs:
        if isinstance(exc, cls):
            return kind
    return "other"


@_guarded
def started(provider: str) -> None:
    """An endpoint opened with `provider`."""
    m = _m
    if m is not None:
        from . import __version__

        m.build.labels(__version__, provider).set(1)


#: a transfer of at least this many bytes gets a line in the log (logger fate_rdma.transfers, INFO)
LOG_BYTES = 1 << 20
_tlog = logging.getLogger("fate_rdma.transfers")


@_guarded
def sending(fut: Any, peer: str, provider: str, path: str, integrity: str, log_format: str = "text") -> None:
    """A transfer `fut` (TransferFuture) to `peer` over a connection of `provider` whose data path is `path`
    (easypyverbs.DataPath's value) under checksum `integrity` was queued: when its verdict arrives it is
    counted (where metrics are on) and, from LOG_BYTES, logged in one line (`log_format` json: a JSON object)."""
    m = _m
    total = int(fut.total_bytes)
    if m is None and total < LOG_BYTES:
        return
    if m is not None:
        m.in_flight.inc(total)

    @_guarded
    def done(f: Any) -> None:
        exc = f.exception() if not f.cancelled() else None
        failed = f.cancelled() or exc is not None
        r = {} if failed else f.result()
        mode = str(r.get("mode", ""))
        if m is not None:
            m.in_flight.dec(total)
            if failed:
                m.errors.labels("send", "cancelled" if exc is None else kind_of(exc)).inc()
            else:
                m.sent_bytes.labels(peer, mode, provider, path).inc(total)
                m.sent_transfers.labels(peer, mode, provider, path).inc()
                m.sent_chunks.labels(peer, mode).inc(int(r.get("chunks") or 0))
                m.duration.labels(peer, mode).observe(float(r.get("seconds") or 0.0))
        if total >= LOG_BYTES:
            _log_transfer(peer, total, r, provider, path, integrity, None if not failed else (exc or "cancelled"),
                          log_format)

    fut.add_done_callback(done)


@_guarded
def send_failed(exc: BaseException) -> None:
    """A send failed before its transfer was queued (the dial, the proof, a refused payload)."""
    m = _m
    if m is not None:
        m.errors.labels("send", kind_of(exc)).inc()


def _log_transfer(peer: str, total: int, r: Dict[str, Any], provider: str, path: str, integrity: str,
                  error: Any, log_format: str) -> None:
    secs = float(r.get("seconds") or 0.0)
    rec = {"event": "transfer", "direction": "send", "peer": peer, "bytes": total, "seconds": round(secs, 6),
           "gbit_s": round(total * 8 / secs / 1e9, 3) if secs > 0 else None, "mode": r.get("mode", ""),
           "provider": provider, "path": path, "integrity": integrity, "chunks": r.get("chunks"),
           "transfer_id": r.get("transfer_id"), "ok": error is None}
    if error is not None:
        rec["error"] = str(error)[:300]
        rec["kind"] = kind_of(error) if isinstance(error, BaseException) else "cancelled"
    level = logging.INFO if error is None else logging.WARNING
    if log_format == "json":
        _tlog.log(level, "%s", json.dumps(rec, separators=(",", ":")))
    elif error is None:
        _tlog.log(level, "sent %d bytes to %s in %.3f s (%s Gbit/s), %s, %s, %s, %s", total, peer, secs,
                  rec["gbit_s"], rec["mode"], provider, path, integrity)
    else:
        _tlog.log(level, "sending %d bytes to %s failed (%s): %s", total, peer, rec["kind"], rec["error"])


@_guarded
def received(peer: str, nbytes: int, mode: str, provider: str, path: str) -> None:
    """A message of `nbytes` from `peer` was delivered (`provider`, `path` as `sending`'s)."""
    m = _m
    if m is not None:
        labels = (peer, mode, provider, path)
        m.received_bytes.labels(*labels).inc(nbytes)
        m.received_transfers.labels(*labels).inc()


@_guarded
def refused(kind: str) -> None:
    """This side, the receiver, refused a transfer (`kind`: an ErrorCode's name, lower case)."""
    m = _m
    if m is not None:
        m.errors.labels("receive", kind if kind in ERROR_KINDS else "other").inc()


@_guarded
def auth_failed(side: str) -> None:
    """A connection failed in TLS or the proof; `side`: "dialer" or "acceptor" (this side's role)."""
    m = _m
    if m is not None:
        m.auth_failures.labels(side).inc()


@_guarded
def dialed(seconds: float) -> None:
    """A dial took `seconds` (connect_duration_seconds)."""
    m = _m
    if m is not None:
        m.connect.observe(seconds)


@_guarded
def opened() -> Any:
    """A connection to a peer is up (dialed or accepted): its token, for `closed` when it ends (so that a
    connection counted before metrics went off, or not counted, is taken off the same count)."""
    m = _m
    if m is not None:
        m.connections.inc()
    return m


@_guarded
def closed(token: Any) -> None:
    if token is not None:
        token.connections.dec()


@_guarded
def resumed(peer: str, seconds: float, resent_bytes: int) -> None:
    """A transfer to `peer` was resumed `seconds` after its connection broke, sending `resent_bytes` again."""
    m = _m
    if m is not None:
        m.resumes.labels(peer).inc()
        m.resent_bytes.labels(peer).inc(resent_bytes)
        m.resume_seconds.observe(seconds)


@_guarded
def connect_retried() -> None:
    m = _m
    if m is not None:
        m.connect_retries.inc()


@_guarded
def memory(delta: int) -> bool:
    """`delta` bytes of receive memory were reserved (positive) or given back (negative); True if counted (the
    caller gives back only what was counted)."""
    m = _m
    if m is not None and delta:
        m.registered.inc(delta)
        return True
    return False
