"""Provider selection, the pyverbs "no device" path, and doctor."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import easypyverbs as ev
from easypyverbs.providers import pyverbs_provider as pv


def test_auto_picks_soft_without_device_and_says_why():
    ok, why, devices = pv.status()
    if devices:
        pytest.skip("this machine has an RDMA device")
    chosen, reason = ev.choose_provider("auto")
    assert chosen == "soft" and "no RDMA device" in reason
    with ev.open_device() as ctx:
        assert ctx.provider == "soft" and ctx.emulated and ctx.label == "soft (emulated verbs, not RDMA)"


def test_pyverbs_without_device_is_a_clear_error():
    ok, why, devices = pv.status()
    if devices:
        pytest.skip("this machine has an RDMA device")
    with pytest.raises(ev.NoDeviceError, match="pyverbs provider: .*(no RDMA device|not importable)"):
        ev.open_device(provider="pyverbs")


def test_pyverbs_imports_from_system_rdma_core():
    """make test runs deploy/install-rdma-core.sh, so pyverbs must import inside the venv."""
    ok, why, _ = pv.status()
    if not ok:
        pytest.skip(f"pyverbs not installed here: {why}")
    e = pv._enums()
    assert e.IBV_WC_REM_ACCESS_ERR == ev.WCStatus.REM_ACCESS_ERR
    assert e.IBV_WC_RNR_RETRY_EXC_ERR == ev.WCStatus.RNR_RETRY_EXC_ERR
    assert e.IBV_ACCESS_REMOTE_WRITE == ev.Access.REMOTE_WRITE
    assert e.IBV_WC_RECV_RDMA_WITH_IMM == ev.WCOpcode.RECV_RDMA_WITH_IMM


def test_unknown_provider_and_link_misuse():
    with pytest.raises(ev.UsageError, match="unknown provider"):
        ev.open_device(provider="magic")
    if not pv.status()[2]:
        with pytest.raises((ev.UsageError, ev.NoDeviceError)):
            ev.open_device(provider="pyverbs", link="rate=1gbit")


@pytest.mark.parametrize("cmd", [["fate_rdma.cli", "doctor"], ["easypyverbs", "doctor"]])
def test_doctor_cli(cmd):
    out = subprocess.run([sys.executable, "-m", *cmd], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "soft" in out.stdout and "emulat" in out.stdout and "auto picks" in out.stdout


def test_doctor_json():
    out = subprocess.run([sys.executable, "-m", "fate_rdma.cli", "doctor", "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    rep = json.loads(out.stdout)
    assert rep["soft"]["emulated"] is True and rep["auto"]["provider"] in ("soft", "pyverbs")
    assert rep["soft"]["deferred_answers"] is True
    off = subprocess.run([sys.executable, "-m", "fate_rdma.cli", "doctor"], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, EASYPYVERBS_SOFT_DEFER_ACK="off"))
    assert "deferred answers" in off.stdout and "ms): off" in off.stdout, off.stdout[-2000:]


def test_doctor_reads_the_channel_settings_of_each_kind_of_conf_and_refuses_a_file_without(tmp_path):
    from fate_rdma.cli.doctor import channel_config
    from fate_rdma.errors import ConfigError

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    job = tmp_path / "job.yaml"  # a fate-flow job conf: the section under dag.conf.extra, no endpoints
    job.write_text("dag:\n  conf:\n    extra:\n      fate_rdma: {mode: fedrdma-e, slot_bytes: 8388608, enabled: true}\n")
    assert channel_config(str(job)).slot_bytes == 8 << 20
    assert channel_config(os.path.join(root, "conf", "fate_rdma_launcher.yaml")).too_large == "fedrdma"  # (not the default)
    both = tmp_path / "both.yaml"  # a channel: section wins over a fate_rdma one
    both.write_text("channel: {mode: fedrdma, pool_slots: 3}\nfate_rdma: {mode: fedrdma-e, pool_slots: 5}\n")
    assert (channel_config(str(both)).mode, channel_config(str(both)).pool_slots) == ("fedrdma", 3)
    other = tmp_path / "other.yaml"
    other.write_text("something: else\n")
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("channel: {chunk_bytes: 4M}\n")
    for path, said in ((other, "no `channel:` section"), (tmp_path / "missing.yaml", "no such file"), (wrong, "wrong.yaml")):
        with pytest.raises(ConfigError, match=said):
            channel_config(str(path))
    out = subprocess.run([sys.executable, "-m", "fate_rdma.cli", "doctor", "--config", str(other)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.startswith("fate-rdma doctor: --config ") and "Traceback" not in out.stderr


def test_cli_help_and_usage_errors():
    out = subprocess.run([sys.executable, "-m", "fate_rdma.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "doctor" in out.stdout and "bench" in out.stdout
    out = subprocess.run([sys.executable, "-m", "fate_rdma.cli", "bench", "nope"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2


@pytest.mark.parametrize("how", ["close", "revoke_remote"])
def test_soft_deregistration_waits_for_a_write_being_placed(monkeypatch, how):
    """Like a NIC, the soft NIC finishes (or fails) a WRITE it is placing before a deregistration of its
    target MR returns: once `close` (or `revoke_remote`, which keeps the memory registered) has returned,
    no byte changes in that memory; a WRITE with the old rkey afterwards fails with REM_ACCESS_ERR.
    (FedRDMA-E revokes a slot this way when its transfer arrives, before checking the checksum: a peer's
    late WRITE must not change what was checked.)"""
    import threading
    import time

    from easypyverbs.providers.soft import wire

    from .verbs_pair import close_pair, make_pair

    real = wire.recv_exactly_into

    def slow_sender(sock, view):  # the payload of a large WRITE arrives in two halves, 0.6 s apart
        if view.nbytes < 1 << 20:
            return real(sock, view)
        half = view.nbytes // 2
        real(sock, view[:half])
        time.sleep(0.6)
        real(sock, view[half:])

    monkeypatch.setattr(wire, "recv_exactly_into", slow_sender)
    size = 4 << 20
    a, b = make_pair("soft-tcp", size=size, retry_timeout_s=10.0)
    try:
        a.buf[:] = b"\xab" * size
        remote = b.mr.remote()
        a.qp.post_write(a.mr.sge(0, size), remote, wr_id=1)
        time.sleep(0.2)  # the first half is in place, the second on its way
        t0 = time.monotonic()
        closer = threading.Thread(target=getattr(b.mr, how))
        closer.start()
        closer.join(30)
        assert not closer.is_alive()
        waited = time.monotonic() - t0
        snapshot = bytes(b.buf)
        (wc,) = a.cq.wait_n(1, 30)
        time.sleep(0.3)
        assert bytes(b.buf) == snapshot  # nothing landed after the deregistration returned
        assert wc.status == ev.WCStatus.SUCCESS and snapshot == bytes(a.buf), wc  # placed whole, before it
        print(f"\nderegistration waited {waited:.2f} s for the WRITE being placed")
        a.qp.post_write(a.mr.sge(0, 4096), remote, wr_id=2)
        (wc2,) = a.cq.wait_n(1, 30)
        assert wc2.status == ev.WCStatus.REM_ACCESS_ERR
        assert bytes(b.buf) == snapshot
    finally:
        close_pair([a, b])


def test_soft_rekey_opens_the_memory_again_under_a_new_rkey_only():
    """MR.revoke_remote + MR.rekey (soft provider; FedRDMA-E's slot grants): no key opens the memory between
    the two, and afterwards only the new one does; a rekey without a revoke first is a usage error. A NIC's
    MR registered without revocable=True answers False (test_verbs_conformance). (A refused WRITE puts the
    writer's QP in error, as on a NIC: each pair below ends with one.)"""
    from .test_verbs_conformance import _write_status as write
    from .verbs_pair import close_pair, make_pair

    a, b = make_pair("soft-tcp", size=1 << 16)
    try:  # revoked, not yet rekeyed: the old key fails
        old = b.mr.remote()
        with pytest.raises(ev.UsageError, match="revoke_remote"):
            b.mr.rekey()
        assert write(a, old, b"\x01") == ev.WCStatus.SUCCESS and bytes(b.buf[:4096]) == b"\x01" * 4096
        assert b.mr.revoke_remote() is True
        assert b.mr.begin_remote(old.rkey, 0, 16) is None and b.mr.remote_view(old.rkey, 0, 16) is None
        assert write(a, old, b"\x02") == ev.WCStatus.REM_ACCESS_ERR
        assert bytes(b.buf[:4096]) == b"\x01" * 4096
    finally:
        close_pair([a, b])
    a, b = make_pair("soft-tcp", size=1 << 16)
    try:  # rekeyed: the new key writes, the old one fails
        old = b.mr.remote()
        assert b.mr.revoke_remote() is True
        rkey = b.mr.rekey()
        new = b.mr.remote()
        assert rkey == new.rkey == b.mr.rkey != old.rkey and new.addr == old.addr
        # a request that found the MR under its old key before the revoke is refused when it comes to the bytes
        assert b.mr.begin_remote(old.rkey, 0, 16) is None and b.mr.remote_view(old.rkey, 0, 16) is None
        assert b.mr.remote_view(rkey, 0, 16) is not None
        assert b.mr.begin_remote(rkey, 0, 16) is not None
        b.mr.end_remote()
        assert write(a, new, b"\x03") == ev.WCStatus.SUCCESS and bytes(b.buf[:4096]) == b"\x03" * 4096
        assert write(a, old, b"\x04") == ev.WCStatus.REM_ACCESS_ERR
        assert bytes(b.buf[:4096]) == b"\x03" * 4096
    finally:
        close_pair([a, b])


def test_demo_part_2_gives_bench_fate_every_argument():
    """`fate-rdma demo` part 2 calls `bench fate` with a namespace of its own: it must carry every option
    `bench fate` defines (a new bench option once broke `make demo` here)."""
    import argparse

    from fate_rdma_lab.bench import fate_federation
    from fate_rdma_lab.cli.demo import full_comparison_args

    p = argparse.ArgumentParser()
    fate_federation.add_arguments(p)
    wanted = {a.dest for a in p._actions if a.dest != "help"}
    assert wanted <= set(vars(full_comparison_args("soft")))


def test_memory_windows_setting(monkeypatch):
    """EASYPYVERBS_MEMORY_WINDOWS: on (the default), off; anything else is a usage error naming the variable. No
    setting gives windows a device does not have."""
    from easypyverbs.providers.pyverbs_windows import windows_wanted

    monkeypatch.delenv("EASYPYVERBS_MEMORY_WINDOWS", raising=False)
    assert [windows_wanted(True), windows_wanted(False)] == [True, False]  # on by default
    for how, want in (("", [True, False]), ("on", [True, False]), (" On ", [True, False]), ("OFF", [False, False])):
        monkeypatch.setenv("EASYPYVERBS_MEMORY_WINDOWS", how)
        assert [windows_wanted(True), windows_wanted(False)] == want, how
    monkeypatch.setenv("EASYPYVERBS_MEMORY_WINDOWS", "auto")
    with pytest.raises(ev.UsageError, match="EASYPYVERBS_MEMORY_WINDOWS='auto': expected on or off"):
        windows_wanted(True)


def test_the_soft_nic_listens_on_the_ports_it_is_given(tmp_path):
    """soft_data_ports: the data listener takes the first free port of the range (so that a firewall can name
    them); once every port is taken, opening one more says so and how to fix it."""
    from fate_rdma.channel import Endpoint
    from fate_rdma.config import ChannelConfig

    from fate_rdma_lab.bench.local import free_ports

    low = free_ports(1)[0]
    cfg = ChannelConfig(provider="soft", soft_data_ports=f"{low}-{low + 1}")
    with Endpoint(cfg) as a, Endpoint(cfg) as b:
        ports = sorted(int(ep.ctx.nic_address.rpartition(":")[2]) for ep in (a, b))
        assert ports == [low, low + 1]
        a.send(b.address, b"through the named ports").result(20)
        assert bytes(b.recv(20).detach()) == b"through the named ports"
        with pytest.raises(ev.EasyVerbsError, match=f"every data port of {low}-{low + 1} .*soft_data_ports"):
            Endpoint(cfg)
    with pytest.raises(Exception, match="soft_data_ports must be LOW-HIGH"):
        ChannelConfig(soft_data_ports="9000-80")
