"""The LoRA sweep's settings (kept in OUT/sweep.json) and its results folder (OUT/results.jsonl): what both
the sweep (llm.sweep) and its report (llm.sweep_report) read."""
from __future__ import annotations

import datetime as dt
import json
import os
import platform
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence

DEFAULT_RANKS = (4, 8, 16, 32, 64, 128, 256, 512, 1024)


ROLES = ("guest", "host", "arbiter")


LINK = "loopback, one host (guest, host and arbiter on this machine)"


LOSS_KIND = ("training loss of each client: mean over the round's local steps (Trainer log, logging_strategy "
             "epoch), before the round's average is applied")


EMULATION = "soft provider = emulation (verbs over TCP), not RDMA"


#: the gpt2_lora_fedavg example's fate_rdma settings (examples/gpt2_lora_fedavg/fate_rdma.yaml), except the
#: threshold: 16 KiB sends every model-sized payload over the channel, even the tiny model's (FATE's
#: small control messages stay on its own path)
DEFAULT_SECTION: Dict[str, Any] = {
    "enabled": True, "mode": "fedrdma-e", "pool_slots": 2, "slot_bytes": 128 << 20, "too_large": "fedrdma",
    "chunk_bytes": 4 << 20, "window": "auto", "threshold_bytes": 16 << 10, "fallback": "error", "same_host": False,
}


@dataclass
class Settings:
    """What defines a sweep's figures; kept in OUT/sweep.json so that --resume runs the same."""
    ranks: List[int] = field(default_factory=lambda: list(DEFAULT_RANKS))
    model: str = "gpt2"
    rounds: int = 3
    steps_per_round: int = 2
    batch_size: int = 2
    seq_len: int = 48
    device: str = "cpu"
    threads: int = 1
    provider: str = "auto"
    also_fate: bool = False
    section: Dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_SECTION))

    def transports(self) -> List[str]:
        return ["fate-rdma"] + (["fate"] if self.also_fate else [])


#: settings that a resumed sweep must keep (its rows would not compare otherwise)
FIXED = ("model", "rounds", "steps_per_round", "batch_size", "seq_len", "device", "threads", "provider", "section")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        mem = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM"
    except (ValueError, OSError):
        mem = ""
    return f"{cpu}, {os.cpu_count()} cores{mem}, {platform.system()} {platform.release()}"


def utc_stamp(micro: bool = False) -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S" + (".%f" if micro else "") + "Z")


def read_rows(folder: str) -> List[Dict[str, Any]]:
    path = os.path.join(folder, "results.jsonl")
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut short by a killed sweep: the rank is re-run
                    print(f"sweep: {path}:{n} is not JSON (ignored)", file=sys.stderr)
    return rows


def append_rows(folder: str, rows: Iterable[Dict[str, Any]]) -> None:
    with open(os.path.join(folder, "results.jsonl"), "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        f.flush()
        os.fsync(f.fileno())


def latest_runs(rows: Sequence[Dict[str, Any]]) -> Dict[tuple, List[Dict[str, Any]]]:
    """Per (rank, transport): the rows of its last job, complete or failed."""
    last: Dict[tuple, str] = {}
    for r in rows:
        last[(r["rank"], r["transport"])] = r["run_id"]
    return {k: [r for r in rows if (r["rank"], r["transport"]) == k and r["run_id"] == run_id]
            for k, run_id in last.items()}


def complete(rows: Sequence[Dict[str, Any]], rounds: int) -> set:
    """(rank, transport) pairs whose last job recorded every round."""
    return {k for k, rs in latest_runs(rows).items()
            if sorted(r["round"] for r in rs if r["status"] == "ok") == list(range(1, rounds + 1))}


def read_meta(folder: str) -> Optional[Dict[str, Any]]:
    path = os.path.join(folder, "sweep.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)
