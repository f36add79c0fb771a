"""Parties of a job on this machine: free TCP ports for their endpoints, the endpoints of guest, host and
arbiter, and FATE launcher jobs run in their own process group (taken down whole on a timeout or an
interrupt). Used by the benches, the demo and the tests."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
from typing import Dict, List, Optional

PARTIES = ["guest:9999", "host:10000", "arbiter:10000"]
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


def run_group(cmd: List[str], timeout: float, cwd: str, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run a FATE launcher job in its own process group, and take the whole group down if it overruns
    or we are interrupted: the launcher's party processes would otherwise outlive it."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                         start_new_session=True, env=env)
    try:
        out, err = p.communicate(timeout=timeout)
    except BaseException:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.communicate()
        raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)
