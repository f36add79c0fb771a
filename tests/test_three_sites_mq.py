"""FATE's message-queue engines as the three sites' data plane, FATE's own OSX as their scheduling proxy: the sites
of tests/test_three_sites.py (each its own FATE-Flow 2.2 and OSX, set up by `fate-rdma site init`, in the WAN
testbed's namespaces where this host can make them) with `default_engines.federation` set to rabbitmq, then to
pulsar, in FATE's client mode: one real broker at the guest's site serves all three (Debian's RabbitMQ,
tests/rabbitmq_node.py; Apache Pulsar's standalone broker from Maven Central, tests/pulsar_node.py). The tiny
GPT-2 full fine-tune, submitted at the guest only, runs at all three without and with the fate_rdma section; the
weights are equal, every party's task log counts the weights over the channel, and the bytes arriving at the
broker's port (an nftables counter in the guest's namespace) carry the weights only without the section."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

pytest.importorskip("fate_flow", reason="FATE-Flow is not installed; make test installs it")
pytest.importorskip("fate_llm", reason="FATE-LLM is not installed; make test installs it")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pulsar_node import PulsarNode  # noqa: E402
from rabbitmq_node import RabbitNode, unavailable  # noqa: E402
from test_fate_flow import PARTIES, example_job, role_logs  # noqa: E402
from test_three_sites import _model_file, testbed, three_sites  # noqa: E402,F401 (testbed: a fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
NFT_TABLE = "frmq"


@pytest.fixture(scope="module", params=["rabbitmq", "pulsar"])
def broker(request, tmp_path_factory, testbed):  # noqa: F811 (the imported fixture)
    """The engine's broker at the guest's site (its namespace)."""
    engine = request.param
    pytest.importorskip("pika" if engine == "rabbitmq" else "pulsar",
                        reason=f"FATE's {engine} client is not installed; make test installs it (pyproject's fate extra)")
    if engine == "rabbitmq" and unavailable():
        pytest.skip(unavailable())
    host = testbed.site_addr(0) if testbed else "127.0.0.1"
    ns = testbed.site_ns(0) if testbed else None
    node = (RabbitNode if engine == "rabbitmq" else PulsarNode)(str(tmp_path_factory.mktemp(engine)), host=host,
                                                                 netns=ns)
    try:
        node.start()
        yield node
    finally:
        left = node.stop()
        assert not left, f"{engine} processes outlived stop(): {left}"


@pytest.fixture(scope="module")
def sites(tmp_path_factory, testbed, broker):  # noqa: F811
    with three_sites(tmp_path_factory.mktemp(f"three_sites_{broker.engine}"), testbed, mq=broker) as got:
        yield got


def _nft(ns, *argv, stdin=None):
    return subprocess.run(["ip", "netns", "exec", ns, "nft", *argv], input=stdin, capture_output=True, text=True,
                          timeout=20, check=True).stdout


class BrokerBytes:
    """Bytes arriving at the broker's port, counted by nftables in its site's namespace."""

    def __init__(self, ns, port):
        self.ns = ns
        _nft(ns, "-f", "-", stdin=f"table inet {NFT_TABLE} {{\n  chain input {{\n    type filter hook input priority "
                                   f"filter; policy accept;\n    tcp dport {port} counter\n  }}\n}}\n")

    def read(self):
        m = re.search(r"counter packets \d+ bytes (\d+)", _nft(self.ns, "list", "table", "inet", NFT_TABLE))
        assert m, "no counter in the broker's table"
        return int(m.group(1))

    def close(self):
        subprocess.run(["ip", "netns", "exec", self.ns, "nft", "delete", "table", "inet", NFT_TABLE],
                       capture_output=True, timeout=20)


def test_full_fine_tune_on_fates_mq_engine_scheduled_by_osx(sites, broker, testbed):  # noqa: F811
    flows, _ = sites
    guest = flows[0]
    counter = BrokerBytes(testbed.site_ns(0), broker.data_port) if testbed else None
    try:
        runs = {}
        for name, dag in (("plain", example_job(False)), ("rdma", example_job())):  # (one after the other: counted)
            before = counter.read() if counter else 0
            job = guest.submit(dag)
            status = guest.wait(job, timeout_s=480)
            time.sleep(1)
            runs[name] = (job, status, (counter.read() - before) if counter else None)
    finally:
        if counter:
            counter.close()
    (plain, s_plain, mq_plain), (rdma, s_rdma, mq_rdma) = runs["plain"], runs["rdma"]
    logs = {f.party_id: f.tail() for f in flows}
    assert s_plain == "success", (guest.task_logs(plain), logs)
    assert s_rdma == "success", (guest.task_logs(rdma), logs)
    for f, (role, pid) in zip(flows, PARTIES):
        task_log = role_logs(f, rdma, role, pid)["root/INFO"]
        on = [line for line in task_log.splitlines() if "fate-rdma: ON for" in line]
        assert len(on) == 1 and f"engine {broker.engine}" in on[0], task_log[-3000:]
        counters = re.findall(r"channel_transfers=(\d+) channel_bytes=(\d+)", task_log)
        assert len(counters) == 1 and int(counters[0][1]) > 1 << 20, (counters, task_log[-3000:])
        assert not any("fate-rdma:" in t for t in role_logs(f, plain, role, pid).values())
    if counter:  # the weights (about 20 MB a job) reached the broker only without the section
        assert mq_plain > 8 << 20 and mq_rdma < 2 << 20, {"plain": mq_plain, "rdma": mq_rdma}
    ref = _model_file(flows[0], plain, "guest", "9999")
    for f, (role, pid) in list(zip(flows, PARTIES))[:2]:
        for job in (plain, rdma):
            w = _model_file(f, job, role, pid)
            assert w.keys() == ref.keys() and all(w[k].equal(ref[k]) for k in ref), f"{role} weights differ ({job})"
    print(json.dumps({"engine": broker.engine, "plain": plain, "rdma": rdma, "broker_bytes": {"plain": mq_plain,
                                                                                          "rdma": mq_rdma}}))
