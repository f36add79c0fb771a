"""FATE's multiprocess launcher, watched when fate-rdma is on (fate_rdma/federation/launcher.py): a party
process that ends without reporting fails the job at once, naming the party, instead of leaving the
launcher and the other parties waiting forever."""
from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading

import pytest

from fate_rdma.federation import activate
from fate_rdma.federation import launcher as L

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTIES = ["guest:9999", "host:10000", "arbiter:10000"]


class Proc:
    def __init__(self, exitcode=None):
        self.exitcode = exitcode


class Launcher:
    def __init__(self, *codes):
        self.world_size = len(codes)
        self.processes = [Proc(c) for c in codes]
        self._fate_rdma_parties = PARTIES
        self.output_or_exception_q: queue.Queue = queue.Queue()
        self._exception_tb: dict = {}


def ticking():
    t = [0.0]

    def clock():
        t[0] += 1.0
        return t[0]

    return clock


def test_every_party_reporting_success_is_success():
    la = Launcher(None, None, None)
    for rank in (2, 0, 1):
        la.output_or_exception_q.put((rank, None, None))
    assert L.watched_wait(la, poll_s=0.01) == 0 and la._exception_tb == {}


def test_a_reported_exception_fails_the_job_with_its_traceback():
    la = Launcher(None, None, None)
    la.output_or_exception_q.put((0, None, None))
    la.output_or_exception_q.put((1, RuntimeError("boom"), "the traceback"))
    assert L.watched_wait(la, poll_s=0.01) == 1 and la._exception_tb == {1: "the traceback"}


@pytest.mark.parametrize("code, said", [(3, "exit code 3"), (1, "exit code 1"), (0, "exit code 0"),
                                        (-9, "killed by SIGKILL (signal 9)"), (-15, "killed by SIGTERM (signal 15)")])
def test_a_party_gone_without_reporting_fails_the_job_naming_it(code, said):
    la = Launcher(None, code, None)
    la.output_or_exception_q.put((0, None, None))  # the guest finished; the arbiter still waits for the host
    assert L.watched_wait(la, poll_s=0.01, grace_s=2, clock=ticking()) == 1
    why = str(la._exception_tb[1])
    assert "host:10000 (rank 1)" in why and said in why and "without reporting" in why
    assert ("its log above says why" in why) == (code > 0)  # a signal or a clean exit leaves no error in the log
    assert list(la._exception_tb) == [1]


def test_a_report_that_arrives_just_after_the_exit_is_the_one_shown():
    la = Launcher(None, 1, None)

    def late():
        threading.Event().wait(0.2)
        la.output_or_exception_q.put((1, ValueError("bad"), "its own traceback"))

    threading.Thread(target=late).start()
    assert L.watched_wait(la, poll_s=0.01, grace_s=5.0) == 1
    assert la._exception_tb == {1: "its own traceback"}


def test_a_party_that_exits_after_reporting_success_is_not_a_failure():
    la = Launcher(0, None)  # rank 0 reported and ended while rank 1 still works
    la.output_or_exception_q.put((0, None, None))

    def later():
        threading.Event().wait(0.3)  # several polls in which rank 0 is gone
        la.output_or_exception_q.put((1, None, None))

    threading.Thread(target=later).start()
    assert L.watched_wait(la, poll_s=0.01, grace_s=0) == 0 and la._exception_tb == {}


def test_a_signal_without_a_name_is_described():
    assert L.exit_status(-200) == "killed by an unknown signal (signal 200)"
    assert L.exit_status(-40).startswith("killed by Real-time signal")


def test_markup_in_a_party_name_is_shown_as_it_is():
    la = Launcher(None, 3)
    la._fate_rdma_parties = ["guest:9999", "[bold]host:1"]
    assert L.watched_wait(la, poll_s=0.01, grace_s=0) == 1
    assert "[bold]host:1 (rank 1)" in la._exception_tb[1].plain


def test_party_names_fall_back_to_the_rank():
    la = Launcher(None, None)
    assert L._party_of(la, 1) == "host:10000 (rank 1)" and L._party_of(la, 3) == "rank 3"
    la._fate_rdma_parties = [("guest", "9999"), ("host", "10000")]
    assert L._party_of(la, 0) == "guest:9999 (rank 0)"
    la._fate_rdma_parties = None
    assert L._party_of(la, 0) == "rank 0"


def test_the_patch_watches_only_when_fate_rdma_is_configured(monkeypatch):
    calls = []

    class FateLauncher(Launcher):
        def __init__(self, console, parties=None, federation_session_id=None):
            super().__init__(None)

        def wait(self):
            calls.append("fate")
            return 7

    L.patch_launcher(FateLauncher)
    L.patch_launcher(FateLauncher)  # idempotent
    monkeypatch.delenv("FATE_RDMA_CONF", raising=False)
    monkeypatch.setattr(activate, "_explicit", None)
    monkeypatch.setattr(activate, "_from_task_conf", None)
    assert FateLauncher(None).wait() == 7 and calls == ["fate"]
    monkeypatch.setenv("FATE_RDMA_CONF", json.dumps({"fate_rdma": {"enabled": False, "endpoints": {}}}))
    assert FateLauncher(None).wait() == 7 and calls == ["fate", "fate"]
    monkeypatch.setenv("FATE_RDMA_CONF", json.dumps({"fate_rdma": {"endpoints": {}}}))
    la = FateLauncher(None, ["a:1"])
    assert la._fate_rdma_parties == ["a:1"]
    la.output_or_exception_q.put((0, None, None))
    assert la.wait() == 0 and calls == ["fate", "fate"]
    # a configuration that cannot be read fails every party while FATE builds its context: watched
    for bad in (os.path.join(ROOT, "no-such-file.yaml"), "{not json"):
        monkeypatch.setenv("FATE_RDMA_CONF", bad)
        la = FateLauncher(None)
        la.output_or_exception_q.put((0, None, None))
        assert la.wait() == 0 and calls == ["fate", "fate"]


# -- real FATE launcher jobs (three spawned parties each) ---------------------------------------------------
def _launch(tmp_path, ports, dies):
    pytest.importorskip("fate.arch.launchers.multiprocess_launcher", reason="FATE (pyfate) is not installed")
    from fate_rdma.federation.hook import pth_path

    if not os.path.exists(pth_path()):
        pytest.skip("the start-up hook is not installed (make test runs `fate-rdma hook install`)")
    conf = tmp_path / "fate_rdma.json"
    conf.write_text(json.dumps({"fate_rdma": {
        "mode": "fedrdma-e", "provider": "soft", "slot_bytes": 1 << 20, "connect_timeout_s": 5,
        "endpoints": {party: f"127.0.0.1:{port}" for party, port in zip(PARTIES, ports)}}}))
    cmd = [sys.executable, "-m", "fate_rdma.cli", "launch", "--conf", str(conf), os.path.join(ROOT, "tests", "launcher_job.py"),
           "--parties", *PARTIES, "--log_level", "WARNING", "--dies", dies]
    # without the watch this job never ends: the timeout is the test's failure, not a figure; the whole
    # process group goes then, the launcher's party processes included
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(tmp_path),
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            from fate_rdma_lab.bench.local import stop_group

            stop_group(p)  # (SIGTERM first: the spawned parties' semaphores are unlinked, not left in /dev/shm)
    return p.returncode, out, " ".join(out.replace("│", " ").split())  # rich wraps and boxes the message


def test_a_launcher_job_whose_party_exits_before_reporting_stops(tmp_path):
    from fate_rdma_lab.bench.local import free_ports

    rc, out, said = _launch(tmp_path, free_ports(3), "host")
    assert rc == 1, out[-3000:]
    assert "party host:10000 (rank 1) ended (exit code 3) without reporting" in said, out[-3000:]


def test_a_launcher_job_whose_party_cannot_open_its_endpoint_stops(tmp_path):
    from fate_rdma_lab.bench.local import free_ports

    ports = free_ports(3)
    taken = socket.socket()
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    taken.bind(("127.0.0.1", ports[2]))  # the arbiter's: its federation fails while FATE builds its context
    taken.listen(1)
    try:
        rc, out, said = _launch(tmp_path, ports, "none")
    finally:
        taken.close()
    assert rc == 1, out[-3000:]
    assert "party arbiter:10000 (rank 2) ended (exit code 1) without reporting" in said, out[-3000:]
    assert "in use" in said, out[-3000:]  # the arbiter's own error, in its log


def test_launch_refuses_a_bad_conf_or_script_with_exit_2_and_no_traceback(tmp_path, capsys):
    from fate_rdma.cli import main

    script = tmp_path / "job.py"
    script.write_text("raise SystemExit(9)\n")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"fate_rdma": {"mode": "bogus", "endpoints": {"guest:9999": "127.0.0.1:1"}}}))
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    broken = tmp_path / "broken.yaml"
    broken.write_text("fate_rdma: {mode: [\n")
    listed = tmp_path / "list.yaml"
    listed.write_text("- fate_rdma\n")
    cases = [(str(bad), str(script), "mode must be one of"), (str(empty), str(script), "has no fate_rdma section"),
             (str(broken), str(script), "not a readable YAML/JSON file"), (str(listed), str(script), "must be a mapping"),
             (str(tmp_path / "missing.yaml"), str(script), "--conf"), (str(bad), str(tmp_path / "nope.py"), "the script")]
    for conf, job, said in cases:
        assert main(["launch", "--conf", conf, job]) == 2
        err = capsys.readouterr().err
        assert err.startswith("fate-rdma launch: ") and said in err and "Traceback" not in err, err
