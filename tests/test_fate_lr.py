"""FATE 2.2's own hetero coordinated LR (guest with the label, host, arbiter decrypting Paillier gradients)
through FATE's multiprocess launcher, once over FATE's own (standalone) federation and once under
`fate-rdma launch`: both succeed, every party ends with bitwise the same model and the guest with the
same predictions, and fate-rdma carried the job's objects. (With pandas 3 FATE's own LR fails on both
paths: pyproject.toml pins pandas to the 2.2 series FATE 2.2 was built against.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.system

pytest.importorskip("fate.ml.glm", reason="FATE (pyfate) is not installed; make test installs it")

from fate_rdma_lab.bench.local import free_ports  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROLES = ("guest", "host", "arbiter")
PARTIES = ["guest:9999", "host:10000", "arbiter:10000"]


def run_job(tmp_path, name, conf=None):
    out, cwd = tmp_path / name, tmp_path / f"{name}_cwd"
    cwd.mkdir()
    argv = [os.path.join(ROOT, "tests", "coordinated_lr_job.py")]
    if conf:
        argv = ["-m", "fate_rdma.cli", "launch", "--conf", str(conf)] + argv
    argv += ["--parties", *PARTIES, "--log_level", "WARNING", "--data_dir", str(cwd / "data"), "--out", str(out)]
    p = subprocess.run([sys.executable] + argv, capture_output=True, text=True, timeout=240, cwd=str(cwd))
    assert p.returncode == 0, f"{name} job failed:\n" + p.stdout[-4000:] + p.stderr[-4000:]
    return {r: json.load(open(out / f"{r}.json")) for r in ROLES}


@pytest.mark.timeout(480)
def test_fate_coordinated_lr_bitwise_identical_with_and_without_fate_rdma(tmp_path):
    from fate_rdma.federation.hook import pth_path

    if not os.path.exists(pth_path()):
        pytest.skip("the start-up hook is not installed (make test runs `fate-rdma hook install`)")
    conf = tmp_path / "fate_rdma.json"
    conf.write_text(json.dumps({"fate_rdma": {
        "enabled": True, "mode": "fedrdma-e", "provider": "soft", "slot_bytes": 4 << 20,
        "threshold_bytes": 1024,  # the LR's payloads are small (Paillier ciphertexts of a 40-row batch: a few KB)
        "connect_timeout_s": 5, "pull_timeout_s": 60, "get_timeout_s": 120,
        "endpoints": dict(zip(PARTIES, (f"127.0.0.1:{port}" for port in free_ports(3))))}}))

    plain = run_job(tmp_path, "plain")
    rdma = run_job(tmp_path, "rdma", conf)

    for role in ROLES:
        assert plain[role]["rdma"] is None
        st = rdma[role]["rdma"]
        assert st is not None, f"{role}: fate-rdma was not on in the fate-rdma job"
        assert st["fate_fallbacks"] == 0, (role, st)
        # bitwise: same JSON (floats written as repr, which round-trips every bit)
        same = {k: v for k, v in plain[role].items() if k != "rdma"}
        assert json.dumps(same, sort_keys=True) == json.dumps({k: v for k, v in rdma[role].items() if k != "rdma"},
                                                              sort_keys=True), f"{role}: results differ with fate-rdma"
        # every party sent something over the channel (the arbiter: the public key, the decrypted gradients)
        assert st["rdma_transfers"] + st["small_transfers"] > 0, (role, st)
    # the Paillier-encrypted half-gradients (guest -> host) and the host's encrypted gradients (host -> arbiter)
    # are above threshold_bytes: they crossed as payloads
    for role in ("guest", "host"):
        assert rdma[role]["rdma"]["rdma_transfers"] > 0 and rdma[role]["rdma"]["rdma_bytes"] > 0, rdma[role]["rdma"]
    model = plain["guest"]["model"]["data"]["estimator"]["param"]
    assert len(model["coef_"]) == 3 and model["intercept_"] is not None
    assert len(plain["host"]["model"]["data"]["estimator"]["param"]["coef_"]) == 4
    preds = plain["guest"]["predictions"]
    assert len(preds) == 120 and all(0.0 < score < 1.0 for score, _ in preds.values())
