"""RPC framing over the channel, and the per-endpoint router that dispatches arriving messages.

Every gRPC message is one channel transfer (large ones are chunked by the channel). Its metadata:
    {"rpc": call id, "d": "c2s"|"s2c", "t": kind, ...}
kinds: c2s "start" (method, md, timeout_s, reply_to; unary requests ride along), "msg", "end"
(half-close), "cancel"; s2c "md" (initial metadata), "msg", "status" (code, details, trailing).
Metadata values that are bytes (keys ending in "-bin") travel base64-encoded.
"""
from __future__ import annotations

import base64
import logging
import queue
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import grpc

from ..channel import Endpoint
from ..errors import (FateRdmaError, IntegrityError, PayloadTooLarge, PeerUnreachable, RemoteProtocolError,
                      TransferCancelled, TransferTimeout)

log = logging.getLogger("fate_rdma.grpc")

Metadata = Sequence[Tuple[str, Any]]


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The one table from fate-rdma failures to gRPC status codes (STYLE.md §2)."""
    for cls, code in ((TransferTimeout, grpc.StatusCode.DEADLINE_EXCEEDED),
                      (PeerUnreachable, grpc.StatusCode.UNAVAILABLE),
                      (PayloadTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
                      (IntegrityError, grpc.StatusCode.DATA_LOSS),
                      (TransferCancelled, grpc.StatusCode.CANCELLED)):
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL if isinstance(exc, FateRdmaError) else grpc.StatusCode.UNKNOWN


def encode_md(md: Optional[Metadata]) -> List[List[Any]]:
    out = []
    for k, v in md or ():
        if isinstance(v, (bytes, bytearray)):
            out.append([k, {"b64": base64.b64encode(bytes(v)).decode()}])
        else:
            out.append([k, v])
    return out


def decode_md(md: Any) -> Tuple[Tuple[str, Any], ...]:
    """gRPC metadata as a peer sent it (encode_md's form); RemoteProtocolError if it is not that."""
    if md is None:
        return ()
    if not isinstance(md, list):
        raise RemoteProtocolError(f"gRPC metadata is a {type(md).__name__}, expected a list of [key, value] pairs")
    out = []
    for pair in md:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
            raise RemoteProtocolError(f"gRPC metadata entry {str(pair)[:100]!r} is not a [key, value] pair")
        k, v = pair
        if isinstance(v, dict):
            try:
                v = base64.b64decode(v["b64"], validate=True)
            except (KeyError, TypeError, ValueError) as exc:  # (binascii.Error is a ValueError)
                raise RemoteProtocolError(f"gRPC metadata {k!r}: binary value is not base64: {exc!r}") from exc
        out.append((k, v))
    return tuple(out)


class Router:
    """Reads an endpoint's inbox; hands client-bound messages to calls and server-bound ones to the server."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._calls: Dict[str, "queue.Queue[Tuple[Dict[str, Any], bytes]]"] = {}
        self._lock = threading.Lock()
        self.server_sink: Optional[Callable[[str, Dict[str, Any], bytes], None]] = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="fate-rdma-grpc-router", daemon=True)
        self._thread.start()

    def register(self, call_id: str) -> "queue.Queue[Tuple[Dict[str, Any], bytes]]":
        q: "queue.Queue[Tuple[Dict[str, Any], bytes]]" = queue.Queue()
        with self._lock:
            self._calls[call_id] = q
        return q

    def unregister(self, call_id: str) -> None:
        with self._lock:
            self._calls.pop(call_id, None)

    def _run(self) -> None:
        while not self._stop:
            try:
                msg = self.endpoint.recv(timeout=0.2)
            except TransferTimeout:
                continue
            except Exception as exc:  # endpoint closed
                log.debug("router stops: %s", exc)
                return
            md, data, peer = msg.metadata, bytes(msg.view), msg.peer
            msg.release()
            if md.get("d") == "s2c":
                with self._lock:
                    q = self._calls.get(md.get("rpc", ""))
                if q is not None:
                    q.put((md, data))
            elif md.get("d") == "c2s" and self.server_sink is not None:
                try:
                    self.server_sink(peer, md, data)
                except RemoteProtocolError as exc:  # (this thread serves every call: one bad message must not end it)
                    log.warning("dropped a malformed message from %s: %s", peer, exc)
            else:
                log.warning("dropped a message from %s that belongs to no call (%s)", peer, md.get("t"))

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=2)


_ROUTERS: Dict[int, Router] = {}
_ROUTERS_LOCK = threading.Lock()


def router_for(endpoint: Endpoint) -> Router:
    with _ROUTERS_LOCK:
        r = _ROUTERS.get(id(endpoint))
        if r is None:
            r = _ROUTERS[id(endpoint)] = Router(endpoint)
        return r


def drop_router(endpoint: Endpoint) -> None:
    with _ROUTERS_LOCK:
        r = _ROUTERS.pop(id(endpoint), None)
    if r is not None:
        r.close()
