"""fate-rdma through a real FATE-Flow 2.2.0 server (standalone engines, sqlite, its own home under the
test's temp dir, free ports), switched on from the job conf alone (`dag.conf.extra.fate_rdma`):
the example job (tiny GPT-2 full FedAvg, FATE-LLM's Seq2SeqRunner in homo_nn) with and without the
section, and the documented failures. One server for the module, stopped by PID with nothing left."""
from __future__ import annotations

import copy
import os
import re
import socket
import subprocess
import sys
import threading

import pytest

pytest.importorskip("fate_flow", reason="FATE-Flow is not installed; make test installs it")
pytest.importorskip("fate_llm", reason="FATE-LLM is not installed; make test installs it")

import yaml  # noqa: E402

from fate_rdma_lab.bench.local import free_ports  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flow_server import FlowServer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTIES = (("guest", "9999"), ("host", "10000"), ("arbiter", "10001"))  # (a party id per site, as the examples)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def listening(port):
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    base = tmp_path_factory.mktemp("fate_flow")
    ports = free_ports(3)
    site = base / "site.yaml"
    cmd = [sys.executable, "-m", "fate_rdma.cli", "flow", "setup", "--site", str(site), "--provider", "soft"]
    for (role, pid), port in zip(PARTIES, ports):
        cmd += ["--endpoint", f"{role}:{pid}=127.0.0.1:{port}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "site file: wrote" in out.stdout
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)  # idempotent
    assert again.returncode == 0 and "site file: unchanged" in again.stdout and "hook: already installed" in again.stdout
    data = base / "data"
    data.mkdir()
    subprocess.run([sys.executable, "-m", "fate_rdma_lab.llm.corpus", "--out", str(data / "train.json"), "--n", "8",
                    "--seed", "1"], check=True, capture_output=True, timeout=60)
    server = FlowServer(str(base / "home"), env={"FATE_RDMA_SITE": str(site)})
    server.start()
    try:
        server.bind_path("experiment", "train_data", str(data))
        server.site, server.ports = site, ports
        yield server
    finally:
        pids = [server.proc.pid] + server.descendants()
        assert server.stop() == []
    import psutil

    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not listening(server.http_port) and not any(listening(p) for p in ports)


def example_job(section=None, fallback=None):
    """examples/gpt2_full_fedavg/fate_flow_job.yaml as written, with the tiny model and one epoch;
    `section`: replaces dag.conf.extra.fate_rdma (False: no section at all)."""
    with open(os.path.join(ROOT, "examples", "gpt2_full_fedavg", "fate_flow_job.yaml")) as f:
        dag = yaml.safe_load(f)
    sec = dag["dag"]["conf"]["extra"]["fate_rdma"]
    sec["slot_bytes"] = 8 << 20  # the tiny model's payloads are ~3 MB; no 256 MiB slots on a CI machine
    if section is False:
        del dag["dag"]["conf"]["extra"]
    elif section is not None:
        dag["dag"]["conf"]["extra"]["fate_rdma"] = section
    if fallback:
        dag["dag"]["conf"]["extra"]["fate_rdma"]["fallback"] = fallback
    rc = dag["dag"]["tasks"]["nn_0"]["parameters"]["runner_conf"]
    rc["model_conf"]["kwargs"]["model"] = "tiny"
    rc["training_args_conf"]["num_train_epochs"] = 1
    return dag


def run_jobs(server, dags, timeout_s=600):
    """Submit all, wait for all (concurrently: the module's time is mostly fate-flow's process starts)."""
    ids = [server.submit(d) for d in dags]
    status = {}
    threads = [threading.Thread(target=lambda j=j: status.__setitem__(j, server.wait(j, timeout_s))) for j in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [(j, status.get(j)) for j in ids]


def role_logs(server, job_id, role, party_id):
    root = os.path.join(server.job_log_dir(job_id), role, party_id, "nn_0")
    text = {}
    for d, _, files in os.walk(root):
        for fn in files:
            with open(os.path.join(d, fn), errors="replace") as f:
                text[os.path.relpath(os.path.join(d, fn), root)] = f.read()
    return text


def weights(server, job_id, role, party_id):
    import torch

    path = os.path.join(server.home, "jobs", job_id, role, party_id, "nn_0", "0", "output", "output_model",
                        "model_directory", "pytorch_model.bin")
    return torch.load(path, map_location="cpu")


def test_job_conf_section_switches_fate_rdma_on_and_weights_equal_plain_job(flow):
    (plain, s_plain), (rdma, s_rdma) = run_jobs(flow, [example_job(False), example_job()])
    assert s_plain == "success", flow.task_logs(plain)
    assert s_rdma == "success", flow.task_logs(rdma)
    for role, pid in PARTIES:
        logs = role_logs(flow, rdma, role, pid)
        task_log = logs["root/INFO"]
        on = [line for line in task_log.splitlines() if "fate-rdma: ON for" in line]
        assert len(on) == 1, task_log[-3000:]  # once per task log
        assert f"({role}:{pid})" in on[0] and "engine standalone" in on[0]
        assert "soft (emulated verbs, not RDMA) [EMULATED verbs, not RDMA]" in on[0] and "mode fedrdma-e" in on[0]
        counters = re.findall(r"fate-rdma: counters for .*rdma_transfers=(\d+) rdma_bytes=(\d+) fate_fallbacks=(\d+)",
                              task_log)
        assert len(counters) == 1, task_log[-3000:]
        transfers, nbytes, fallbacks = map(int, counters[0])
        # clients: the (secure-aggregation masked) float64 weights up once; arbiter: the average to each client
        assert transfers == (2 if role == "arbiter" else 1) and fallbacks == 0, counters
        assert nbytes > 1 << 20
        # FATE's own federation path logged nothing of fate-rdma in the plain job
        assert not any("fate-rdma:" in t for t in role_logs(flow, plain, role, pid).values())
    import torch

    from fate_rdma_lab.llm.zoo import gpt2_model

    init = gpt2_model(model="tiny", seed=0).state_dict()
    ref = weights(flow, plain, "guest", "9999")
    assert any(not torch.equal(ref[k], init[k]) for k in ref)  # the job trained: equality below means something
    for role, pid in PARTIES[:2]:
        for job in (plain, rdma):
            w = weights(flow, job, role, pid)
            assert w.keys() == ref.keys()
            assert all(torch.equal(w[k], ref[k]) for k in ref), f"{role} weights differ ({job})"


def test_malformed_section_and_missing_site_file_fail_with_the_documented_message(flow):
    good = example_job()["dag"]["conf"]["extra"]["fate_rdma"]
    bad = dict(good, mode="warp")
    hidden = str(flow.site) + ".hidden"
    os.rename(flow.site, hidden)  # the site file is read by each task: no restart needed
    try:
        (j_bad, s_bad), (j_nosite, s_nosite), (j_fb, s_fb) = run_jobs(
            flow, [example_job(bad), example_job(copy.deepcopy(good)), example_job(copy.deepcopy(good), fallback="fate")],
            timeout_s=400)
    finally:
        os.rename(hidden, flow.site)
    # every party's task fails the same way, but fate-flow stops a job's other tasks once one has
    # failed: under load a party can be stopped while still importing, before it logs anything, so
    # the message is looked for in every party's log (on a quiet machine each has it)
    all_bad = "\n".join(t for role, pid in PARTIES for t in role_logs(flow, j_bad, role, pid).values())
    assert s_bad == "failed"
    assert "asked for fate-rdma (dag.conf.extra.fate_rdma) and cannot have it" in all_bad
    assert "dag.conf.extra.fate_rdma is malformed" in all_bad and "warp" in all_bad and "Fix:" in all_bad
    all_nosite = "\n".join(t for role, pid in PARTIES for t in role_logs(flow, j_nosite, role, pid).values())
    assert s_nosite == "failed"
    assert f"the fate-rdma site file {flow.site} does not exist" in all_nosite
    assert "Fix: run `fate-rdma flow setup" in all_nosite
    assert s_fb == "success", flow.task_logs(j_fb)
    for role, pid in PARTIES:
        task_log = role_logs(flow, j_fb, role, pid)["root/INFO"]
        off = [line for line in task_log.splitlines() if "fate-rdma" in line]
        assert len(off) == 1 and "WARNING" in off[0] and "(fallback: fate)" in off[0] and "does not exist" in off[0], off
