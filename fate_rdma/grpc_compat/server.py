"""A `grpc.Server` look-alike over the fate-rdma channel: generated servicers run on it unchanged."""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent import futures
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, cast

import grpc

from ..channel import Endpoint
from ..config import ChannelConfig
from ..errors import RemoteProtocolError
from .router import Metadata, decode_md, drop_router, encode_md, router_for

log = logging.getLogger("fate_rdma.grpc")


class _Abort(Exception):
    """Raised by context.abort() to unwind the servicer."""


class _HandlerCallDetails(grpc.HandlerCallDetails):
    def __init__(self, method: str, invocation_metadata: Metadata) -> None:
        self.method = method
        self.invocation_metadata = invocation_metadata


class _Context(grpc.ServicerContext):
    def __init__(self, server: "RdmaServer", peer: str, call_id: str, reply_to: str, md: Metadata,
                 timeout_s: Optional[float]) -> None:
        self._server, self._peer, self.id, self._reply_to = server, peer, call_id, reply_to
        self._md = md
        self._deadline = None if timeout_s is None else time.monotonic() + float(timeout_s)
        self._cancelled = threading.Event()
        self._done = False
        self._callbacks: List[Callable[[], None]] = []
        self._code: Optional[grpc.StatusCode] = None
        self._details = ""
        self._trailing: Metadata = ()
        self._initial_sent = False
        self.requests: "queue.Queue[Tuple[str, bytes]]" = queue.Queue()

    # outgoing
    def send(self, kind: str, payload: bytes = b"", **extra: Any) -> None:
        md = {"rpc": self.id, "d": "s2c", "t": kind, **extra}
        try:
            endpoint = cast(Endpoint, self._server.endpoint)  # (calls come only once the server has its endpoint)
            endpoint.send(self._reply_to, payload, md)
        except Exception as exc:
            log.warning("call %s: cannot answer %s: %s", self.id[:8], self._reply_to, exc)
            self.on_cancel()

    def on_cancel(self) -> None:
        if not self._cancelled.is_set():
            self._cancelled.set()
            self.requests.put(("cancel", b""))
            for cb in list(self._callbacks):
                cb()

    # grpc.ServicerContext
    def invocation_metadata(self) -> Metadata:
        return self._md

    def peer(self) -> str:
        return f"fate-rdma:{self._peer}"

    def peer_identities(self) -> None:
        return None

    def peer_identity_key(self) -> None:
        return None

    def auth_context(self) -> Dict[str, Any]:
        return {}

    def is_active(self) -> bool:
        return not self._cancelled.is_set() and not self._done and (self.time_remaining() or 1) > 0

    def time_remaining(self) -> Optional[float]:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def cancel(self) -> None:
        self.on_cancel()

    def add_callback(self, callback: Callable[[], None]) -> bool:
        if self._done:
            return False
        self._callbacks.append(callback)
        return True

    def send_initial_metadata(self, initial_metadata: Metadata) -> None:
        if not self._initial_sent:
            self._initial_sent = True
            self.send("md", md=encode_md(initial_metadata))

    def set_trailing_metadata(self, trailing_metadata: Metadata) -> None:
        self._trailing = tuple(trailing_metadata)

    def trailing_metadata(self) -> Metadata:
        return self._trailing

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        if code == grpc.StatusCode.OK:
            code = grpc.StatusCode.UNKNOWN  # as grpc does: abort with OK is an error
        self._code, self._details = code, details
        raise _Abort(details)

    def abort_with_status(self, status: Any) -> None:
        self._trailing = tuple(status.trailing_metadata or ())
        self.abort(status.code, status.details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self) -> Optional[grpc.StatusCode]:
        return self._code

    def details(self) -> str:
        return self._details

    def set_compression(self, compression: Any) -> None:
        pass

    def disable_next_message_compression(self) -> None:
        pass

    def finish(self) -> None:
        self._done = True


class RdmaServer(grpc.Server):
    """`grpc.Server` over fate-rdma. `add_insecure_port("host:port")` opens the endpoint there."""

    def __init__(self, thread_pool: Optional[futures.ThreadPoolExecutor] = None,
                 config: ChannelConfig = ChannelConfig(),
                 endpoint: Optional[Endpoint] = None, max_workers: int = 10) -> None:
        self._pool = thread_pool or futures.ThreadPoolExecutor(max_workers=max_workers,
                                                               thread_name_prefix="fate-rdma-rpc")
        self._config = config
        self.endpoint = endpoint
        self._owns_endpoint = endpoint is None
        self._handlers: List[Any] = []
        self._calls: Dict[str, _Context] = {}
        self._lock = threading.Lock()
        self._started = False
        self._stopped = threading.Event()

    # -- grpc.Server ----------------------------------------------------------------------------
    def add_generic_rpc_handlers(self, generic_rpc_handlers: Sequence[Any]) -> None:
        self._handlers.extend(generic_rpc_handlers)

    def add_registered_method_handlers(self, service_name: str, method_handlers: Dict[str, Any]) -> None:
        pass  # the generic handlers registered alongside already route these methods

    def add_insecure_port(self, address: str) -> int:
        if self.endpoint is not None:
            raise RuntimeError("this server already has its endpoint")
        host, _, port = address.rpartition(":")
        self.endpoint = Endpoint(self._config, host or "127.0.0.1", int(port))
        return int(self.endpoint.address.rpartition(":")[2])

    def add_secure_port(self, address: str, server_credentials: Any) -> int:
        raise RuntimeError("fate-rdma carries its own transport; TLS ports are not supported by the RDMA facade")

    def start(self) -> None:
        if self.endpoint is None:
            raise RuntimeError("call add_insecure_port() (or pass an endpoint) before start()")
        router_for(self.endpoint).server_sink = self._on_message
        self._started = True

    def stop(self, grace: Optional[float]) -> threading.Event:
        ev = threading.Event()

        def run() -> None:
            with self._lock:
                calls = list(self._calls.values())
            if grace:
                deadline = time.monotonic() + grace
                while time.monotonic() < deadline and any(not c._done for c in calls):
                    time.sleep(0.02)
            for c in calls:
                if not c._done:
                    c.on_cancel()
            self._pool.shutdown(wait=False)
            if self.endpoint is not None:
                drop_router(self.endpoint)
                if self._owns_endpoint:
                    self.endpoint.close()
            self._stopped.set()
            ev.set()

        threading.Thread(target=run, daemon=True).start()
        return ev

    def wait_for_termination(self, timeout: Optional[float] = None) -> bool:
        return self._stopped.wait(timeout)

    # -- dispatch -------------------------------------------------------------------------------
    def _on_message(self, peer: str, md: Dict[str, Any], data: bytes) -> None:
        cid, kind = md.get("rpc", ""), md.get("t")
        if not isinstance(cid, str):
            raise RemoteProtocolError(f"gRPC message from {peer}: field 'rpc' is a {type(cid).__name__}, not a string")
        ctx: Optional[_Context]
        if kind == "start":
            method, timeout_s, reply_to = md.get("method", ""), md.get("timeout_s"), md.get("reply_to") or peer
            for field, value, ok in (("method", method, isinstance(method, str)),
                                     ("reply_to", reply_to, isinstance(reply_to, str)),
                                     ("timeout_s", timeout_s, timeout_s is None or (
                                         type(timeout_s) in (int, float) and 0 <= timeout_s < 1e9))):
                if not ok:
                    raise RemoteProtocolError(f"gRPC call start from {peer}: field {field!r} = {str(value)[:100]!r}")
            ctx = _Context(self, peer, cid, reply_to, decode_md(md.get("md")), timeout_s)
            with self._lock:
                self._calls[cid] = ctx
            self._pool.submit(self._serve, ctx, method, bool(md.get("unary")), data)
            return
        with self._lock:
            ctx = self._calls.get(cid)
        if ctx is None:
            return
        if kind == "cancel":
            ctx.on_cancel()
        elif kind in ("msg", "end"):
            ctx.requests.put((kind, data))

    def _lookup(self, method: str, md: Metadata) -> Any:
        details = _HandlerCallDetails(method, md)
        for h in self._handlers:
            handler = h.service(details)
            if handler is not None:
                return handler
        return None

    def _request_iter(self, ctx: _Context, deser: Optional[Callable[..., Any]]) -> Iterator[Any]:
        while True:
            left = ctx.time_remaining()
            try:
                kind, data = ctx.requests.get(timeout=left if left is not None else None)
            except queue.Empty:
                ctx.on_cancel()
                raise grpc.RpcError("deadline exceeded while reading requests")
            if kind == "end":
                return
            if kind == "cancel":
                raise grpc.RpcError("call cancelled by the client")
            yield deser(data) if deser else data

    def _serve(self, ctx: _Context, method: str, unary: bool, first: bytes) -> None:
        try:
            handler = self._lookup(method, ctx.invocation_metadata())
            if handler is None:
                self._status(ctx, grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
                return
            deser = handler.request_deserializer
            ser = handler.response_serializer or (lambda b: b)
            if handler.request_streaming:
                req: Any = self._request_iter(ctx, deser)
            else:
                req = deser(first) if deser else first
            fn = {(False, False): handler.unary_unary, (False, True): handler.unary_stream,
                  (True, False): handler.stream_unary, (True, True): handler.stream_stream}[
                (handler.request_streaming, handler.response_streaming)]
            if handler.response_streaming:
                for resp in fn(req, ctx):
                    if not ctx.is_active():
                        break
                    ctx.send("msg", ser(resp))
                result = None
            else:
                result = fn(req, ctx)
            if ctx._cancelled.is_set():
                return
            if ctx.time_remaining() == 0.0:
                self._status(ctx, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
                return
            code = ctx.code() or grpc.StatusCode.OK
            if not handler.response_streaming and code == grpc.StatusCode.OK:
                if result is None:
                    self._status(ctx, grpc.StatusCode.INTERNAL, "the servicer returned no response")
                    return
                ctx.send("msg", ser(result))
            self._status(ctx, code, ctx.details())
        except _Abort:
            self._status(ctx, ctx.code() or grpc.StatusCode.UNKNOWN, ctx.details())
        except Exception as exc:
            if ctx._cancelled.is_set():
                return
            log.warning("servicer for %s raised: %r", method, exc)
            self._status(ctx, ctx.code() or grpc.StatusCode.UNKNOWN,
                         ctx.details() or f"Exception calling application: {exc}")
        finally:
            ctx.finish()
            with self._lock:
                self._calls.pop(ctx.id, None)

    def _status(self, ctx: _Context, code: grpc.StatusCode, details: str) -> None:
        ctx.send("status", code=code.name, details=details or "", trailing=encode_md(ctx.trailing_metadata()))


def server(thread_pool: Optional[futures.ThreadPoolExecutor] = None, handlers: Any = None, interceptors: Any = None,
           options: Any = None, maximum_concurrent_rpcs: Optional[int] = None, compression: Any = None,
           config: ChannelConfig = ChannelConfig()) -> RdmaServer:
    """Like `grpc.server(thread_pool)`, serving over fate-rdma."""
    s = RdmaServer(thread_pool, config)
    if handlers:
        s.add_generic_rpc_handlers(handlers)
    return s
