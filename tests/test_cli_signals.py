"""SIGTERM to a `fate-rdma` command that starts jobs stops what it started (as Ctrl-C does).

A `bench fate` killed with SIGTERM used to die at once and leave its FATE job's party processes running (they
are in a process group of their own, so only its clean-up could stop them). Each test runs the command in a
child process: a SIGTERM there must not reach pytest.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# `fate-rdma bench` whose run starts a job group (a shell and its sleeping child, as a FATE launcher and its
# parties) with the same run_group bench fate and the demo use, then waits on it
SCRIPT = r"""
import signal, sys
import fate_rdma_lab.cli.bench as bench
from fate_rdma_lab.bench.local import run_group
from fate_rdma.cli import main

def run(args):
    run_group(["bash", "-c", "echo $$ > {out}/job.pid; sleep 600 & echo $! > {out}/party.pid; wait"], 600, "{out}")
    return 0

bench.run = run
rc = main(["bench", "verbs"])
restored = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
print(f"rc={{rc}} restored={{restored}}", flush=True)
sys.exit(rc)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie awaiting its reaper is gone too
    except FileNotFoundError:
        return True


def _wait_for(path: Path, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


def test_sigterm_stops_the_job_group_and_says_so(tmp_path: Path) -> None:
    p = subprocess.Popen([sys.executable, "-c", SCRIPT.format(out=tmp_path)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    job = None
    try:
        job, party = _wait_for(tmp_path / "job.pid"), _wait_for(tmp_path / "party.pid")
        assert not _gone(job) and not _gone(party)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 130, (out, err)
        assert "rc=130 restored=True" in out
        assert "fate-rdma bench: interrupted" in err
        deadline = time.monotonic() + 10
        while not (_gone(job) and _gone(party)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(job) and _gone(party), "the job's processes outlived the command"
    finally:
        if p.poll() is None:
            p.kill()
        if job is not None:
            try:
                os.killpg(job, signal.SIGKILL)  # the job leads its group (start_new_session)
            except ProcessLookupError:
                pass


# a job whose process spawns a child holding a multiprocessing lock (FATE's multiprocess launcher starts its
# parties with spawn): the lock is a named POSIX semaphore, /dev/shm/sem.mp-*, that only multiprocessing's
# resource tracker unlinks when the processes die without their own clean-up
SPAWNED = r"""
import multiprocessing as mp, os, sys, time

def child(lock):
    time.sleep(600)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    lock = ctx.Lock()
    ctx.Process(target=child, args=(lock,)).start()
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(lock._semlock.name)
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(600)
"""


def test_a_stopped_job_group_leaves_no_semaphore_in_dev_shm(tmp_path: Path) -> None:
    from fate_rdma_lab.bench.local import stop_group

    script = tmp_path / "spawned.py"
    script.write_text(SPAWNED)
    p = subprocess.Popen([sys.executable, str(script), str(tmp_path / "sem")], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "sem").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        sem = Path("/dev/shm") / ("sem." + (tmp_path / "sem").read_text().lstrip("/"))
        assert sem.exists(), f"{sem} should be there while the job runs"
        stop_group(p)
        assert p.returncode is not None
        with pytest.raises(ProcessLookupError):
            os.killpg(p.pid, 0)  # nothing of the group is left
        deadline = time.monotonic() + 10  # (the tracker unlinks it as it exits, after the others)
        while sem.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not sem.exists(), f"{sem} was left in /dev/shm"
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
