"""`fate-rdma bench transfer`: its verdict lines, and the Mooncake rows where Mooncake is missing."""
from __future__ import annotations

from fate_rdma_lab.bench import mooncake, transfer


def _row(method, seconds, snd, rcv):
    return {"method": method, "seconds": seconds, "cpu_send_s_per_gb": snd, "cpu_recv_s_per_gb": rcv}


def test_bench_transfers_verdicts_keep_the_paths_apart_and_label_every_emulated_line(capsys):
    """Same host against its own target, loopback TCP against 0.95 with gRPC beside it (both over TCP), and
    every verdict line that rests on the soft provider says it is an emulation."""
    soft = {"emulated": True, "label": "soft (emulated verbs, not RDMA)", "cpu_send_s_per_gb": 0.3, "cpu_recv_s_per_gb": 0.2}
    rows = [dict(_row("raw_tcp", 0.25, 0.2, 0.2), scenario="loopback", window=None, emulated=False),
            dict(_row("grpc_stream", 0.5, 0.3, 0.3), scenario="loopback", window=None, emulated=False),
            dict(soft, scenario="loopback", method="fedrdma-e", window="auto (8)", seconds=0.1,
                 path="same-host (memfd map / process_vm_readv)", extra_rss_bytes=1 << 20),
            dict(soft, scenario="loopback-tcp", method="fedrdma-e", window="auto (8)", seconds=0.3, path="tcp",
                 checksum="xxh3", x_raw_tcp=0.8)]
    transfer._verdicts(rows, 10**9, 3)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    same = next(ln for ln in lines if ln.startswith("same host"))
    assert "raw TCP throughput = 2.50 (against the raw TCP row) (target >= 2)" in same and "gRPC" not in same
    tcp = next(ln for ln in lines if ln.startswith("over loopback TCP (as between hosts"))
    assert "= 0.80 (median of 3 pairs" in tcp and "(target >= 0.95); fedrdma-e / gRPC stream = 1.67 (target >= 2)" in tcp
    assert len(lines) >= 4 and all("[soft provider: emulated verbs, not an RDMA figure]" in ln for ln in lines)


def test_without_mooncake_its_rows_are_skipped_with_how_to_install_it(monkeypatch):
    monkeypatch.setattr(mooncake.importlib.util, "find_spec", lambda name: None)
    why = mooncake.missing()
    assert why is not None and "not installed" in why and "pip install -e './lab[mooncake]'" in why
    got = mooncake.measure(["raw_tcp", "mooncake", "mooncake_batch"], "127.0.0.1", 1 << 20, 0, 0, 1, 1 << 20)
    assert got == {"mooncake": {"skipped": why}, "mooncake_batch": {"skipped": why}}
    assert mooncake.measure(["raw_tcp"], "127.0.0.1", 1 << 20, 0, 0, 1, 1 << 20) == {}


def test_a_loopback_row_that_did_not_take_the_same_host_path_is_held_to_the_tcp_target(capsys):
    rows = [dict(_row("raw_tcp", 0.25, 0.2, 0.2), scenario="loopback", window=None, emulated=False),
            dict(_row("fedrdma-e", 0.3, 0.3, 0.2), scenario="loopback", window="auto (8)", path="tcp", emulated=True,
                 checksum="xxh3", extra_rss_bytes=0)]
    transfer._verdicts(rows, 10**9, 3)
    out = capsys.readouterr().out
    assert "over loopback TCP (as between hosts, same-host path not taken, checksum xxh3)" in out
    assert "(target >= 0.95)" in out and "target >= 2" not in out and "same host," not in out


def test_a_loopback_row_over_a_devices_verbs_is_held_to_the_verbs_target_and_named_for_its_device(capsys):
    rows = [dict(_row("raw_tcp", 0.25, 0.2, 0.2), scenario="loopback", window=None, emulated=False),
            dict(_row("grpc_stream", 0.5, 0.3, 0.3), scenario="loopback", window=None, emulated=False),
            dict(_row("fedrdma-e", 0.3, 0.3, 0.2), scenario="loopback", window="auto (4)", path="verbs", emulated=False,
                 label="pyverbs (rxe0)", checksum="xxh3", extra_rss_bytes=0)]
    transfer._verdicts(rows, 10**9, 3)
    out = capsys.readouterr().out
    assert ("loopback, data path verbs (checksum xxh3) [rxe: kernel verbs without RDMA hardware]: fedrdma-e / raw TCP "
            "throughput = 0.83 (against the raw TCP row) (target >= 0.8); fedrdma-e / gRPC stream = 1.67 (target >= 2)") in out
    assert "RDMA figure" not in out


def test_a_fedrdma_e_row_is_compared_with_raw_tcp_paying_for_the_same_check(capsys):
    """The checked baseline's line names the check and both ratios; a row with another check gets none."""
    rows = [dict(_row("raw_tcp", 0.25, 0.2, 0.2), scenario="loopback-tcp", window=None, emulated=False),
            dict(_row("raw_tcp_checked", 0.3125, 0.25, 0.25), scenario="loopback-tcp", window=None, emulated=False,
                 checksum="xxh3"),
            dict(_row("fedrdma-e", 0.4, 0.3, 0.3), scenario="loopback-tcp", window="auto (4)", path="tcp", emulated=True,
                 label="soft (emulated verbs, not RDMA)", checksum="xxh3")]
    transfer._verdicts(rows, 10**9, 3)
    out = capsys.readouterr().out
    assert ("loopback-tcp, data path tcp [soft provider: emulated verbs, not an RDMA figure]: fedrdma-e / raw TCP with the "
            "same xxh3 check on both sides = 0.78 (against that row, 0.312 s; it reaches 0.80 x raw TCP's throughput "
            "(against the raw TCP row))") in out
    # the check alone keeps raw TCP under the TCP target: said, once, for the TCP row
    assert out.count("the target (>= 0.95 x raw TCP) is beyond this machine with this check: raw_tcp_checked, which "
                     "moves the bytes and checks them and does nothing else, reaches 0.80 x") == 1
    rows[2]["checksum"] = "crc32c"
    transfer._verdicts(rows, 10**9, 3)
    assert "with the same" not in capsys.readouterr().out


def test_the_same_host_row_is_compared_with_one_plain_copy_paying_for_the_same_check(capsys):
    """The copy baseline with the row's own check (paired against raw TCP), and the target said out of reach
    only where that copy itself stays under it."""
    soft = {"emulated": True, "label": "soft (emulated verbs, not RDMA)", "scenario": "loopback", "window": "auto (4)",
            "path": "same-host (memfd map / process_vm_readv)", "checksum": "xxh3"}
    base = {"scenario": "loopback", "window": None, "emulated": False, "provider": "memfd", "path": "same-host copy"}
    rows = [dict(_row("raw_tcp", 0.4, 0.3, 0.2), scenario="loopback", window=None, emulated=False),
            dict(_row("shm_copy", 0.15, 0.0, 0.25), **base, checksum="none", x_raw_tcp=2.7),
            dict(_row("shm_copy_checked", 0.25, 0.1, 0.3), **base, checksum="xxh3", x_raw_tcp=1.55),
            dict(_row("fedrdma-e", 0.27, 0.15, 0.3), **soft, x_raw_tcp=1.45, extra_rss_bytes=0)]
    transfer._verdicts(rows, 10**9, 3)
    out = capsys.readouterr().out
    assert ("same host, data path same-host (memfd map / process_vm_readv) [soft provider: emulated verbs, not an RDMA "
            "figure]: fedrdma-e / one plain copy out of shared memory (shm_copy_checked, checksum xxh3) = 0.93 (that copy "
            "0.250 s, it reaches 1.55 x raw TCP's throughput (median of 3 pairs))") in out
    assert "the target (>= 2 x raw TCP) is beyond this machine with this check: shm_copy_checked" in out
    rows[3]["checksum"] = "none"  # compared with the plain copy, and no check to blame
    transfer._verdicts(rows, 10**9, 3)
    out = capsys.readouterr().out
    assert "(shm_copy, checksum none) = 0.56" in out and "beyond this machine" not in out
