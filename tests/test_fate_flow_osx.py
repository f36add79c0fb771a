"""fate-rdma through a real FATE-Flow 2.2.0 server whose federation engine is OSX (`default_engines.
federation: osx`, `federation.osx.mode: queue`), switched on from the job conf alone. No real OSX can
run here (it is a Java service); its stand-in is an OSX-compatible gRPC server in this process:
FATE's `PrivateTransferTransport` message queue (tests/osx_server.py) for the tasks' federation, and
a transparent router for FATE-Flow's coordination calls (`DataTransferService.unaryCall`, which a
non-standalone fate-flow sends through its OSX proxy), forwarded byte for byte to fate-flow's own
gRPC port, as OSX routes them to a party's fate-flow. One fate-flow server for all three parties.

The example job (tiny GPT-2 full FedAvg) with and without the section: the same weights; with it,
the weights crossed fate-rdma's channel and only descriptors went through OSX."""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import threading

import pytest

pytest.importorskip("fate_flow", reason="FATE-Flow is not installed; make test installs it")
pytest.importorskip("fate_llm", reason="FATE-LLM is not installed; make test installs it")
pytest.importorskip("fate.arch.federation.backends.osx.osx_pb2_grpc", reason="FATE's OSX engine is not installed")

import grpc  # noqa: E402
import yaml  # noqa: E402

from fate_rdma_lab.bench.local import free_ports  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flow_server import FlowServer  # noqa: E402
from osx_server import make_servicer  # noqa: E402
from test_fate_flow import PARTIES, example_job, listening, role_logs, run_jobs, weights  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
UNARY = "/com.webank.ai.eggroll.api.networking.proxy.DataTransferService/unaryCall"


class OSXStandIn:
    """FATE's OSX message queue + fate-flow coordination router on one gRPC port; counts what passes."""

    def __init__(self) -> None:
        from concurrent import futures

        from fate.arch.federation.backends.osx import osx_pb2, osx_pb2_grpc

        self.flow_grpc = None  # host:port of fate-flow's gRPC service, set once fate-flow's port is known
        self.pushed = collections.Counter()  # topic name suffix -> bytes pushed through the queue
        self.routed = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(16), options=[("grpc.max_receive_message_length", -1),
                                                                           ("grpc.max_send_message_length", -1)])
        servicer = make_servicer(osx_pb2, osx_pb2_grpc)
        orig_push = servicer.push
        lock = threading.Lock()

        def push(request, context):
            with lock:
                self.pushed[request.topic] += len(request.payload)
            return orig_push(request, context)

        servicer.push = push
        self.servicer = servicer
        osx_pb2_grpc.add_PrivateTransferTransportServicer_to_server(servicer, self.server)
        self.server.add_generic_rpc_handlers([_Router(self)])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def stop(self) -> None:
        self.servicer.close()  # long-polling pops of tasks that ended would hold the server's threads
        self.server.stop(0).wait(10)


class _Router(grpc.GenericRpcHandler):
    def __init__(self, osx: OSXStandIn) -> None:
        self.osx = osx

    def service(self, details):
        if details.method != UNARY:
            return None

        def forward(raw: bytes, context):
            self.osx.routed += 1
            md = [(k, v) for k, v in context.invocation_metadata() if not k.startswith(":")]
            with grpc.insecure_channel(self.osx.flow_grpc) as ch:
                call = ch.unary_unary(UNARY, request_serializer=None, response_deserializer=None)
                return call(raw, metadata=md, timeout=60)

        return grpc.unary_unary_rpc_method_handler(forward, request_deserializer=None, response_serializer=None)


class OSXFlowServer(FlowServer):
    """FlowServer with OSX as fate-flow's federation engine and coordination proxy."""

    def __init__(self, home, osx_port, **kw):
        super().__init__(home, **kw)
        self.osx_port = osx_port

    def prepare(self) -> None:
        super().prepare()
        conf_path = os.path.join(self.home, "conf", "service_conf.yaml")
        with open(conf_path) as f:
            conf = yaml.safe_load(f)
        conf["default_engines"]["federation"] = "osx"
        conf["fateflow"]["proxy_name"] = "osx"
        # max_message_size: FATE 2.2's OSX engine sends a pickle above it as a table of slices pushed from
        # the standalone computing's worker processes, which fails there ("cannot pickle '_thread.RLock'",
        # gRPC "Socket operation on non-socket" after fork): FATE's own path (the reference job) needs
        # its pickles whole. fate-rdma's threshold stays 1 MiB (min of its own and this).
        conf["federation"]["osx"] = {"host": "127.0.0.1", "port": self.osx_port, "mode": "queue",
                                     "max_message_size": 256 << 20}
        with open(conf_path, "w") as f:
            yaml.safe_dump(conf, f)


@pytest.fixture(scope="module")
def flow_osx(tmp_path_factory):
    base = tmp_path_factory.mktemp("fate_flow_osx")
    ports = free_ports(3)
    site = base / "site.yaml"
    cmd = [sys.executable, "-m", "fate_rdma.cli", "flow", "setup", "--site", str(site), "--provider", "soft"]
    for (role, pid), port in zip(PARTIES, ports):
        cmd += ["--endpoint", f"{role}:{pid}=127.0.0.1:{port}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    data = base / "data"
    data.mkdir()
    subprocess.run([sys.executable, "-m", "fate_rdma_lab.llm.corpus", "--out", str(data / "train.json"), "--n", "8",
                    "--seed", "1"], check=True, capture_output=True, timeout=60)
    osx = OSXStandIn()
    server = OSXFlowServer(str(base / "home"), osx.port, env={"FATE_RDMA_SITE": str(site)})
    osx.flow_grpc = f"127.0.0.1:{server.grpc_port}"
    try:
        server.start()
        server.bind_path("experiment", "train_data", str(data))
        server.osx, server.ports = osx, ports
        yield server
    finally:
        pids = [server.proc.pid] + server.descendants() if server.proc else []
        try:
            assert server.stop() == []
        finally:
            osx.stop()
    import psutil

    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not listening(server.http_port) and not listening(osx.port) and not any(listening(p) for p in ports)


def test_osx_engine_job_conf_section_switches_fate_rdma_on_and_weights_equal_plain_job(flow_osx):
    osx = flow_osx.osx
    (plain, s_plain), (rdma, s_rdma) = run_jobs(flow_osx, [example_job(False), example_job()])
    assert s_plain == "success", flow_osx.task_logs(plain)
    assert s_rdma == "success", flow_osx.task_logs(rdma)
    # OSX topics begin with the federation id, fate-flow's `{job_id}_{task}_{version}`
    plain_bytes = sum(n for t, n in osx.pushed.items() if t.startswith(plain + "_"))
    rdma_bytes = sum(n for t, n in osx.pushed.items() if t.startswith(rdma + "_"))
    assert osx.routed > 0  # fate-flow coordinated the parties through the OSX stand-in
    for role, pid in PARTIES:
        task_log = role_logs(flow_osx, rdma, role, pid)["root/INFO"]
        on = [line for line in task_log.splitlines() if "fate-rdma: ON for" in line]
        assert len(on) == 1, task_log[-3000:]
        assert f"({role}:{pid})" in on[0] and "engine osx" in on[0], on[0]
        counters = re.findall(r"fate-rdma: counters for .*rdma_transfers=(\d+) rdma_bytes=(\d+) fate_fallbacks=(\d+)",
                              task_log)
        assert len(counters) == 1, task_log[-3000:]
        transfers, nbytes, fallbacks = map(int, counters[0])
        assert transfers == (2 if role == "arbiter" else 1) and fallbacks == 0 and nbytes > 1 << 20, counters
        assert not any("fate-rdma:" in t for t in role_logs(flow_osx, plain, role, pid).values())
    # the weights (MBs, hex-encoded by FATE's OSX engine) went through OSX only without fate-rdma
    print(f"OSX queue bytes: job without fate-rdma {plain_bytes}, with {rdma_bytes}; {osx.routed} routed fate-flow calls")
    assert plain_bytes > 4 * (1 << 20) and rdma_bytes < plain_bytes / 10, (plain_bytes, rdma_bytes)
    ref = weights(flow_osx, plain, "guest", "9999")
    for role, pid in PARTIES[:2]:
        for job in (plain, rdma):
            w = weights(flow_osx, job, role, pid)
            assert w.keys() == ref.keys()
            assert all(w[k].equal(ref[k]) for k in ref), f"{role} weights differ ({job})"
