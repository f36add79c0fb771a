"""WAN testbed smoke test (issue 14): real namespaces, a shaped link, bytes through fate-rdma and TCP, nothing left.

Needs root, iproute2, nftables (loss), a C compiler and /dev/net/tun (delay); skips with the reason
otherwise. About 30 s: the link is 50 Mbit/s with 10 ms RTT, 0.1 % loss and 0.5 % reordering.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fate_rdma_lab.testbed import bed as wan
from fate_rdma.cli import main as cli_main
from fate_rdma_lab.testbed.run import SiteProcess, check_transfer, link_rx_bytes, measure

RATE_BPS = 50_000_000
LINK = wan.LinkSpec(rate_bps=RATE_BPS, delay_ms=5.0, loss_pct=0.1, reorder_pct=0.5, reorder_gap_ms=2.0)
PAYLOAD_BYTES = 4 << 20


def _skip_reason() -> str:
    return wan.spec_problem(wan.Testbed(links=(LINK, LINK))) or wan.namespace_problem() or ""


@pytest.fixture(scope="module")
def can_build() -> None:
    reason = _skip_reason()
    if reason:
        pytest.skip(f"WAN testbed cannot be built here: {reason}")


@pytest.fixture
def prefix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("FATE_RDMA_WAN_STATE", str(tmp_path / "state"))
    return f"frwt{os.getpid() % 100000}"


def _host_snapshot() -> dict:
    """What the testbed must never touch or leave behind in the host namespace."""
    def out(argv: list) -> str:
        return subprocess.run(argv, capture_output=True, text=True, timeout=20).stdout

    return {"links": out(["ip", "-o", "link", "show"]).count("\n"), "qdiscs": out(["tc", "qdisc", "show"]),
            "rules": out(["ip", "rule", "show"]), "nft": out(["nft", "list", "ruleset"]) if shutil.which("nft") else ""}


def _our_processes(prefix: str) -> list:
    """Live processes that belong to this test's testbed: the helper, or wan_probe children of this process."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if f"{prefix}-delay" in cmd or (ppid == os.getpid() and "wan_probe" in cmd):
            found.append(f"{p.name}: {cmd}")
    return found


@pytest.mark.timeout(120)
def test_wan_smoke(can_build: None, prefix: str, capsys: pytest.CaptureFixture) -> None:
    tb = wan.Testbed(links=(LINK, LINK), prefix=prefix)
    before = _host_snapshot()
    try:
        state = wan.up(tb, measure_seconds=1.0, measure=measure)
        m = state["measured"]
        print(f"\n{m['rtt']} tcp {wan.fmt_rate(m['tcp']['bps'])}\n{m['note']}")
        # the delay helper holds each packet 5 ms per direction: no RTT below 10 ms can cross it
        assert m["rtt"]["probes"] - m["rtt"]["lost"] >= 5, m
        assert 9.5 <= m["rtt"]["min_ms"] < 500, m
        assert m["tcp"]["ok"], m
        # tbf at 50 Mbit/s: a correctness bound (the shaper is in place), not a speed target
        assert m["tcp"]["bps"] <= RATE_BPS * 1.15, m
        assert "scaled rate 50 Mbit/s" in m["note"] and "cannot be reproduced on 2 cores" in m["note"]

        st = wan.status(prefix)
        assert list(st["namespaces"]) == [tb.router, tb.site_ns(0), tb.site_ns(1)]
        assert sum(len(i["qdiscs"]) for i in st["namespaces"].values()) == 4  # each link, both directions
        assert "numgen random mod 1000000 < 1000" in st["namespaces"][tb.router]["nft"]
        assert st["helper"]["alive"], st

        res = check_transfer(tb, PAYLOAD_BYTES, timeout_s=60)
        print(res)
        assert res["channel"]["ok"] and res["channel"]["crc32c"] == res["channel"]["received_crc32c"]
        assert res["tcp"]["ok"] and res["tcp"]["crc32c"] == res["tcp"]["received_crc32c"]
        assert res["channel"]["link_bytes"] >= PAYLOAD_BYTES and res["tcp"]["link_bytes"] >= PAYLOAD_BYTES
        assert "emulated" in res["channel"]["label"]
        # a failing in-site process is an error that names it, not a hang
        with pytest.raises(wan.WanError, match="tcp-send: ConnectionRefusedError"):
            with SiteProcess(tb, 0, ["tcp-send", "--to", f"{tb.site_addr(1)}:9", "--bytes", "1"]) as proc:
                proc.line(30)

        # loss and reordering happened, per packet: each drop is one MTU frame, not a 64 KB TSO burst
        st = wan.status(prefix)
        drops = re.search(r'saddr 198\.18\.1\.0/24 .* packets (\d+) bytes (\d+) drop', st["namespaces"][tb.router]["nft"])
        assert drops, st["namespaces"][tb.router]["nft"]
        if int(drops.group(1)):
            assert int(drops.group(2)) / int(drops.group(1)) <= 1514, drops.group(0)
        assert st["helper"]["stats"]["reordered"] > 0 and st["helper"]["stats"]["overflow"] == 0, st["helper"]

        # up twice: reshapes in place, a process inside a site survives, the new shape applies
        sleeper = subprocess.Popen(wan.in_ns(tb.site_ns(0), ["sleep", "60"]))
        try:
            counted = link_rx_bytes(tb, 0)
            wan.up(wan.Testbed(links=(LINK, wan.LinkSpec(rate_bps=20_000_000, delay_ms=5.0)), prefix=prefix),
                   measure_seconds=-1)
            assert sleeper.poll() is None, "reshaping killed a process inside a site"
            assert link_rx_bytes(tb, 0) >= counted, "reshaping recreated the link"
            st = wan.status(prefix)
            assert any("rate 20Mbit" in q for q in st["namespaces"][tb.site_ns(1)]["qdiscs"]), st
            assert st["helper"]["alive"] and st["helper"]["pid"] != state["helper_pid"]
        finally:
            sleeper.kill()
            sleeper.wait()
    finally:
        removed = wan.down(prefix)
    assert removed, "down found nothing to remove"
    assert wan.leftovers(prefix) == []
    assert not [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                          timeout=20).stdout.split() if n.startswith(prefix)]
    assert _our_processes(prefix) == []
    assert _host_snapshot() == before, "the host namespace changed (links, qdiscs, rules or nft)"


@pytest.mark.timeout(60)
def test_failed_up_removes_everything(can_build: None, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> Path:
        raise wan.WanError("compiler exploded (injected)")

    monkeypatch.setattr(wan, "build_helper", broken)
    with pytest.raises(wan.WanError, match="injected"):
        wan.up(wan.Testbed(links=(LINK, LINK), prefix=prefix), measure_seconds=-1)
    assert wan.leftovers(prefix) == []
    assert wan.existing_namespaces(prefix) == []


def test_tcp_cc_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(wan.WanError, match="must name a congestion control"):
        wan.Testbed(links=(LINK, LINK), tcp_cc="cubic; rm")
    assert wan.Testbed.from_dict(wan.Testbed(links=(LINK, LINK), tcp_cc="cubic").to_dict()).tcp_cc == "cubic"
    monkeypatch.setattr(wan, "sh", lambda *a, **k: pytest.fail("nothing runs for a refused setting"))
    with pytest.raises(wan.WanError, match="'nosuchcc' is not allowed here"):
        wan._set_tcp_cc("frx-a", "nosuchcc")
    available = Path("/proc/sys/net/ipv4/tcp_available_congestion_control").read_text().split()
    allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split()
    for cc in set(available) - set(allowed):  # loaded but not allowed: the message says how to allow it
        with pytest.raises(wan.WanError, match=f"allow it on the host: sysctl -w net.ipv4.tcp_allowed_congestion_control=.*{cc}"):
            wan._set_tcp_cc("frx-a", cc)


def test_cli_usage_errors(capsys: pytest.CaptureFixture) -> None:
    # no root needed: rejected before anything is made
    assert cli_main(["wan", "up", "--link", "z:rate_mbit=5"]) == 2
    assert "SITE" in capsys.readouterr().err
    assert cli_main(["wan", "up", "--link", "a:speed=5"]) == 2
    assert "unknown key 'speed'" in capsys.readouterr().err
    assert cli_main(["wan", "up", "--loss-pct", "100"]) == 2
    assert cli_main(["wan", "up", "--prefix", "Bad_Name"]) == 2
    with pytest.raises(SystemExit) as ex:
        cli_main(["wan", "--help"])
    assert ex.value.code == 0
    assert "netem is not in this kernel" in capsys.readouterr().out


def test_helper_compiles_without_warnings(tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler (apt-get install gcc): the delay helper is compiled at `wan up`")
    out = subprocess.run([cc, "-O2", "-std=gnu99", "-Wall", "-Wextra", "-Werror", "-o", str(tmp_path / "h"),
                          str(wan.helper_source())], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    usage = subprocess.run([str(tmp_path / "h"), "--rule", "bad"], capture_output=True, text=True, timeout=10)
    assert usage.returncode == 2 and "bad --rule" in usage.stderr


def test_not_root_is_a_clear_refusal(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    for action in (["up"], ["down"], ["status"], ["check"]):
        assert cli_main(["wan", *action]) == 3
        assert "needs root" in capsys.readouterr().err


def _rows(root: Path) -> list:
    (run,) = list(root.iterdir())
    return [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]


def _png(path: Path) -> None:
    if importlib.util.find_spec("matplotlib"):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path


@pytest.mark.timeout(240)
def test_eval_link_quick(can_build: None, prefix: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Every link study on one shaped link (one testbed): each transport verified, written, removed."""
    rc = cli_main(["eval", "link", "--study", "chunks,qps,link-enable,window", "--links", "50:10:0", "--chunks", "65536",
                   "--qps", "2", "--windows", "2", "--modes", "fedrdma-e", "--bytes", str(2 << 20), "--reps", "1",
                   "--out", str(tmp_path / "eval"), "--prefix", prefix])
    out = capsys.readouterr()
    assert rc == 0, out.err
    rows = _rows(tmp_path / "eval")
    chunks = [r for r in rows if r["study"] == "chunks"]
    assert [r["transport"] for r in chunks] == ["tcp stream", "grpc stream", "fedrdma w=1", "fedrdma auto",
                                                "fedrdma-e w=1", "fedrdma-e auto", "mooncake sync", "mooncake batch"]
    for r in rows:
        if r["kind"] == "mooncake" and r["skipped"]:  # the extra is absent: the row says how to install it
            assert "pip install -e './lab[mooncake]'" in r["skipped"]
            continue
        assert r["verified"] and r["median_s"] > 0 and r["bytes"] == 2 << 20 and r["link_bytes"] >= 2 << 20, r
        assert "scaled rate 50 Mbit/s" in r["note"] and r["measured"]["rtt_median_ms"] >= 9.5, r
    assert [r["window_used"] for r in chunks if r["window"] == "1"] == [[1], [1]]
    qps = [r for r in rows if r["study"] == "qps"]
    assert [(r["kind"], r["qps_per_peer"]) for r in qps] == [("tcp", None), ("channel", 2)]
    le = [r for r in rows if r["study"] == "link-enable"]
    assert [(r["window"], r["link_enable"], r["window_used"]) for r in le] == [
        ("2", x, [2]) for x in ("false", "true", "auto")]
    assert [(r["window"], r["window_used"]) for r in rows if r["study"] == "window"] == [("2", [2])]
    (run,) = list((tmp_path / "eval").iterdir())
    assert run.name.endswith("-link-chunks+qps+link-enable+window")
    table = (run / "table.md").read_text()
    assert "| fedrdma-e auto | soft (emulated verbs over TCP, not RDMA) | 64 KiB | 1.05 |" in table
    assert "cannot be reproduced on 2 cores" in table and "Best window for fedrdma-e: **2**" in table
    assert "Best: qps_per_peer=2" in table and "## study: link-enable" in table
    from fate_rdma import __version__
    from fate_rdma.config import ChannelConfig
    code = next(line for line in table.splitlines() if line.startswith("- code: "))
    assert f"fate-rdma {__version__} (" in code and f"checksum: {ChannelConfig().checksum} (the default)" in code
    import fate_rdma
    assert ("commit " in code) == (Path(fate_rdma.__file__).resolve().parents[1] / ".git").exists(), code
    for study in ("chunks", "qps", "link_enable", "window"):
        _png(run / f"link_{study}.png")
    assert wan.leftovers(prefix) == [] and _our_processes(prefix) == []


@pytest.mark.timeout(240)
def test_eval_stress_fairness_quick(can_build: None, prefix: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """stress (1 % loss, then a CPU stress) and fairness (3 clients at once), tiny: rows verified, nothing left."""
    rc = cli_main(["eval", "stress", "--quick", "--losses", "1", "--cpu-burners", "1", "--bytes", str(1 << 20),
                   "--out", str(tmp_path / "stress"), "--prefix", prefix])
    out = capsys.readouterr()
    assert rc == 0, out.err
    rows = _rows(tmp_path / "stress")
    assert [(r["loss_pct"], r["cpu_burners"], r["transport"]) for r in rows] == [
        (l, b, t) for l, b in ((1.0, 0), (0.0, 1)) for t in ("tcp stream", "fedrdma auto", "fedrdma-e auto")]
    assert all(r["verified"] and r["transfers_ok"] == r["transfers"] == 1 and r["received_bytes"] == 1 << 20
               and r["failures"] == [] for r in rows), rows
    assert "Nothing lost or corrupted" in out.out and "CPU stress (1 busy process in site a)" in out.out
    (run,) = list((tmp_path / "stress").iterdir())
    _png(run / "stress.png")
    assert wan.leftovers(prefix) == [] and _our_processes(prefix) == []

    # a congestion control other than the host's default, among those a namespace may pick
    default = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split()
    cc = next((c for c in allowed if c != default), default)
    rc = cli_main(["eval", "fairness", "--quick", "--bytes", str(1 << 20), "--out", str(tmp_path / "fair"),
                   "--prefix", prefix, "--tcp-cc", cc])
    out = capsys.readouterr()
    assert rc == 0, out.err
    rows = _rows(tmp_path / "fair")
    clients = [r for r in rows if r["row"] == "client"]
    assert [(r["transport"], r["client"], r["site"]) for r in clients] == [
        (t, i, s) for t in ("tcp stream", "tcp kept", "fedrdma-e auto, 1 QP", "fedrdma-e auto, qps auto")
        for i, s in ((1, "b"), (2, "c"), (3, "c"))]
    assert all(r["verified"] and r["received_bytes"] == 1 << 20 and r["median_s"] > 0 for r in clients), clients
    # qps_per_peer auto stripes over its four QPs on this 10 ms path; the other row keeps one
    assert [r["qps_used"] for r in clients if r["transport"].startswith("fedrdma")] == [[1]] * 3 + [[4]] * 3, clients
    summary = [r for r in rows if r["row"] == "summary"]
    assert len(summary) == 4 and all(r["median_gap"] >= 0 and 0 < r["median_jain"] <= 1.0001 for r in summary)
    assert "clients 2 and 3 share site c" in out.out
    assert all(r["measured"]["tcp_cc"] == cc for r in rows), rows  # the sites run the one asked for
    (run,) = list((tmp_path / "fair").iterdir())
    _png(run / "fairness.png")
    assert wan.leftovers(prefix) == [] and _our_processes(prefix) == []


@pytest.mark.timeout(240)
def test_eval_faults_quick(can_build: None, prefix: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """faults, tiny: a blackhole, resets, the receiver stopped and loss bursts, each after a baseline; every
    transfer delivered once, verified, nothing held or left (the resumes themselves: test_resume_wan.py)."""
    rc = cli_main(["eval", "faults", "--quick", "--count", "6", "--max-bytes", str(1 << 20), "--drops", "1",
                   "--reset-s", "1", "--pause-s", "1", "--out", str(tmp_path / "faults"), "--prefix", prefix])
    out = capsys.readouterr()
    assert rc == 0, out.err
    rows = _rows(tmp_path / "faults")
    assert [r["condition"] for r in rows] == ["none (baseline)", "drop 1 s", "reset 1 s", "pause 1 s",
                                              "loss 5 % bursts (3 x 2 s)"]
    assert all(r["verified"] and r["delivered"] == 6 and not r["twice"] and not r["corrupted"] for r in rows), rows
    assert all(r["baseline_s"] == rows[0]["elapsed_s"] for r in rows)
    assert "Nothing lost, nothing delivered twice" in out.out
    (run,) = list((tmp_path / "faults").iterdir())
    _png(run / "faults.png")
    assert wan.leftovers(prefix) == [] and _our_processes(prefix) == []


@pytest.mark.timeout(120)
def test_eval_cost_quick(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Table 4 on loopback (no root): every method's time, memory and CPU, the paper's figures beside."""
    rc = cli_main(["eval", "cost", "--quick", "--payload-mib", "4", "--out", str(tmp_path / "cost")])
    out = capsys.readouterr()
    assert rc == 0, out.err
    rows = _rows(tmp_path / "cost")
    assert [r["method"] for r in rows] == ["tcp stream", "grpc stream", "fedrdma", "fedrdma-e", "mooncake sync"]
    for r in rows:
        if r["method"].startswith("mooncake") and r["skipped"]:
            assert "pip install -e './lab[mooncake]'" in r["skipped"]
            continue
        assert r["median_s"] > 0 and r["verified"] and r["extra_rss_bytes"] is not None, r
        assert r["cpu_send_s"] >= 0 and r["cpu_recv_s"] >= 0 and r["link"] == "loopback", r
    assert "the paper's Table 4" in out.out and "| FedRDMA-E | 0.025 MB | 6 s |" in out.out
    (run,) = list((tmp_path / "cost").iterdir())
    _png(run / "cost.png")


def test_eval_usage_errors(capsys: pytest.CaptureFixture) -> None:
    # rejected before anything is made (no root needed)
    assert cli_main(["eval", "link", "--study", "speed"]) == 2
    assert "unknown speed" in capsys.readouterr().err
    assert cli_main(["eval", "link", "--qps", "0"]) == 2
    assert cli_main(["eval", "stress", "--losses", "100"]) == 2
    assert cli_main(["eval", "cost", "--paths", "rdma"]) == 2
    assert cli_main(["eval", "faults", "--count", "1"]) == 2
    with pytest.raises(SystemExit) as ex:
        cli_main(["eval", "link", "--help"])
    assert ex.value.code == 0
    assert "link-enable" in capsys.readouterr().out


@pytest.mark.timeout(150)
def test_eval_fate_quick(can_build: None, prefix: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """FATE's own path (OSX engine through the project's queue) beside fate-rdma fedrdma-e, three sites, one
    tiny FedAvg round (GPT-2 LoRA r=4): both verified by the job's checks, the payload on each method's path."""
    pytest.importorskip("fate.arch.federation.backends.osx.osx_pb2_grpc", reason="FATE's OSX engine is not installed")
    assert cli_main(["eval", "fate", "--methods", "fedrdma"]) == 2  # FATE's own path is the reference
    assert "--methods" in capsys.readouterr().err
    rc = cli_main(["eval", "fate", "--quick", "--methods", "fate,fedrdma-e", "--out", str(tmp_path / "fate"),
                   "--prefix", prefix])
    out = capsys.readouterr()
    assert rc == 0, out.err
    rows = _rows(tmp_path / "fate")
    runs = [r for r in rows if r.get("row") != "ratio"]
    assert [r["method"] for r in runs] == ["fate", "fedrdma-e"]
    up, down = runs[0]["up_bytes"], runs[0]["down_bytes"]
    assert up == 2 * down > 2 << 20  # LoRA r=4: 147,456 parameters, 16 B each up
    for r in runs:
        assert r["verified"] and r["failures"] == [] and r["rounds"] == 1 and r["round_comm_seconds"] > 0, r
        assert r["link_bytes_total"] >= 2 * (up + down), r  # both clients' payloads crossed the shaped links
        assert r["sites"] == {"arbiter": "a", "guest": "b", "host": "c"} and r["queue_site"] == "a"
        assert all(v > 100 << 20 for v in r["peak_rss_bytes"].values()), r
        assert "scaled rate 50 Mbit/s" in r["note"] and r["measured"]["rtt_median_ms"] >= 9.5, r
    fate, rdma = runs
    assert fate["queue"]["pushed_bytes"] >= 2 * (up + down) and fate["rdma"] is None
    assert rdma["queue"]["pushed_bytes"] < 256 << 10 and rdma["emulated"]  # only descriptors through the queue
    # 2 uploads and 2 downloads in the round, as many in the untimed warm-up exchange
    assert sum(s["rdma_transfers"] for s in rdma["rdma"].values()) == 8
    (ratio,) = [r for r in rows if r.get("row") == "ratio"]
    assert ratio["method"] == "fedrdma-e" and ratio["fate_over_fate_rdma"] > 0
    table = _fate_table(tmp_path / "fate", "fate_path.png", prefix)
    assert "arbiter in a" in table and "| fedrdma-e |" in table


def _fate_table(root: Path, png: str, prefix: str) -> str:
    """An eval fate run's table.md, once its labels, its plot and that nothing is left behind are checked."""
    (run,) = list(root.iterdir())
    table = (run / "table.md").read_text()
    assert "not a real OSX/rollsite deployment" in table and "soft provider = emulation" in table
    _png(run / png)
    assert wan.leftovers(prefix) == [] and _our_processes(prefix) == []
    assert not [c for c in _children() if "eval_fate_party" in c or "osx_queue" in c]
    return table


@pytest.mark.timeout(150)
def test_eval_fate_train_quick(can_build: None, prefix: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--job train: real FedAvg training with FATE-LLM (tiny GPT-2, LoRA r=4, 1 round x 1 step) in the three sites,
    FATE's own path and fedrdma-e: compute and comm per round, the same final weights with both, nothing left."""
    pytest.importorskip("fate.arch.federation.backends.osx.osx_pb2_grpc", reason="FATE's OSX engine is not installed")
    pytest.importorskip("fate_llm", reason="FATE-LLM is not installed")
    assert cli_main(["eval", "fate", "--job", "train", "--lora-rank", "0"]) == 2  # LoRA only through the sites
    assert cli_main(["eval", "fate", "--model", "tiny"]) == 2  # --model belongs to --job train
    assert cli_main(["eval", "fate", "--device", "cuda"]) == 2  # and --device: the payload job trains nothing
    capsys.readouterr()
    rc = cli_main(["eval", "fate", "--job", "train", "--quick", "--model", "tiny", "--rounds", "1", "--steps-per-round",
                   "1", "--methods", "fate,fedrdma-e", "--device", "cpu", "--out", str(tmp_path / "train"),
                   "--prefix", prefix])
    out = capsys.readouterr()
    assert rc == 0, out.err
    rows = _rows(tmp_path / "train")
    assert [(r["method"], r["row"]) for r in rows] == [("fate", "round"), ("fate", "median"),
                                                       ("fedrdma-e", "round"), ("fedrdma-e", "median")]
    for r in rows:
        assert r["compute_seconds"] > 0 and r["comm_seconds"] > 0 and r["loss_guest"] > 0, r
        assert r["verified"] and r["model"] == "tiny" and r["device"] == "cpu" and r["measured"]["rtt_median_ms"] >= 9.5, r
    fate, rdma = [r for r in rows if r["row"] == "median"]
    assert fate["sha256"] == rdma["sha256"] and rdma["same_weights_as_fate"], "FedAvg must train the same either way"
    assert fate["queue"]["pushed_bytes"] >= 2 * (fate["up_bytes"] + fate["down_bytes"]) and fate["rdma"] is None
    assert rdma["emulated"] and sum(s["rdma_transfers"] for s in rdma["rdma"].values()) == 8  # round + warm-up
    assert all(v > 100 << 20 for v in rdma["peak_rss_bytes"].values()), rdma
    table = _fate_table(tmp_path / "train", "fate_train_rounds.png", prefix)
    assert "| **fedrdma-e** | **median** |" in table and "scaled rate 50 Mbit/s" in table


def _children() -> list:
    """Command lines of this process's live children."""
    found = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                found.append((p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except (OSError, ValueError, IndexError):
            continue
    return found


def test_eval_link_takes_tcp_cc(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`eval link --tcp-cc` reaches the plan and the testbed run_eval builds (the host's default without it)."""
    import argparse

    from fate_rdma_lab.eval import links as wan_eval
    from fate_rdma_lab.cli import eval as eval_cli

    p = argparse.ArgumentParser()
    eval_cli.add_arguments(p)
    _, plan, _ = eval_cli._plan(p.parse_args(["link", "--study", "qps", "--tcp-cc", "cubic"]))
    assert plan.tcp_cc == "cubic"
    _, default, _ = eval_cli._plan(p.parse_args(["link", "--study", "qps"]))
    assert default.tcp_cc is None  # the host's default

    built = []

    class Stop(Exception):
        pass

    def testbed(tb, *a, **k):  # the testbed run_eval asks for; nothing is built
        built.append(tb)
        raise Stop

    monkeypatch.setattr(wan_eval, "testbed", testbed)
    with pytest.raises(Stop):
        wan_eval.run_eval(plan, tmp_path, prefix="frx")
    assert [tb.tcp_cc for tb in built] == ["cubic"]
