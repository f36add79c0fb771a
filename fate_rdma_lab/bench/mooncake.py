"""Mooncake Transfer Engine as a method of `fate-rdma bench transfer` (the optional `mooncake` extra).

Two processes of their own (mooncake_peer.py): the sender's engine WRITEs the payload into the
receiver's registered buffer over Mooncake's TCP transport, P2PHANDSHAKE metadata. `mooncake`: one
transfer_sync_write of the whole payload; `mooncake_batch`: one batch_transfer_async_write of
`chunk_bytes` pieces (the channel's chunk size), waited for with get_batch_transfer_status. Seconds
are the sender's, from the call until Mooncake reports the write complete; then (untimed) the
receiver's crc32c of its buffer must equal the payload's, and the buffer is overwritten before the
next repetition. Mooncake checksums nothing itself: fate-rdma's rows include their end-to-end
checksum, these do not.
"""
from __future__ import annotations

import glob
import importlib.util
import os
from typing import Any, Dict, List, Optional

from fate_rdma_lab.bench.cpu import per_gb
from fate_rdma_lab.bench.driver import PeerProcess
from fate_rdma_lab.bench.report import median

METHODS = {"mooncake": "sync", "mooncake_batch": "batch"}
INSTALL = "pip install -e './lab[mooncake]' (PyPI mooncake-transfer-engine-non-cuda; Linux x86_64, Python >= 3.10)"


def missing() -> Optional[str]:
    """Why the Mooncake rows cannot run here, or None. Checked without importing it in this process
    (its package imports the 17 MB store extension): only the peers load it."""
    try:
        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if any(glob.glob(os.path.join(f, "engine*.so")) or os.path.exists(os.path.join(f, "engine.py")) for f in folders):
        return None
    return f"Mooncake Transfer Engine is not installed: {INSTALL}"


def measure(methods: List[str], host: str, nbytes: int, seed: int, expected_crc: int, reps: int,
            chunk_bytes: int) -> Dict[str, Dict[str, Any]]:
    """{method: row fields} for each Mooncake method asked for; a method that cannot run has "skipped"."""
    wanted = [m for m in METHODS if m in methods]
    if not wanted:
        return {}
    why = missing()
    if why:
        return {m: {"skipped": why} for m in wanted}
    out: Dict[str, Dict[str, Any]] = {}
    with PeerProcess(host, module="fate_rdma_lab.bench.mooncake_peer") as recv, \
            PeerProcess(host, module="fate_rdma_lab.bench.mooncake_peer") as send:
        try:
            dst = recv.cmd({"cmd": "open", "role": "recv", "host": host, "nbytes": nbytes})
            src = send.cmd({"cmd": "open", "role": "send", "host": host, "nbytes": nbytes, "seed": seed})
        except RuntimeError as exc:
            return {m: {"skipped": f"Mooncake could not start: {exc}"} for m in wanted}
        for m in wanted:
            step = 0 if METHODS[m] == "sync" else chunk_bytes
            write = {"cmd": "write", "target": dst["session"], "dst_addr": dst["addr"], "nbytes": nbytes, "chunk_bytes": step}
            try:
                send.cmd(write)  # warm-up: opens the segment and its connections, touches the pages (as raw TCP's)
                times: List[float] = []
                cpu_send: List[float] = []
                cpu_recv: List[float] = []
                for _ in range(reps):
                    recv.cmd({"cmd": "fill", "value": 1})
                    c0 = recv.cmd({"cmd": "cpu"})["cpu_s"]
                    r = send.cmd(write)
                    c1 = recv.cmd({"cmd": "cpu"})["cpu_s"]
                    crc = recv.cmd({"cmd": "crc", "nbytes": nbytes})["crc32c"]
                    if crc != expected_crc:
                        raise RuntimeError(f"received bytes fail verification (crc32c {crc:#010x}, payload {expected_crc:#010x})")
                    times.append(r["seconds"])
                    cpu_send.append(r["cpu_s"])
                    cpu_recv.append(c1 - c0)
            except RuntimeError as exc:
                out[m] = {"skipped": f"Mooncake {METHODS[m]} write failed: {exc}"}
                continue
            out[m] = {"seconds": round(median(times), 4), "provider": "mooncake-te", "label": src["version"],
                      "path": "tcp", "emulated": False, "verified": True,
                      "chunks": -(-nbytes // chunk_bytes) if step else 1,
                      "cpu_send_s_per_gb": per_gb(median(cpu_send), nbytes),
                      "cpu_recv_s_per_gb": per_gb(median(cpu_recv), nbytes)}
    return out
