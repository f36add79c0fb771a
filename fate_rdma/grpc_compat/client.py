"""A `grpc.Channel` look-alike over the fate-rdma channel: generated stubs run on it unchanged."""
from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import grpc

from ..channel import Endpoint
from ..config import ChannelConfig
from .router import Metadata, decode_md, encode_md, router_for, status_for

log = logging.getLogger("fate_rdma.grpc")
_ident = lambda b: b  # noqa: E731


class RpcError(grpc.RpcError, grpc.Call, grpc.Future):
    """A finished call's error: `code()`, `details()`, `trailing_metadata()`, as grpc's own."""

    def __init__(self, code: grpc.StatusCode, details: str, initial: Metadata = (), trailing: Metadata = ()) -> None:
        super().__init__(f"<RpcError {code.name}: {details}>")
        self._c, self._d, self._i, self._t = code, details, tuple(initial), tuple(trailing)

    def code(self) -> grpc.StatusCode:
        return self._c

    def details(self) -> str:
        return self._d

    def initial_metadata(self) -> Metadata:
        return self._i

    def trailing_metadata(self) -> Metadata:
        return self._t

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> Optional[float]:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return False

    # grpc.Future, for completeness of a finished call
    def cancelled(self) -> bool:
        return self._c == grpc.StatusCode.CANCELLED

    def running(self) -> bool:
        return False

    def done(self) -> bool:
        return True

    def result(self, timeout: Optional[float] = None) -> Any:
        raise self

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        return self

    def traceback(self, timeout: Optional[float] = None) -> Any:
        return None

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        fn(self)

    def __str__(self) -> str:
        return f"<RpcError of RPC that terminated with:\n\tstatus = {self._c}\n\tdetails = \"{self._d}\"\n>"


class _Call(RpcError):
    """The client side of one RPC: a response iterator, a future and a grpc.Call at once."""

    def __init__(self, channel: "RdmaChannel", method: str, ser: Optional[Callable[..., Any]],
                 deser: Optional[Callable[..., Any]], timeout: Optional[float], metadata: Optional[Metadata]) -> None:
        RpcError.__init__(self, grpc.StatusCode.OK, "")
        self._ch, self._method, self._ser, self._deser = channel, method, ser or _ident, deser or _ident
        self.id = uuid.uuid4().hex
        self._q = channel.router.register(self.id)
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._timeout = timeout
        self._md = metadata
        self._finished = threading.Event()
        self._code: Optional[grpc.StatusCode] = None
        self._lock = threading.Lock()
        self._callbacks: List[Callable[[], None]] = []
        self._done_cbs: List[Callable[[Any], None]] = []
        self._initial: Optional[Metadata] = None
        self._result: Any = None
        self._resolve = threading.Lock()  # one thread reads a unary call's events

    # -- sending --------------------------------------------------------------------------------
    def _send(self, kind: str, payload: bytes = b"", **extra: Any) -> None:
        md = {"rpc": self.id, "d": "c2s", "t": kind, **extra}
        try:
            fut = self._ch.endpoint.send(self._ch.target, payload, md)
        except Exception as exc:
            self._finish(status_for(exc), f"failed to send to {self._ch.target}: {exc}")
            return

        def failed(f: Any) -> None:
            exc = f.exception()
            if exc:
                self._finish(status_for(exc), str(exc))

        fut.add_done_callback(failed)

    def _start(self, request: Any = None, unary: bool = False) -> None:
        payload = self._ser(request) if unary else b""
        self._send("start", payload, method=self._method, md=encode_md(self._md), timeout_s=self._timeout,
                   reply_to=self._ch.endpoint.name, unary=unary)

    def _pump_requests(self, it: Iterator[Any]) -> None:
        def run() -> None:
            try:
                for req in it:
                    if self._finished.is_set():
                        return
                    self._send("msg", self._ser(req))
                self._send("end")
            except Exception as exc:
                log.warning("request iterator of %s raised: %s", self._method, exc)
                self._send("cancel")
                self._finish(grpc.StatusCode.UNKNOWN, "Exception iterating requests!")

        threading.Thread(target=run, name=f"grpc-requests-{self.id[:8]}", daemon=True).start()

    # -- receiving ------------------------------------------------------------------------------
    def _event(self) -> Optional[Tuple[Dict[str, Any], bytes]]:
        """Next message for this call, or None once finished (deadline, cancel, status)."""
        while not self._finished.is_set():
            wait = 0.1 if self._deadline is None else min(0.1, self._deadline - time.monotonic())
            if wait <= 0:
                self._send("cancel")
                self._finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
                return None
            try:
                return self._q.get(timeout=wait)
            except queue.Empty:
                continue
        return None

    def _next_response(self) -> Any:
        """The next response message, or StopIteration-worthy None at the end of the stream."""
        while True:
            ev = self._event()
            if ev is None:
                return _END
            md, data = ev
            kind = md.get("t")
            if kind == "md":
                self._initial = decode_md(md.get("md"))
            elif kind == "msg":
                return self._deser(data)
            elif kind == "status":
                name = md.get("code")
                code = getattr(grpc.StatusCode, name, grpc.StatusCode.UNKNOWN) if isinstance(name, str) \
                    else grpc.StatusCode.UNKNOWN
                self._t = decode_md(md.get("trailing"))
                self._finish(code, str(md.get("details", "")))
                return _END

    def _finish(self, code: grpc.StatusCode, details: str) -> bool:
        with self._lock:
            if self._code is not None:
                return False
            self._code, self._c, self._d = code, code, details
            self._finished.set()
            cbs, dcbs = list(self._callbacks), list(self._done_cbs)
        self._ch.router.unregister(self.id)
        for cb in cbs:
            cb()
        for dcb in dcbs:
            dcb(self)
        return True

    # -- iterator (response streaming) ----------------------------------------------------------
    def __iter__(self) -> "_Call":
        return self

    def __next__(self) -> Any:
        r = self._next_response()
        if r is _END:
            if self._c != grpc.StatusCode.OK:
                raise self
            raise StopIteration
        return r

    # -- unary result ---------------------------------------------------------------------------
    def _unary_result(self) -> Any:
        with self._resolve:
            if self._result is None and self._code is None:
                first = self._next_response()
                if first is not _END:
                    self._result = first
                    while self._next_response() is not _END:
                        pass
        if self._c != grpc.StatusCode.OK:
            raise self
        return self._result

    # -- grpc.Call / grpc.Future ----------------------------------------------------------------
    def initial_metadata(self) -> Metadata:
        return self._initial or ()

    def is_active(self) -> bool:
        return not self._finished.is_set()

    def time_remaining(self) -> Optional[float]:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def cancel(self) -> bool:
        if self._finished.is_set():
            return False
        self._send("cancel")
        return self._finish(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if self._code is None:
                self._callbacks.append(callback)
                return True
        return False

    def cancelled(self) -> bool:
        return self._c == grpc.StatusCode.CANCELLED and self._finished.is_set()

    def running(self) -> bool:
        return not self._finished.is_set()

    def done(self) -> bool:
        return self._finished.is_set()

    def result(self, timeout: Optional[float] = None) -> Any:
        return self._unary_result()

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        try:
            self._unary_result()
            return None
        except RpcError as exc:
            return exc

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        with self._lock:
            if self._code is None:
                self._done_cbs.append(fn)
                return
        fn(self)

    def code(self) -> grpc.StatusCode:
        if self._code is None and self._result is None:
            self._unary_result_quiet()
        return self._c

    def details(self) -> str:
        if self._code is None:
            self._unary_result_quiet()
        return self._d

    def trailing_metadata(self) -> Metadata:
        if self._code is None:
            self._unary_result_quiet()
        return self._t

    def _unary_result_quiet(self) -> None:
        try:
            self._unary_result()
        except RpcError:
            pass


_END = object()


class _MultiCallable:
    def __init__(self, channel: "RdmaChannel", method: str, ser: Optional[Callable], deser: Optional[Callable],
                 req_stream: bool, resp_stream: bool) -> None:
        self._ch, self._method, self._ser, self._deser = channel, method, ser, deser
        self._req_stream, self._resp_stream = req_stream, resp_stream

    def _call(self, request: Any, timeout: Optional[float], metadata: Optional[Metadata]) -> _Call:
        call = _Call(self._ch, self._method, self._ser, self._deser, timeout, metadata)
        if self._req_stream:
            call._start()
            call._pump_requests(iter(request))
        else:
            call._start(request, unary=True)
        if not self._resp_stream:  # resolve in the background so future() callbacks fire
            threading.Thread(target=call._unary_result_quiet, name=f"grpc-call-{call.id[:8]}", daemon=True).start()
        return call

    def __call__(self, request: Any, timeout: Optional[float] = None, metadata: Optional[Metadata] = None,
                 credentials: Any = None, wait_for_ready: Optional[bool] = None, compression: Any = None) -> Any:
        call = self._call(request, timeout, metadata)
        return call if self._resp_stream else call._unary_result()

    def with_call(self, request: Any, timeout: Optional[float] = None, metadata: Optional[Metadata] = None,
                  credentials: Any = None, wait_for_ready: Optional[bool] = None,
                  compression: Any = None) -> Tuple[Any, _Call]:
        call = self._call(request, timeout, metadata)
        return call._unary_result(), call

    def future(self, request: Any, timeout: Optional[float] = None, metadata: Optional[Metadata] = None,
               credentials: Any = None, wait_for_ready: Optional[bool] = None, compression: Any = None) -> _Call:
        return self._call(request, timeout, metadata)


class RdmaChannel(grpc.Channel):
    """`grpc.Channel` over fate-rdma: `RdmaChannel(endpoint, "host:port")` or `insecure_channel(target)`."""

    def __init__(self, endpoint: Endpoint, target: str, owns_endpoint: bool = False) -> None:
        self.endpoint = endpoint
        self.target = target
        self.router = router_for(endpoint)
        self._owns = owns_endpoint

    def _mc(self, method: str, ser: Any, deser: Any, rs: bool, ps: bool) -> _MultiCallable:
        return _MultiCallable(self, method, ser, deser, rs, ps)

    def unary_unary(self, method: str, request_serializer: Any = None, response_deserializer: Any = None,
                    _registered_method: bool = False) -> _MultiCallable:
        return self._mc(method, request_serializer, response_deserializer, False, False)

    def unary_stream(self, method: str, request_serializer: Any = None, response_deserializer: Any = None,
                     _registered_method: bool = False) -> _MultiCallable:
        return self._mc(method, request_serializer, response_deserializer, False, True)

    def stream_unary(self, method: str, request_serializer: Any = None, response_deserializer: Any = None,
                     _registered_method: bool = False) -> _MultiCallable:
        return self._mc(method, request_serializer, response_deserializer, True, False)

    def stream_stream(self, method: str, request_serializer: Any = None, response_deserializer: Any = None,
                      _registered_method: bool = False) -> _MultiCallable:
        return self._mc(method, request_serializer, response_deserializer, True, True)

    def subscribe(self, callback: Callable, try_to_connect: bool = False) -> None:
        callback(grpc.ChannelConnectivity.READY)

    def unsubscribe(self, callback: Callable) -> None:
        pass

    def close(self) -> None:
        if self._owns:
            from .router import drop_router

            drop_router(self.endpoint)
            self.endpoint.close()

    def __enter__(self) -> "RdmaChannel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def insecure_channel(target: str, options: Any = None, compression: Any = None,
                     config: ChannelConfig = ChannelConfig(), host: str = "127.0.0.1") -> RdmaChannel:
    """Like `grpc.insecure_channel(target)`, with its own fate-rdma endpoint."""
    return RdmaChannel(Endpoint(config, host), target, owns_endpoint=True)
