"""Three data centres as FATE runs them: each site its own FATE-Flow 2.2 and FATE's own OSX (built from
../shared/third_party), set up only by `fate-rdma site init` from one federation description (certificates from
one CA, keyed integrity: the defaults), each site in its own network namespace of the WAN testbed (198.18.x.2
behind a router; on loopback where this host cannot make namespaces, and the output says so). The tiny GPT-2
full fine-tune and LoRA jobs are each submitted at the guest's FATE-Flow only, once without the fate_rdma section
and once with it: both run at all three sites (FATE-Flow's scheduling through the OSXs), give the same weights,
and with the section every party's task log says fate-rdma carried the weights and the OSXs' queues (their flow
logs) carried none of the job's objects, where without it they carried the weights."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("fate_flow", reason="FATE-Flow is not installed; make test installs it")
pytest.importorskip("fate_llm", reason="FATE-LLM is not installed; make test installs it")

import yaml  # noqa: E402

from fate_rdma.cli.tls import sign_request  # noqa: E402
from fate_rdma_lab.bench.local import free_ports  # noqa: E402
from fate_rdma_lab.testbed import bed as wan  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flow_server import FlowServer  # noqa: E402
from osx_real import OSX, built_osx  # noqa: E402
from test_fate_flow import PARTIES, example_job, role_logs, run_jobs  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class SiteFlow(FlowServer):
    """A site's FATE-Flow: its party id and ports, and the keys `site init` gave it (OSX as federation engine and
    scheduling proxy)."""

    def __init__(self, home, party_id, keys, env, netns=None, mq=None):
        super().__init__(home, party_id=party_id, env=env, netns=netns)
        self.keys = keys
        self.mq = mq  # a RabbitNode or PulsarNode: that FATE engine carries the job's federation (OSX schedules)
        self.http_port, self.grpc_port = keys["fateflow"]["http_port"], keys["fateflow"]["grpc_port"]

    def prepare(self) -> None:
        super().prepare()
        path = os.path.join(self.home, "conf", "service_conf.yaml")
        with open(path) as f:
            conf = yaml.safe_load(f)
        conf["party_id"] = self.keys["party_id"]
        conf["fateflow"].update(self.keys["fateflow"])
        conf["default_engines"].update(self.keys["default_engines"])
        # FATE 2.2's OSX engine slices a pickle above max_message_size from forked workers, which fails there
        # (tests/test_fate_flow_osx.py): FATE's own path needs its pickles whole
        conf["federation"]["osx"] = dict(self.keys["federation"]["osx"], max_message_size=256 << 20)
        if self.mq is not None:  # (client mode: every party on the one broker; the route table names it)
            conf["default_engines"]["federation"] = self.mq.engine
            conf["federation"][self.mq.engine] = self.mq.service_conf()
            with open(os.path.join(self.home, "conf", f"{self.mq.engine}_route_table.yaml"), "w") as f:
                yaml.safe_dump(self.mq.route_table([pid for _, pid in PARTIES]), f)
        with open(path, "w") as f:
            yaml.safe_dump(conf, f)


@pytest.fixture(scope="module")
def testbed(tmp_path_factory):
    """The WAN testbed's three site namespaces (unshaped), or None where this host cannot make namespaces: the
    sites then share this host's loopback, and the test says so."""
    problem = wan.namespace_problem()
    if problem:
        print(f"three sites on loopback, not in namespaces: {problem}")
        yield None
        return
    with wan.open_sites(len(PARTIES), f"frts{os.getpid() % 100000}", str(tmp_path_factory.mktemp("wanstate"))) as tb:
        yield tb


@pytest.fixture(scope="module")
def sites(tmp_path_factory, testbed):
    with three_sites(tmp_path_factory.mktemp("three_sites"), testbed) as got:
        yield got


@contextlib.contextmanager
def three_sites(base, testbed, mq=None):
    """The three sites' OSXs and FATE-Flows, set up by `site init` (in the testbed's namespaces, else on loopback);
    `mq` (a RabbitNode or PulsarNode): that FATE engine on that broker carries the jobs' federation."""
    built = built_osx()
    ports = free_ports(4 * len(PARTIES))
    parties = {}
    netns = [testbed.site_ns(i) if testbed else None for i in range(len(PARTIES))]
    for i, (role, pid) in enumerate(PARTIES):
        e, o, g, h = ports[4 * i: 4 * i + 4]
        parties[f"{role}:{pid}"] = {"host": testbed.site_addr(i) if testbed else "127.0.0.1", "ports": {
            "endpoint": e, "osx": o, "flow_grpc": g, "flow_http": h,
            "soft_data": f"{21000 + 100 * i}-{21000 + 100 * i + 15}"}}
    fed = base / "federation.yaml"
    fed.write_text(yaml.safe_dump({"parties": parties, "security": "tls", "provider": "soft"}))
    data = base / "data"
    data.mkdir()
    subprocess.run([sys.executable, "-m", "fate_rdma_lab.llm.corpus", "--out", str(data / "train.json"), "--n", "8",
                    "--seed", "1"], check=True, capture_output=True, timeout=60)
    osxs, flows = [], []
    try:
        for ns, party in zip(netns, parties):
            out = base / party.replace(":", "_")
            r = subprocess.run([sys.executable, "-m", "fate_rdma.cli", "site", "init", str(fed), "--party", party,
                                "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
            assert r.returncode == 0, r.stderr
            stem = party.replace(":", "_")
            sign_request(str(base / "ca"), str(out / "tls" / f"{stem}.csr"), [party])
            shutil.copy(base / "ca" / "ca.pem", out / "tls" / "ca.pem")
            osxs.append(OSX(built, out / "osx-home", out / "osx", netns=ns))
            keys = yaml.safe_load((out / "fate_flow" / "service_conf.yaml").read_text())
            flows.append(SiteFlow(str(out / "flow-home"), keys["party_id"], keys,
                                  {"FATE_RDMA_SITE": str(out / "site.yaml")}, netns=ns, mq=mq))
        for o in osxs:
            o.wait_up()
        for f in flows:
            f.start(timeout_s=180)
            f.bind_path("experiment", "train_data", str(data))
        yield flows, osxs
    finally:
        for f in flows:
            if f.proc is not None:
                f.stop()
        for o in osxs:
            o.stop()


def lora_job(section=True):
    """examples/gpt2_lora_fedavg/fate_flow_job.yaml with the tiny model and one epoch (its threshold_bytes sends
    the tiny model's 64 KiB adapters over the channel); `section` False: without dag.conf.extra."""
    with open(os.path.join(ROOT, "examples", "gpt2_lora_fedavg", "fate_flow_job.yaml")) as f:
        dag = yaml.safe_load(f)
    if section:
        dag["dag"]["conf"]["extra"]["fate_rdma"]["slot_bytes"] = 8 << 20
    else:
        del dag["dag"]["conf"]["extra"]
    rc = dag["dag"]["tasks"]["nn_0"]["parameters"]["runner_conf"]
    rc["model_conf"]["kwargs"]["model"] = "tiny"
    rc["training_args_conf"]["num_train_epochs"] = 1
    return dag


def _model_file(server, job_id, role, party_id):
    import torch

    d = os.path.join(server.home, "jobs", job_id, role, party_id, "nn_0", "0", "output", "output_model",
                     "model_directory")
    names = [n for n in ("pytorch_model.bin", "adapter_model.bin", "adapter_model.safetensors") if
             os.path.exists(os.path.join(d, n))]
    assert names, os.listdir(d) if os.path.isdir(d) else d
    if names[0].endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(os.path.join(d, names[0]))
    return torch.load(os.path.join(d, names[0]), map_location="cpu")


def osx_pushed_bytes(osxs, job_id):
    """Bytes of the job's messages that the OSXs passed on to another site (their flow.log's MSG_REDIRECT
    lines: FATE's federation through OSX's queues)."""
    total = 0
    for o in osxs:
        path = o.home / "logs" / "broker" / "flow.log"
        for line in path.read_text().splitlines() if path.exists() else []:
            if "|MSG_REDIRECT|" in line and f"|session:{job_id}_" in line:
                m = re.search(r"\|size:(\d+)\|", line)
                total += int(m.group(1)) if m else 0
    return total


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_job_submitted_at_one_site_runs_at_three_with_the_weights_over_fate_rdma(sites, testbed, kind):
    flows, osxs = sites
    guest = flows[0]
    jobs = [example_job(False), example_job()] if kind == "full" else [lora_job(False), lora_job()]
    (plain, s_plain), (rdma, s_rdma) = run_jobs(guest, jobs, timeout_s=1200)
    logs = {f.party_id: f.tail() for f in flows}
    assert s_plain == "success", (guest.task_logs(plain), logs)
    assert s_rdma == "success", (guest.task_logs(rdma), logs)
    for f, (role, pid) in zip(flows, PARTIES):
        task_log = role_logs(f, rdma, role, pid)["root/INFO"]  # (each site's own FATE-Flow ran its party's task)
        on = [line for line in task_log.splitlines() if "fate-rdma: ON for" in line]
        assert len(on) == 1 and "engine osx" in on[0], task_log[-3000:]
        if testbed is not None:  # (its peers at their sites' addresses, each in its own namespace)
            assert "198.18." in on[0], on[0]
        counters = re.findall(r"channel_transfers=(\d+) channel_bytes=(\d+)", task_log)
        assert len(counters) == 1, task_log[-3000:]
        transfers, nbytes = map(int, counters[0])
        assert transfers >= (2 if role == "arbiter" else 1) and nbytes > (1 << 20 if kind == "full" else 32 << 10), \
            counters
        assert not any("fate-rdma:" in t for t in role_logs(f, plain, role, pid).values())
    # FATE's own path: the weights through the OSXs' queues; with the section (certificates: descriptors over the
    # channel too) the queues carried none of the job's objects
    through_osx = {job: osx_pushed_bytes(osxs, job) for job in (plain, rdma)}
    assert through_osx[plain] > (1 << 20 if kind == "full" else 64 << 10) and through_osx[rdma] == 0, through_osx
    ref = _model_file(flows[0], plain, "guest", "9999")
    for f, (role, pid) in list(zip(flows, PARTIES))[:2]:
        for job in (plain, rdma):
            w = _model_file(f, job, role, pid)
            assert w.keys() == ref.keys() and all(w[k].equal(ref[k]) for k in ref), f"{role} weights differ ({job})"
    print(json.dumps({"kind": kind, "plain": plain, "rdma": rdma, "tensors": len(ref), "osx_bytes": through_osx}))
