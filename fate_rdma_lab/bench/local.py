"""Parties of a job on this machine: free TCP ports for their endpoints, the endpoints of guest, host and
arbiter, and FATE launcher jobs run in their own process group (taken down whole on a timeout or an
interrupt, SIGTERM first: `stop_group`). Used by the benches, the demo, the sweep and the tests."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from typing import Dict, List, Optional

PARTIES = ["guest:9999", "host:10000", "arbiter:10000"]
#: how long a job's process group has to go after SIGTERM before SIGKILL (stop_group)
STOP_GRACE_S = 5.0
#: where free_ports looks first: below the kernel's ephemeral range (ip_local_port_range), from here up
FIXED_PORTS_FROM = 20000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int) -> List[int]:
    """`n` distinct free TCP ports on 127.0.0.1 (all held while choosing, so none repeats), below the
    kernel's ephemeral range where there is room: a port is bound some time after it is chosen (by
    another process: a party, a broker), and one from the ephemeral range could be taken meanwhile by
    any outgoing connection of this machine (a CI run failed so, EADDRINUSE at a party's endpoint)."""
    low, rng = _ephemeral_low(), random.SystemRandom()
    socks: List[socket.socket] = []
    try:
        for attempt in range(50 * n + 100):
            if len(socks) == n:
                break
            s = socket.socket()
            # past the tries (a crowded range): any free port the kernel gives
            port = rng.randrange(FIXED_PORTS_FROM, low) if low - FIXED_PORTS_FROM > 4 * n and attempt < 50 * n else 0
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        if len(socks) < n:
            raise OSError(f"no {n} free TCP ports on 127.0.0.1")
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def local_endpoints() -> Dict[str, str]:
    """The `endpoints` of a fate_rdma section for guest, host and arbiter on this machine."""
    return {p: f"127.0.0.1:{port}" for p, port in zip(PARTIES, free_ports(len(PARTIES)))}


def stop_group(p: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """Take down the process group `p` leads (started with start_new_session) and reap `p`: SIGTERM to the
    group, up to `grace_s` for every member to go, then SIGKILL to what is left. SIGTERM first because
    multiprocessing's resource tracker ignores it and, once the processes it served are gone, unlinks the
    named semaphores (/dev/shm/sem.mp-*) that spawned processes held; SIGKILL at once killed the tracker
    too and left them in /dev/shm for good (tests/test_cli_signals.py)."""
    try:
        os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
        p.wait()
        return
    deadline = time.monotonic() + grace_s
    try:
        p.wait(timeout=grace_s)  # (the leader, until reaped, keeps the group alive to killpg)
    except subprocess.TimeoutExpired:
        pass
    while time.monotonic() < deadline:
        try:
            os.killpg(p.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.02)
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def run_group(cmd: List[str], timeout: float, cwd: str, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run a FATE launcher job in its own process group, and take the whole group down (stop_group) if it
    overruns or we are interrupted: the launcher's party processes would otherwise outlive it."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                         start_new_session=True, env=env)
    try:
        out, err = p.communicate(timeout=timeout)
    except BaseException:
        stop_group(p)
        p.communicate()
        raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)
