"""`fate-rdma bench fate`: how its rounds are timed and how its verdicts are drawn."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from fate_rdma_lab.bench import channel_alone
from fate_rdma_lab.bench.fate_job import START_LEAD_S, wait_until


def test_bench_fate_pairs_give_the_median_of_each_repetitions_ratio(capsys):
    """`bench fate --pairs N`: each target's ratio is the median of the repetitions' own ratios (not the ratio
    of the methods' medians), every repetition's ratio is printed and in the JSON line, a repetition missing
    a method counts for neither, and FATE's own rows (path "-") pair with fate-rdma's on either path."""
    from fate_rdma_lab.bench.fate_report import pair_ratios, verdicts

    def row(method, pair, seconds, path="tcp"):
        return {"method": method, "pair": pair, "round_comm_seconds": seconds, "path": "-" if method == "fate" else path,
                "payload": "gpt2-lora-r4", "scale": 1.0, "emulated": True}

    # FATE / fate-rdma per pair: 10, 5, 20 (median 10; the ratio of the medians is 1.0 / 0.1 = 10 too); fate-rdma /
    # the channel alone: 2.0, 1.0, 1.92 (median 1.92), where the ratio of the medians would be 0.1 / 0.05 = 2.0
    rows = [row("fate", 1, 1.0), row("fate-rdma", 1, 0.1), row("channel-alone", 1, 0.05),
            row("fate-rdma", 2, 0.2), row("channel-alone", 2, 0.2), row("fate", 2, 1.0),
            row("fate", 3, 1.0), row("fate-rdma", 3, 0.05), row("channel-alone", 3, 0.05 / 1.92),
            row("fate", 4, 9.9), row("fate-rdma", 4, 0.5, path="same-host")]  # pair 4: no tcp fate-rdma
    assert [round(r[0], 6) for r in pair_ratios(rows, "tcp", "fate", "fate-rdma")] == [10.0, 5.0, 20.0]
    assert [round(r[0], 6) for r in pair_ratios(rows, "same-host", "fate", "fate-rdma")] == [19.8]
    lines = verdicts(rows, "tcp")
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ratio, integ = out
    assert ratio["fate_over_fate_rdma"] == pytest.approx(10.0) and ratio["pairs"] == 3 and ratio["met"] is True
    assert ratio["per_pair"] == [10.0, 5.0, 20.0]
    assert integ["fate_rdma_over_channel_alone"] == pytest.approx(1.92) and integ["met"] is False
    assert "10.0x less (median of 3 pairs: 10.00, 5.00, 20.00) (target >= 8x: met)" in lines[0]
    assert "1.92x (median of 3 pairs: 2.00, 1.00, 1.92) (target <= 1.5x: NOT met)" in lines[1]
    assert all("[soft provider: emulated verbs, not an RDMA figure]" in line for line in lines)
    # one repetition: no "median of" (the output of a plain run is unchanged)
    single = verdicts([r for r in rows if r["pair"] == 1], "tcp")
    assert "10.0x less (target >= 8x: met)" in single[0] and "median of" not in single[1]


def test_bench_fate_conf_carries_buffer_puts_and_the_link_model_and_refuses_a_link_beside_fate(tmp_path, capsys):
    """--buffer-puts and --soft-link reach the parties' section (and the link the channel-alone baseline's
    fields); a link model with FATE's own path (unshaped), another path, or a bad spec exits 2 with the reason."""
    import argparse

    from fate_rdma_lab.bench import fate_federation as ff

    p = argparse.ArgumentParser()
    ff.add_arguments(p)
    args = p.parse_args(["--methods", "fate-rdma", "--soft-link", "rate=10gbit,rtt=20ms", "--buffer-puts", "false"])
    ff._conf(str(tmp_path / "c.json"), args, 1 << 20)
    sec = json.load(open(tmp_path / "c.json"))["fate_rdma"]
    assert sec["buffer_puts"] is False and sec["soft_link"] == "rate=10gbit,rtt=20ms"
    assert ff._channel_fields(args, 1 << 20, "tcp")["soft_link"] == "rate=10gbit,rtt=20ms"
    assert "soft_link" not in ff._channel_fields(p.parse_args([]), 1 << 20, "tcp")
    for argv, why in ((["--soft-link", "rtt=20ms"], "FATE's own path would run unshaped"),
                      (["--methods", "fate-rdma", "--soft-link", "rtt=20ms", "--path", "same-host"], "TCP path only"),
                      (["--methods", "fate-rdma", "--soft-link", "rate=fast"], "bad rate")):
        assert ff.run(p.parse_args(argv)) == 2
        assert why in capsys.readouterr().err


def test_wait_until_sleeps_to_the_instant_and_reports_lateness():
    start = time.monotonic() + 0.05
    assert wait_until(start) == start and time.monotonic() >= start
    late = time.monotonic() - 0.2
    t = time.monotonic()
    assert t <= wait_until(late) <= time.monotonic()  # learned of it late: starts now, does not sleep


def test_the_arrays_baseline_splits_the_integration_from_the_payloads_shape(capsys):
    """--channel-alone-arrays: fate-rdma / the arrays baseline (the integration's own cost) and the arrays
    baseline / the one-buffer one (the payload's memory and shape), medians of the pairs' own ratios, with
    no target; the target's verdict stays against the one buffer."""
    from fate_rdma_lab.bench.fate_report import verdicts

    def row(method, pair, seconds):
        return {"method": method, "pair": pair, "round_comm_seconds": seconds, "path": "same-host", "tensors": 148,
                "payload": "gpt2-full", "scale": 0.25, "emulated": True}

    rows = [row("fate-rdma", 1, 0.30), row("channel-alone", 1, 0.15), row("channel-alone-arrays", 1, 0.25),
            row("fate-rdma", 2, 0.26), row("channel-alone", 2, 0.20), row("channel-alone-arrays", 2, 0.20),
            row("fate-rdma", 3, 0.27), row("channel-alone", 3, 0.16), row("channel-alone-arrays", 3, 0.24)]
    lines = verdicts(rows, "same-host")
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    integ, deco = out
    assert integ["fate_rdma_over_channel_alone"] == pytest.approx(1.6875) and integ["met"] is False
    # fate-rdma / arrays: 1.2, 1.3, 1.125 -> 1.2; arrays / one buffer: 5/3, 1.0, 1.5 -> 1.5
    assert deco["fate_rdma_over_channel_alone_arrays"] == pytest.approx(1.2)
    assert deco["channel_alone_arrays_over_channel_alone"] == pytest.approx(1.5)
    assert deco["summary"] == "decomposition" and "target" not in deco and deco["tensors"] == 148
    assert deco["per_pair_fate_rdma_over_arrays"] == [1.2, 1.3, 1.125] and deco["emulated"] is True
    assert [round(x, 4) for x in deco["per_pair_arrays_over_channel_alone"]] == [1.6667, 1.0, 1.5]
    assert "(148 private arrays each way) 0.24 s: fate-rdma's round is 1.20x that" in lines[1]
    assert "1.50x the one-buffer baseline" in lines[1] and "not an RDMA figure" in lines[1]
    assert len(verdicts([r for r in rows if r["method"] != "channel-alone-arrays"], "same-host")) == 1


def test_channel_alone_sends_private_arrays_of_the_given_sizes():
    """The arrays baseline moves the same bytes as private arrays; sizes that do not add up are refused."""
    from fate_rdma_lab.bench.fate_federation import payload_pieces

    up, down = payload_pieces(0.25, 0)
    assert len(up) == len(down) == 148 and all(u == 2 * d for u, d in zip(up, down))
    arrays = channel_alone._payload(96 << 10, [64 << 10, 32 << 10], False, 1)
    assert [(a.dtype.name, a.nbytes, int(a[0]), int(a[-1])) for a in arrays] == [("uint8", 64 << 10, 1, 1),
                                                                               ("uint8", 32 << 10, 1, 1)]
    assert channel_alone._payload(96 << 10, None, False, 7).nbytes == 96 << 10
    got = channel_alone.measure({"mode": "fedrdma-e", "provider": "soft", "window": "auto"}, 96 << 10, 48 << 10,
                                rounds=2, timeout=60, pieces=([64 << 10, 32 << 10], [32 << 10, 16 << 10]))
    assert len(got["round_seconds_all"]) == 2
    with pytest.raises(ValueError, match="pieces sum to"):
        channel_alone.measure({}, 96 << 10, 48 << 10, pieces=([64 << 10], [48 << 10]))


def test_the_arrays_baseline_without_the_first_is_refused(capsys):
    import argparse

    from fate_rdma_lab.bench import fate_federation

    p = argparse.ArgumentParser()
    fate_federation.add_arguments(p)
    assert fate_federation.run(p.parse_args(["--no-channel-alone", "--channel-alone-arrays"])) == 2
    assert "cannot go with --no-channel-alone" in capsys.readouterr().err


def test_channel_alone_rounds_run_from_the_named_instant_not_before_it():
    """Each round is timed from the instant the arbiter names (START_LEAD_S ahead), so the lead is not in it:
    a round of 64 KiB up / 32 KiB down takes milliseconds, far less than the lead."""
    got = channel_alone.measure({"mode": "fedrdma-e", "provider": "soft", "window": "auto"}, 64 << 10, 32 << 10,
                                rounds=3, timeout=60)
    assert len(got["round_seconds_all"]) == 3
    assert 0 < got["round_seconds"] < START_LEAD_S / 3
    assert got["start_late_seconds"] == 0.0  # a multiprocessing barrier passes well within the lead here


def test_channel_alone_fails_at_once_when_a_party_exits_without_a_result():
    """A party process that dies without reporting (killed, or crashed before its own error handler) fails
    the measurement within seconds, naming the party, instead of the parent waiting out the whole
    deadline (hours: the job timeout times the rounds) on a queue nobody will write to."""
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=os._exit, args=(3,), name="channel-alone-guest", daemon=True)]
    procs[0].start()
    t0 = time.monotonic()
    errors = channel_alone._collect(procs, results, {}, [], time.monotonic() + 600)
    procs[0].join()
    assert errors == ["channel-alone-guest exited with code 3 without a result"]
    assert time.monotonic() - t0 < 30


@pytest.mark.timeout(300)
def test_fate_job_rounds_start_at_the_arbiters_instant(tmp_path):
    """The FATE job (FATE's launcher, fate-rdma on): both clients start each round at the instant the arbiter
    names; once connected (every round after the first) the start message arrives within the lead, the
    rounds exclude the lead, and the average checks out."""
    pytest.importorskip("fate.arch")
    p = subprocess.run([sys.executable, "-m", "fate_rdma.cli", "bench", "fate", "--lora-ranks", "4", "--rounds", "3",
                        "--methods", "fate-rdma", "--mode", "fedrdma-e", "--no-channel-alone", "--timeout", "240",
                        "--buffer-puts", "true",
                        "--keep", str(tmp_path)], capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (row,) = [json.loads(line) for line in p.stdout.splitlines() if line.startswith('{"bench": "fate", "payload"')]
    assert row["verified"] is True and row["lora_rank"] == 4 and row["rounds"] == 3 and row["buffer_puts"] == "true"
    assert all(0 < s < START_LEAD_S for s in row["round_comm_seconds_all"])
    arbiter = json.load(open(os.path.join(tmp_path, "fate-rdma-s1-r4", "arbiter.json")))
    for role in ("guest", "host"):
        res = json.load(open(os.path.join(tmp_path, "fate-rdma-s1-r4", f"{role}.json")))
        # each round less its own summing time (it comes with the next round's start message, the last one after)
        assert res["aggregate_seconds"] == arbiter["aggregate_seconds"] and len(res["comm_seconds"]) == 3
        assert len(res["go_late_seconds"]) == 3 and res["go_late_seconds"][1:] == [0.0, 0.0]
        # (--buffer-puts true) the first round's put copy is faulted in fresh, the later rounds' land in a recycled buffer
        assert res["put_copies"]["fresh_bytes"] > 0 and res["put_copies"]["reused_bytes"] > 0, res["put_copies"]


def test_a_same_host_path_switched_off_is_refused_not_mislabelled(monkeypatch, capsys):
    """`--path same-host` under EASYPYVERBS_SOFT_SAME_HOST=off would print rows named same-host that ran over TCP."""
    import argparse

    from fate_rdma_lab.bench import fate_federation

    monkeypatch.setenv("EASYPYVERBS_SOFT_SAME_HOST", "off")
    p = argparse.ArgumentParser()
    fate_federation.add_arguments(p)
    for path in ("same-host", "both"):
        assert fate_federation.run(p.parse_args(["--quick", "--path", path])) == 2
        err = capsys.readouterr().err
        assert "same-host path, not available here: switched off by EASYPYVERBS_SOFT_SAME_HOST" in err
        assert ("--path tcp measures" in err) == (path == "both")
