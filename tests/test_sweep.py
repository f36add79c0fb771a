"""`fate-rdma sweep lora` with a tiny GPT-2, two ranks, two rounds: real FATE-LLM FedAvg training through
FATE's launcher over fate-rdma (soft provider). One rank is made to fail: it is recorded with its error
and the next rank still runs; rows, table and plot are written; `--resume` then skips the complete rank
and tries the failed one again. One training job in all (about 50 s on 2 cores)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("fate_llm", reason="FATE-LLM is not installed; make test installs it")
pytest.importorskip("peft")
pytest.importorskip("matplotlib")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sweep(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fate_rdma.cli", "sweep", "lora", *args], capture_output=True,
                          text=True, timeout=400, cwd=ROOT)


def rows(folder) -> list:
    return [json.loads(line) for line in open(folder / "results.jsonl") if line.strip()]


@pytest.mark.timeout(600)
def test_sweep_records_rows_table_plot_survives_a_failed_rank_and_resumes(tmp_path):
    from fate_rdma.federation.hook import pth_path

    if not os.path.exists(pth_path()):
        pytest.skip("the start-up hook is not installed (make test runs `fate-rdma hook install`)")
    out = tmp_path / "sweep"
    # rank 2 first, made to fail (its job gets a bad argument and FATE's launcher refuses it); rank 4 runs
    p = sweep("--tiny", "--ranks", "2,4", "--rounds", "2", "--steps-per-round", "2", "--provider", "soft",
              "--out", str(out), "--fail-ranks", "2", "--timeout-s", "300")
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]  # a rank failed: recorded, exit 1
    first = rows(out)
    failed = [r for r in first if r["status"] == "failed"]
    assert [(r["rank"], r["transport"]) for r in failed] == [(2, "fate-rdma")]
    assert "exited with status 2" in failed[0]["error"] and "invalid int value" in failed[0]["error"]
    assert (out / failed[0]["log"]).exists()
    ok = [r for r in first if r["status"] == "ok"]
    assert [(r["rank"], r["round"]) for r in ok] == [(4, 1), (4, 2)]
    for r in ok:
        assert r["loss_guest"] > 0 and r["loss_host"] > 0 and r["loss"] == (r["loss_guest"] + r["loss_host"]) / 2
        assert r["comm_seconds"] > 0 and r["compute_seconds"] > 0 and r["round_seconds"] >= r["compute_seconds"]
        assert r["comm_seconds"] == min(r["comm_seconds_guest"], r["comm_seconds_host"])
        # tiny GPT-2: 2 layers x (lora_A 4 x 128 + lora_B 384 x 4); secure aggregation 16 B up, 8 B down
        assert r["trainable_params"] == 2 * (4 * 128 + 384 * 4)
        assert (r["up_bytes"], r["down_bytes"]) == (16 * r["trainable_params"], 8 * r["trainable_params"])
        assert r["channel_up_bytes"] >= r["up_bytes"] and r["channel_down_bytes"] >= r["down_bytes"]
        assert r["emulated"] and "emulated" in r["provider"] and "loopback" in r["link"] and r["machine"]
        assert r["device"] == "cpu" and r["clients_same_weights"] and min(r["peak_rss_bytes"].values()) > 0
    table = (out / "table.md").read_text()
    assert "| 4 | fate-rdma | 4,096 |" in table and "| 2 | fate-rdma | - | - | failed: " in table
    assert "emulation" in table and "loopback" in table
    png = (out / "lora_sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 200_000

    # resume: rank 4 is complete and skipped, rank 2 is tried again (made to fail again: one job in this test)
    p = sweep("--resume", str(out), "--timeout-s", "300", "--fail-ranks", "2")
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert "1 job(s) to run, 1 complete there (skipped: r=4 fate-rdma)" in p.stdout
    added = rows(out)[len(first):]
    assert [(r["rank"], r["status"]) for r in added] == [(2, "failed")] and added[0]["run_id"] != failed[0]["run_id"]


def test_sweep_table_takes_each_ranks_last_job(tmp_path):
    """A rank that failed and then completed on --resume shows its figures; a job cut short before its
    last round is not complete, so --resume runs it again."""
    from fate_rdma_lab.llm.sweep import Settings, complete, markdown, summary

    def ok(rank, rnd, run_id, loss):
        return {"rank": rank, "transport": "fate-rdma", "run_id": run_id, "status": "ok", "round": rnd,
                "trainable_params": 100 * rank, "up_bytes": 1600 * rank, "down_bytes": 800 * rank, "loss_guest": loss,
                "loss_host": loss + 0.1, "loss": loss + 0.05, "comm_seconds": 0.1 * rnd, "compute_seconds": 1.0 * rnd,
                "peak_rss_bytes": {"guest": 2**30, "host": 2**30, "arbiter": 2**29},
                "provider": "soft (emulated verbs, not RDMA)", "emulated": True, "device": "cpu", "loadavg_1m": 1.0}

    fail = {"rank": 8, "transport": "fate-rdma", "run_id": "a", "status": "failed", "round": None,
            "error": "the job overran --timeout-s 10 and was stopped"}
    rows = [fail, ok(8, 1, "b", 5.0), ok(8, 2, "b", 4.0), ok(4, 1, "c", 6.0)]
    s = Settings(ranks=[4, 8], rounds=2)
    assert complete(rows, 2) == {(8, "fate-rdma")}
    lines = {x["rank"]: x for x in summary(rows, s)}
    assert lines[8]["status"] == "ok" and lines[8]["loss_guest"] == 4.0 and lines[8]["comm_median_s"] == pytest.approx(0.15)
    assert lines[4]["rounds"] == 1  # shown as far as it went, and run again on --resume
    table = markdown(rows, s, str(tmp_path))
    assert "| 8 | fate-rdma | 800 | 0.01 MB / 0.01 MB | 4.0000 / 4.1000 | 0.150 | 1.500 | 1.00 / 0.50 GiB |" in table
    assert "failed" not in table and "emulation" in table


def test_sweep_resume_refuses_other_settings_and_an_unknown_folder(tmp_path):
    """Rows made with other rounds or models would not compare: --resume refuses them (exit 2), as it
    refuses a folder that holds no sweep."""
    from fate_rdma_lab.llm.sweep import Settings

    folder = tmp_path / "s"
    folder.mkdir()
    (folder / "sweep.json").write_text(json.dumps({"settings": {**Settings(ranks=[4]).__dict__, "model": "tiny"}}))
    p = sweep("--resume", str(folder), "--rounds", "5")
    assert p.returncode == 2 and "rounds differ from the sweep being resumed" in p.stderr, p.stderr
    p = sweep("--resume", str(tmp_path))
    assert p.returncode == 2 and "no sweep.json there" in p.stderr, p.stderr
