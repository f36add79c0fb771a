"""A small OSX-compatible message queue (FATE's org.ppc.ptp.PrivateTransferTransport), for tests:
topics are queues keyed by (x-ptp-session-id, topic); pop waits up to its timeout and answers code
E0000000601 when nothing came, as OSX does."""
import collections
import threading

import grpc


def make_servicer(pb2, pb2_grpc):
    class Transport(pb2_grpc.PrivateTransferTransportServicer):
        def __init__(self):
            self.queues = collections.defaultdict(collections.deque)
            self.cv = threading.Condition()
            self.closed = False

        def close(self):
            """Wake every waiting pop (it answers the timeout code): the server's threads can end."""
            with self.cv:
                self.closed = True
                self.cv.notify_all()

        @staticmethod
        def _key(request, context):
            md = dict(context.invocation_metadata())
            return md.get("x-ptp-session-id", ""), request.topic

        def push(self, request, context):
            with self.cv:
                self.queues[self._key(request, context)].append(request.payload)
                self.cv.notify_all()
            return pb2.TransportOutbound(code="0", message="ok")

        def pop(self, request, context):
            key = self._key(request, context)
            with self.cv:
                if not self.cv.wait_for(lambda: self.queues[key] or self.closed, timeout=max(request.timeout, 1) / 1000) \
                        or not self.queues[key]:
                    return pb2.TransportOutbound(code="E0000000601", message="pop timeout")
                return pb2.TransportOutbound(code="0", payload=self.queues[key].popleft())

        def peek(self, request, context):
            key = self._key(request, context)
            with self.cv:
                q = self.queues[key]
                return pb2.TransportOutbound(code="0", payload=q[0] if q else b"")

        def release(self, request, context):
            if not dict(context.invocation_metadata()).get("x-ptp-session-id"):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "x-ptp-session-id missing")
            return pb2.TransportOutbound(code="0")

    return Transport()
