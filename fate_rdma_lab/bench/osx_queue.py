"""A small OSX-compatible message queue (FATE's `org.ppc.ptp.PrivateTransferTransport`), for tests and
`fate-rdma eval fate`: not a real OSX / rollsite deployment. Topics are queues keyed by
(x-ptp-session-id, topic); pop waits up to its timeout and answers code E0000000601 when nothing came,
as OSX does. The servicer counts what was pushed and popped, so a study can say how many bytes went
through the queue.

As a process (`python -m fate_rdma_lab.bench.osx_queue --host H [--port P]`): prints {"ready": true,
"address": "H:P"} once it listens; then each line "stats" on stdin is answered with one JSON line of
counters; it stops when stdin closes or --deadline-s passes, waking any pop still waiting.
"""
from __future__ import annotations

import argparse
import collections
import json
import select
import sys
import threading
import time
from typing import Any, Dict, List, Optional

#: FATE's OSX client sets 2 GiB - 1 on its channel; the queue takes what the client may send
MAX_MESSAGE_BYTES = (2 << 30) - 1
#: long polls (FATE's pop waits up to federation.osx.timeout) each hold a server thread: 3 parties x a
#: few topics at once fit well within this
SERVER_THREADS = 32


def make_servicer(pb2: Any, pb2_grpc: Any) -> Any:
    """The queue as a servicer of the given generated modules (FATE's osx_pb2 / osx_pb2_grpc)."""
    import grpc

    class Transport(pb2_grpc.PrivateTransferTransportServicer):
        def __init__(self) -> None:
            self.queues: Dict[Any, collections.deque] = collections.defaultdict(collections.deque)
            self.cv = threading.Condition()
            self.closed = False
            self.stats = {"pushed_messages": 0, "pushed_bytes": 0, "popped_messages": 0, "popped_bytes": 0}

        def close(self) -> None:
            """Wake every waiting pop (it answers the timeout code): the server's threads can end."""
            with self.cv:
                self.closed = True
                self.cv.notify_all()

        def counters(self) -> Dict[str, int]:
            with self.cv:
                return dict(self.stats, queued_messages=sum(len(q) for q in self.queues.values()))

        @staticmethod
        def _key(request: Any, context: Any) -> Any:
            md = dict(context.invocation_metadata())
            return md.get("x-ptp-session-id", ""), request.topic

        def push(self, request: Any, context: Any) -> Any:
            with self.cv:
                self.queues[self._key(request, context)].append(request.payload)
                self.stats["pushed_messages"] += 1
                self.stats["pushed_bytes"] += len(request.payload)
                self.cv.notify_all()
            return pb2.TransportOutbound(code="0", message="ok")

        def pop(self, request: Any, context: Any) -> Any:
            key = self._key(request, context)
            with self.cv:
                came = self.cv.wait_for(lambda: self.queues[key] or self.closed, timeout=max(request.timeout, 1) / 1000)
                if not came or not self.queues[key]:
                    return pb2.TransportOutbound(code="E0000000601", message="pop timeout")
                payload = self.queues[key].popleft()
                self.stats["popped_messages"] += 1
                self.stats["popped_bytes"] += len(payload)
                return pb2.TransportOutbound(code="0", payload=payload)

        def peek(self, request: Any, context: Any) -> Any:
            key = self._key(request, context)
            with self.cv:
                q = self.queues[key]
                return pb2.TransportOutbound(code="0", payload=q[0] if q else b"")

        def release(self, request: Any, context: Any) -> Any:
            if not dict(context.invocation_metadata()).get("x-ptp-session-id"):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "x-ptp-session-id missing")
            return pb2.TransportOutbound(code="0")

    return Transport()


def serve(host: str, port: int = 0) -> Any:
    """Start a gRPC server with the queue on host:port (0: any free port), using FATE's generated
    modules; returns (server, servicer, bound port). The caller stops both: servicer.close(), server.stop()."""
    from concurrent import futures

    import grpc
    from fate.arch.federation.backends.osx import osx_pb2, osx_pb2_grpc

    opts = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    server = grpc.server(futures.ThreadPoolExecutor(SERVER_THREADS), options=opts)
    servicer = make_servicer(osx_pb2, osx_pb2_grpc)
    osx_pb2_grpc.add_PrivateTransferTransportServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise OSError(f"cannot listen on {host}:{port}")
    server.start()
    return server, servicer, bound


def _emit(obj: Dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fate_rdma_lab.bench.osx_queue", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--deadline-s", type=float, default=3600.0, help="stop after this long whatever happens")
    a = p.parse_args(argv)
    try:
        server, servicer, port = serve(a.host, a.port)
    except (OSError, RuntimeError, ImportError) as exc:
        _emit({"error": f"osx queue: {type(exc).__name__}: {exc}"})
        return 1
    _emit({"ready": True, "address": f"{a.host}:{port}"})
    end = time.monotonic() + a.deadline_s
    try:
        while True:
            left = end - time.monotonic()
            if left <= 0:
                break
            r, _, _ = select.select([sys.stdin], [], [], min(left, 1.0))
            if not r:
                continue
            line = sys.stdin.readline()
            if not line:
                break
            if line.strip() == "stats":
                _emit(servicer.counters())
    finally:
        servicer.close()
        server.stop(1).wait(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
