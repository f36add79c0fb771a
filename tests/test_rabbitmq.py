"""fate-rdma on FATE's rabbitmq federation engine, against a real RabbitMQ node (Debian's
rabbitmq-server with its management plugin, which FATE's engine drives over HTTP), started for this
module as a child process with its own data dir, ports and node name (tests/rabbitmq_node.py) and
stopped afterwards with nothing left running. The job is examples/fedavg_weights/fedavg.py's
`run(ctx)` (guest + host + arbiter, float64 weights above the threshold, two rounds) in three
processes, each building FATE's rabbitmq federation with FederationBuilder.build_rabbitmq, as FATE's
component runner does; FATE 2.2's multiprocess launcher builds only standalone or OSX contexts.

Skips, with the reason printed (`pytest -rs`, as `make test` runs it), only where RabbitMQ or pika
is not installed; a node that is installed and does not start is an error with its log."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("fate.arch.federation", reason="FATE (pyfate) is not installed; make test installs it")
pytest.importorskip("pika", reason="pika (FATE's rabbitmq client) is not installed; make test installs it (pyproject's fate extra)")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rabbitmq_node import RabbitNode, listening, unavailable  # noqa: E402

from fate_rdma_lab.bench.local import free_ports  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROLES = ("guest", "host", "arbiter")
PARAMS, ROUNDS = 400_000, 2          # 3.2 MB of float64 weights per message: FATE slices it (1 MiB)
JOB_DEADLINE_S = 150
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def rabbit(tmp_path_factory):
    why = unavailable()
    if why:
        pytest.skip(why)
    node = RabbitNode(str(tmp_path_factory.mktemp("rabbitmq")))
    try:
        node.start(deadline_s=90)
    except BaseException:
        node.stop()
        raise
    yield node
    pids = list(node.pids)
    left = node.stop()
    assert left == [], f"RabbitMQ processes still alive after stop: {left}"
    assert pids and not [p for p in (node.amqp_port, node.mng_port, node.dist_port, node.epmd_port) if listening(p)]


def section(endpoints, **kw):
    base = {"enabled": True, "mode": "fedrdma-e", "slot_bytes": 16 << 20, "provider": "soft", "threshold_bytes": 1 << 20,
            "endpoints": endpoints, "chunk_bytes": 1 << 20, "pull_timeout_s": 60, "get_timeout_s": 120,
            "connect_timeout_s": 10}  # parties start together, each importing FATE: room for a slow one
    base.update(kw)
    return base


def run_job(node, out, fed_id, confs=None):
    """The three parties; `confs`: role -> fate_rdma section (None: FATE's own path for everyone)."""
    out.mkdir()
    procs = {}
    for role in ROLES:
        env = dict(os.environ)
        env.pop("FATE_RDMA_CONF", None)
        if confs and confs.get(role) is not None:
            path = out / f"{role}.fate_rdma.json"
            path.write_text(json.dumps({"fate_rdma": confs[role]}))
            env["FATE_RDMA_CONF"] = str(path)
        cmd = [sys.executable, os.path.join(ROOT, "tests", "rabbitmq_party.py"), "--role", role, "--fed-id", fed_id,
               "--data-dir", str(out / "data"), "--rabbitmq", json.dumps(node.options()), "--out", str(out),
               "--params", str(PARAMS), "--rounds", str(ROUNDS), "--wait-s", "120"]
        with open(out / f"{role}.log", "w") as log:
            procs[role] = subprocess.Popen(cmd, env=env, cwd=str(out), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + JOB_DEADLINE_S
    try:
        for role, p in procs.items():
            try:
                p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
    logs = {r: (out / f"{r}.log").read_text()[-2500:] for r in ROLES}
    failed = {r: p.returncode for r, p in procs.items() if p.returncode != 0}
    assert not failed, f"job {fed_id}: parties failed or passed the {JOB_DEADLINE_S} s deadline {failed}:\n" + \
        "\n".join(f"--- {r}\n{logs[r]}" for r in ROLES)
    res = {}
    for r in ROLES:
        res[r] = json.loads((out / f"{r}.json").read_text())
        res[r].update(json.loads((out / f"{r}.engine.json").read_text()))
        mq = out / f"{r}.mq"
        sizes = [int(x) for x in mq.read_text().split()] if mq.exists() else []
        res[r]["mq_messages"], res[r]["mq_bytes"] = len(sizes), sum(sizes)
        res[r]["log"] = logs[r]
    return res


@pytest.fixture(scope="module")
def plain(rabbit, tmp_path_factory):
    """The job on FATE's rabbitmq engine alone: the reference for the tests below."""
    t0 = time.monotonic()
    res = run_job(rabbit, tmp_path_factory.mktemp("plain_job") / "plain", "rmq_plain")
    print(f"rabbitmq node {rabbit.name}: ready in {rabbit.boot_s:.1f} s; job without fate-rdma {time.monotonic() - t0:.1f} s")
    for r in ROLES:
        assert res[r]["federation"] == "RabbitmqFederation" and not res[r]["wrapped"], r
        assert res[r]["rdma"] is None and "fate-rdma" not in res[r]["log"], r
        # FATE's own path put the weights through RabbitMQ (sliced into 1 MiB messages)
        sends = ROUNDS * (2 if r == "arbiter" else 1)
        assert res[r]["mq_bytes"] >= sends * PARAMS * 8, (r, res[r]["mq_bytes"])
    assert res["guest"]["sha256"] == res["host"]["sha256"]  # both clients end on the same average
    return res


def endpoints(n=3):
    ports = free_ports(n)
    eps = {"guest:9999": f"127.0.0.1:{ports[0]}", "host:10000": f"127.0.0.1:{ports[1]}",
           "arbiter:10000": f"127.0.0.1:{ports[2]}"}
    return eps, ports[3:]


def test_fedavg_on_rabbitmq_bitwise_identical_with_and_without_fate_rdma(rabbit, plain, tmp_path):
    eps, _ = endpoints()
    t0 = time.monotonic()
    rdma = run_job(rabbit, tmp_path / "rdma", "rmq_rdma", {r: section(eps) for r in ROLES})
    print(f"job with fate-rdma {time.monotonic() - t0:.1f} s")
    weights_bytes = PARAMS * 8
    for r in ROLES:
        assert rdma[r]["federation"] == "RabbitmqFederation" and rdma[r]["wrapped"], r
        assert plain[r]["sha256"] == rdma[r]["sha256"], r
        st = rdma[r]["rdma"]
        sends = ROUNDS * (2 if r == "arbiter" else 1)
        assert st["rdma_transfers"] == sends and st["fate_fallbacks"] == 0, (r, st)
        assert st["rdma_bytes"] >= sends * weights_bytes, (r, st)
        # through RabbitMQ went only the descriptors (FATE alone: the weights, see `plain`)
        assert 0 < rdma[r]["mq_bytes"] < 4096 * sends, (r, rdma[r]["mq_bytes"])
        assert "fate-rdma: federation of" in rdma[r]["log"] and "RabbitmqFederation" in rdma[r]["log"]
    # FATE's destroy ran through fate-rdma's wrapper on every party: the sessions' vhosts and users are gone
    assert rabbit.vhosts() == ["/"], rabbit.vhosts()
    assert rabbit.users() == [RabbitNode.user], rabbit.users()


def test_fallback_to_fate_sends_sliced_through_rabbitmq(rabbit, plain, tmp_path):
    """A site without fate-rdma (the arbiter: no section, nothing listens at its endpoint) and clients
    whose sections say `fallback: fate`: the clients' weights go through FATE's rabbitmq path, sliced
    into a table by fate-rdma exactly as FATE slices; the arbiter's replies arrive the FATE way and pass
    through the clients' wrappers untouched. Same weights as FATE alone."""
    eps, _ = endpoints()
    confs = {"guest": section(eps, fallback="fate", connect_timeout_s=2), "host": section(eps, fallback="fate",
             connect_timeout_s=2), "arbiter": None}
    res = run_job(rabbit, tmp_path / "fallback", "rmq_fallback", confs)
    for r in ("guest", "host"):
        st = res[r]["rdma"]
        assert res[r]["wrapped"] and st["fate_fallbacks"] == ROUNDS and st["rdma_transfers"] == 0, (r, st)
        assert res[r]["mq_bytes"] >= ROUNDS * PARAMS * 8, (r, res[r]["mq_bytes"])
        assert "sending through FATE's own federation" in res[r]["log"]
    assert not res["arbiter"]["wrapped"] and res["arbiter"]["rdma"] is None
    for r in ROLES:
        assert res[r]["sha256"] == plain[r]["sha256"], r
    assert rabbit.vhosts() == ["/"], rabbit.vhosts()
