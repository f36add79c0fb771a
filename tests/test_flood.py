"""Fair under pressure: strangers flooding an endpoint from 8 source addresses (connections that never say
anything, each holding a handshake until its deadline) fill the strangers' handshake slots of its bootstrap
listener and of its soft NIC's data listener, and a party of the job still connects and sends at once, on
slots the strangers cannot take (easypyverbs.admission). Real sockets between addresses of a dummy interface
of this host (a veth, 198.18.60.0/24: needs root and iproute2). The connect times with and without the flood are
printed (-s), not asserted: the figures belong in a benchmark, the test asserts that the party is admitted."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest

from fate_rdma.channel import Endpoint
from fate_rdma.channel.auth import write_secret
from fate_rdma.config import ChannelConfig

DEV = "frflood0"
VICTIM, PARTY = "198.18.60.1", "198.18.60.2"
FLOODERS = [f"198.18.60.{i}" for i in range(11, 19)]  # 8 source addresses


@pytest.fixture(scope="module")
def addresses():
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2 (a veth with addresses of 198.18.60.0/24)")
    subprocess.run(["ip", "link", "del", DEV], capture_output=True)
    try:
        # (a veth pair: this kernel may have no dummy interfaces; the addresses are local, so traffic between
        # them goes through loopback whatever the interface)
        subprocess.run(["ip", "link", "add", DEV, "type", "veth", "peer", "name", DEV + "p"], check=True,
                       capture_output=True)
        subprocess.run(["ip", "link", "set", DEV, "up"], check=True, capture_output=True)
        for a in [VICTIM, PARTY] + FLOODERS:
            subprocess.run(["ip", "addr", "add", f"{a}/32", "dev", DEV], check=True, capture_output=True)
    except subprocess.CalledProcessError as exc:
        subprocess.run(["ip", "link", "del", DEV], capture_output=True)
        pytest.skip(f"cannot make the test interface: {exc.stderr.decode(errors='replace').strip()}")
    yield
    subprocess.run(["ip", "link", "del", DEV], capture_output=True)


def _flood(target: str, per_source: int) -> list:
    """Connections to `target` (host:port) from every flooding address, `per_source` each, that say nothing."""
    host, _, port = target.rpartition(":")
    socks = []
    for src in FLOODERS:
        for _ in range(per_source):
            s = socket.socket()
            s.bind((src, 0))
            s.settimeout(2)
            try:
                s.connect((host, int(port)))
            except OSError:
                s.close()
                continue
            socks.append(s)
    return socks


def test_a_flood_from_eight_sources_does_not_keep_a_party_out(addresses, tmp_path):
    write_secret(str(tmp_path / "s"))
    cfg = ChannelConfig(provider="soft", secret_file=str(tmp_path / "s"), shared_secret_only=True, connect_timeout_s=10,
                        max_pending_handshakes=16, chunk_bytes=64 << 10, same_host=False)
    data = os.urandom(1 << 20)
    with Endpoint(cfg, host=PARTY) as party:
        with Endpoint(cfg, host=VICTIM, allowed_peers=[party.name]) as victim:
            t0 = time.monotonic()
            party.send(victim.address, data).result(30)
            baseline = time.monotonic() - t0
            victim.recv(10).release()
        with Endpoint(cfg, host=VICTIM, allowed_peers=[party.name]) as victim:
            flood = _flood(victim.address, 8) + _flood(victim.ctx.nic_address, 8)
            try:
                time.sleep(0.3)  # (every flooding connection accepted and holding its slot)
                t0 = time.monotonic()
                party.send(victim.address, data).result(30)
                flooded = time.monotonic() - t0
                msg = victim.recv(10)
                assert bytes(msg.view) == data and msg.peer == party.name
                msg.release()
                assert victim.refused >= 1  # (the flood did hit the strangers' bound)
            finally:
                for s in flood:
                    s.close()
    print(f"\nfirst connect and 1 MiB: {baseline:.3f} s alone, {flooded:.3f} s under a flood of {len(flood)} "
          f"silent connections from {len(FLOODERS)} addresses")
