"""Verbs across two processes: verified transfer, peer killed mid-transfer, benchmark output format."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import crc32c
import numpy as np
import pytest

import easypyverbs as ev
from easypyverbs.providers.soft.shm import works as shm_works
from fate_rdma_lab.bench.driver import PeerProcess, connect_verbs, stream_writes


@pytest.mark.parametrize("provider", ["soft", "pyverbs"])  # pyverbs: on rxe0 in the VM (make test-rdma)
def test_cross_process_write_verified(provider):
    from .verbs_pair import require

    require(provider)
    data = np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8)
    with ev.open_device(provider=provider) as ctx, PeerProcess() as peer:
        src = ctx.alloc_pd().reg_mr(data, ev.Access.LOCAL_WRITE)
        rc = connect_verbs(peer, provider, None, data.nbytes, src)
        stream_writes(rc, src, rc.remote_mrs["dst"], data.nbytes, 1 << 20, window=2, imm=77, src_offset_wraps=False)
        reply = peer.cmd({"cmd": "verify", "nbytes": data.nbytes, "timeout_s": 10})
        assert reply["crc32c"] == crc32c.crc32c(data) and reply["imm"] == 77
        rc.close()


def test_peer_killed_mid_transfer_errors_within_deadline():
    data = np.zeros(8 << 20, dtype=np.uint8)
    with ev.open_device(provider="soft", link="rate=200mbit", retry_timeout_s=5) as ctx:
        peer = PeerProcess()
        try:
            src = ctx.alloc_pd().reg_mr(data, ev.Access.LOCAL_WRITE)
            rc = connect_verbs(peer, "soft", None, data.nbytes, src)
            threading.Timer(0.3, lambda: os.kill(peer.proc.pid, signal.SIGKILL)).start()
            with pytest.raises((ev.CompletionError, ev.PollTimeout)) as ei:  # within stream_writes' deadline
                stream_writes(rc, src, rc.remote_mrs["dst"], 64 << 20, 1 << 20, window=8, timeout_s=20)
            if isinstance(ei.value, ev.CompletionError):
                assert ei.value.status in (ev.WCStatus.RETRY_EXC_ERR, ev.WCStatus.WR_FLUSH_ERR)
            assert rc.qp.state == ev.QPState.ERR
            rc.close()
        finally:
            peer.proc.kill()
            peer.proc.wait()
            peer.conn.close()


@pytest.mark.parametrize("soft_path", ["auto", "tcp"])
def test_bench_verbs_lines_are_labelled(soft_path):
    out = subprocess.run([sys.executable, "-m", "fate_rdma.cli", "bench", "verbs", "--sizes", "64K,4M", "--reps", "1",
                          "--max-bytes", "8000000", "--soft-path", soft_path], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    methods = {r["method"] for r in rows}
    assert {"raw_tcp", "write", "ratio"} <= methods
    for r in rows:
        assert {"method", "provider", "emulated", "msg_bytes"} <= set(r)
        if r["method"] == "write":
            assert r["provider"] == "soft" and r["emulated"] is True and r["gbps"] > 0
    paths = {r["path"] for r in rows if r["method"] == "ratio"}
    assert len(paths) == 1
    if paths == {"tcp"}:  # (--soft-path tcp; or auto where the same-host path is off or cannot run here)
        assert "target: soft (emulated, not RDMA, path tcp)" in out.stdout
    else:  # shared memory against loopback TCP: shown, never called met or not met
        assert soft_path == "auto" and "not judged on the same-host" in out.stdout
        assert "(met)" not in out.stdout and "NOT met" not in out.stdout


def test_bench_transfer_pairs_each_channel_transfer_with_a_raw_tcp_one():
    from fate_rdma_lab.bench.baselines import paired as _paired

    # the median of the pairs' ratios, not the ratio of the medians (2 / 2 here)
    assert _paired({"paired": [1.0, 2.0, 6.0], "times": [2.0, 4.0, 2.0]}) == \
        {"paired_raw_tcp_seconds": 2.0, "x_raw_tcp": 0.5}
    assert _paired({"paired": [], "times": [1.0]}) == {}
    base = [sys.executable, "-m", "fate_rdma.cli", "bench", "transfer", "--payload-mib", "4", "--reps", "2",
            "--scenarios", "loopback-tcp,link-10g-20ms", "--methods", "raw_tcp,raw_tcp_checked,shm_copy_checked,fedrdma-e", "--windows", "auto"]
    for extra, paired in (([], True), (["--unpaired", "--checksum", "none"], False)):
        out = subprocess.run(base + extra, capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stdout + out.stderr
        rows = {(r["scenario"], r["method"]): r
                for r in (json.loads(line) for line in out.stdout.splitlines() if line.startswith("{"))}
        e, raw = rows[("loopback-tcp", "fedrdma-e")], rows[("loopback-tcp", "raw_tcp")]
        assert "x_raw_tcp" not in rows[("link-10g-20ms", "fedrdma-e")]  # the link model has no raw TCP to pair
        block = f"{raw['seconds'] / e['seconds']:.2f}"
        checked = rows[("loopback-tcp", "raw_tcp_checked")]
        if paired:  # (blake3, the default: the keyed MAC, raw TCP with the same check beside it)
            assert checked["checksum"] == "blake3" and checked["seconds"] > 0 and checked["cpu_recv_s_per_gb"] > 0
            assert f"fedrdma-e / raw TCP with the same blake3 check on both sides = " \
                f"{checked['seconds'] / e['seconds']:.2f} (target >= 0.9 for the keyed default)" in out.stdout
            assert e["x_raw_tcp"] > 0 and e["paired_raw_tcp_seconds"] > 0 and checked["x_raw_tcp"] > 0
            copied = rows[("loopback", "shm_copy_checked")]  # (the same host's copy, whatever scenario ran first)
            if shm_works():  # (else the row is skipped with the reason)
                assert copied["checksum"] == "blake3" and copied["seconds"] > 0 and copied["x_raw_tcp"] > 0, copied
            assert f"{e['x_raw_tcp']:.2f} (median of 2 pairs, each beside a raw TCP transfer; {block} against the " \
                "raw TCP row) (target >= 0.95)" in out.stdout
        else:  # (no checksum: nothing for raw TCP to pay for)
            assert "seconds" not in checked and "skipped raw_tcp_checked: raw TCP has no none check" in out.stdout
            assert "skipped shm_copy_checked: no none check to price on a plain copy" in out.stdout
            assert "x_raw_tcp" not in e and "median of" not in out.stdout
            assert f"{block} (against the raw TCP row) (target >= 0.95)" in out.stdout


def test_demo_small():
    out = subprocess.run([sys.executable, "-m", "fate_rdma.cli", "demo", "--parts", "3", "--params", "3000000", "--msg-mib", "4"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "verify:" in out.stdout and "OK" in out.stdout and "soft (emulated verbs, not RDMA)" in out.stdout
    rows = [line for line in out.stdout.splitlines() if line.startswith(("fedrdma (", "fedrdma-e ("))]
    assert len(rows) == 2 and all(line.rstrip().endswith("OK") for line in rows), out.stdout  # both sends, both modes
    assert "first s  second s" in out.stdout and "demo: all results verified" in out.stdout


def test_bench_verbs_on_a_real_device_is_labelled_and_respects_max_msg_sz():
    from .verbs_pair import require

    require("pyverbs")
    with ev.open_device(provider="pyverbs") as ctx:
        limit, label = ctx.max_msg_bytes, ctx.label
    too_big = 2 * limit
    out = subprocess.run([sys.executable, "-m", "fate_rdma.cli", "bench", "verbs", "--providers", "pyverbs",
                          "--sizes", f"64K,{too_big}", "--reps", "1", "--max-bytes", "4000000"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    writes = [r for r in rows if r["method"] == "write" and r["provider"] == "pyverbs"]
    assert [r["msg_bytes"] for r in writes if "skipped" in r] == [too_big]  # refused, never posted
    done = [r for r in writes if "skipped" not in r]
    assert [r["msg_bytes"] for r in done] == [64 << 10] and done[0]["gbps"] > 0
    assert all(r["label"] == label and r["emulated"] is False for r in done)
    if getattr(ctx, "soft_roce", False):
        assert "not RDMA performance" in label or "not RDMA hardware performance" in label


@pytest.mark.parametrize("provider", ["soft", "pyverbs"])
def test_bench_regrant_times_both_ways_and_labels_them(provider):
    """`bench regrant`: per slot size, a new registration and a new key on the kept one, timed, with their ratio,
    each line labelled with its provider; pyverbs without memory windows says why its rekey row is skipped."""
    from .verbs_pair import require

    require(provider)
    out = subprocess.run([sys.executable, "-m", "fate_rdma.cli", "bench", "regrant", "--providers", provider,
                          "--sizes", "64K,2M", "--reps", "2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert {r["provider"] for r in rows} == {provider} and all(r["label"] for r in rows)
    for size in (64 << 10, 2 << 20):
        ways = {r["way"]: r for r in rows if r["slot_bytes"] == size}
        assert ways["register"]["median_ms"] > 0 and ways["register"]["reps"] == 2
        if "skipped" in ways["rekey"]:
            assert provider == "pyverbs" and "memory windows" in ways["rekey"]["skipped"]
        else:
            assert ways["rekey"]["median_ms"] > 0 and ways["ratio"]["register_over_rekey"] > 0
    assert ("emulated verbs, not RDMA" in out.stdout) == (provider == "soft")
    bad = subprocess.run([sys.executable, "-m", "fate_rdma.cli", "bench", "regrant", "--sizes", "12Q"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "fate-rdma bench regrant:" in bad.stderr
