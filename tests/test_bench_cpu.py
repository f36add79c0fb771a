"""The benches' CPU arithmetic: the ceiling a method's CPU per GB puts on its ratio to raw TCP."""
from __future__ import annotations

from fate_rdma_lab.bench import cpu


def _row(method, seconds, snd, rcv):
    return {"method": method, "seconds": seconds, "cpu_send_s_per_gb": snd, "cpu_recv_s_per_gb": rcv}


def test_a_cpu_bound_raw_tcp_caps_a_costlier_method_at_the_ratio_of_their_cpu_per_gb():
    raw = _row("raw_tcp", 0.25, 0.2, 0.2)  # 0.4 CPU-s/GB over 1 GB in 0.25 s: 1.6 of 2 cores busy
    line = cpu.ceiling(_row("fedrdma-e", 0.35, 0.3, 0.2), raw, 10**9, 2)
    assert "raw TCP 0.400 s (1.6 of 2 cores busy" in line and "fedrdma-e 0.500 s (1.25 x)" in line
    # 0.4 / 0.5 = 0.80 at raw TCP's CPU use; x 2 cores / 1.6 busy = 1.00 with both cores busy
    assert "about 0.80 x its throughput at the same CPU use and at most 1.00 x with all 2 cores busy" in line
    raw3 = _row("raw_tcp", 0.25, 0.15, 0.15)  # 1.2 of 2 cores: at the threshold
    assert "at most 1.00 x" in cpu.ceiling(_row("fedrdma-e", 0.5, 0.3, 0.2), raw3, 10**9, 2)


def test_an_idle_machine_is_not_called_cpu_bound_and_missing_cpu_gives_no_line():
    raw = _row("raw_tcp", 0.25, 0.2, 0.2)
    line = cpu.ceiling(_row("fedrdma-e", 0.35, 0.3, 0.2), raw, 10**9, 16)  # 1.6 of 16 cores
    assert "CPU is not what bounds" in line and "at most" not in line
    assert cpu.ceiling(_row("fedrdma-e", 0.35, None, 0.2), raw, 10**9, 2) is None
    assert cpu.ceiling({"method": "fedrdma-e", "seconds": 0.3}, raw, 10**9, 2) is None
    assert cpu.usable_cores() >= 1

