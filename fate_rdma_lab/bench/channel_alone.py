"""The channel alone, for `bench fate`: the bytes of one FedAvg round moved between three processes
(two clients and the arbiter) with nothing but fate-rdma endpoints, the same configuration as the
FATE job beside it. Per round: from an instant the arbiter names START_LEAD_S ahead (as in the FATE job,
fate_job.wait_until), both clients send their upload to the arbiter at once;
when it holds both, the arbiter sends the download to each; the round ends when both clients hold it.
No FATE, no serialization, no aggregation: what `bench fate`'s fate-rdma round would cost if the
integration added nothing. Round time = the slower client's; median over rounds.

The payload lies where the FATE wrapper's put copies go (one buffer, in shared memory when the same-host
path is on: the strictest baseline), or, with `pieces`, in private arrays of the given sizes (one
allocation each, as a FATE job's tensors are): what the channel needs for the payload in the shape and
memory FATE's put hands it, so that fate-rdma's round against this one is the integration's own cost.
"""
from __future__ import annotations

import multiprocessing
import os
import queue
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from fate_rdma_lab.bench.local import free_ports
from fate_rdma_lab.bench.fate_job import FIRST_LEAD_S, START_LEAD_S, wait_until
from fate_rdma_lab.bench.report import median

ROLES = ("guest", "host", "arbiter")


def _payload(nbytes: int, sizes: Optional[Sequence[int]], shared: bool, value: int) -> Any:
    """One buffer of `nbytes` (in shared memory if `shared`), or private arrays of `sizes` bytes, filled."""
    import numpy as np

    from fate_rdma.channel.buffers import fresh

    if sizes is None:
        payload = fresh(nbytes, shared)
        payload.fill(value)
        return payload
    return [np.full(n, value, dtype=np.uint8) for n in sizes]


def _party(role: str, config: Dict[str, Any], addrs: Dict[str, str], up: int, down: int, rounds: int,
           barrier: Any, start_at: Any, results: Any, timeout: float,
           pieces: Optional[Tuple[List[int], List[int]]] = None) -> None:
    from fate_rdma.channel import Endpoint
    from fate_rdma.config import ChannelConfig

    try:
        host, _, port = addrs[role].rpartition(":")
        with Endpoint(ChannelConfig(**config), host, int(port), name=addrs[role]) as ep:
            arbiter = addrs["arbiter"]
            # the payload where the FATE wrapper puts its copies (shared memory when the same-host path is
            # on), or in private arrays of the given sizes
            payload = _payload(down if role == "arbiter" else up, None if pieces is None else
                               pieces[1 if role == "arbiter" else 0], ep.same_host_capable,
                               {"arbiter": 7, "guest": 1}.get(role, 2))
            if role == "arbiter":
                clients = [addrs["guest"], addrs["host"]]
            else:
                ep.connect(arbiter)  # connection set-up is not part of a round (the FATE job connects once too)
            times: List[float] = []
            late = 0.0
            for i in range(rounds):
                if role == "arbiter":  # read by the clients once past the barrier; the first round's lead as in
                    start_at.value = time.monotonic() + (START_LEAD_S if i else FIRST_LEAD_S)  # the FATE job
                barrier.wait(timeout)
                start = wait_until(start_at.value)
                if role != "arbiter":  # (a late arbiter starts no upload)
                    late = max(late, start - start_at.value)
                if role == "arbiter":
                    got = [ep.recv(timeout=timeout) for _ in clients]
                    for m in got:
                        m.release()
                    for f in [ep.send(c, payload) for c in clients]:
                        f.result(timeout)
                else:
                    ep.send(arbiter, payload).result(timeout)
                    msg = ep.recv(timeout=timeout)
                    times.append(time.monotonic() - start)
                    ok = msg.nbytes == down and msg.view[0] == 7 and msg.view[-1] == 7
                    msg.release()
                    if not ok:
                        raise RuntimeError("the download arrived with the wrong size or contents")
                barrier.wait(timeout)  # no party starts the next round (or closes) before both clients are done
            results.put((role, times, late, None))
    except BaseException as exc:  # reported to the parent, which names the party
        results.put((role, [], 0.0, f"{type(exc).__name__}: {exc}"))


def _collect(procs: List[Any], results: Any, got: Dict[str, List[float]], lates: List[float],
             deadline: float) -> List[str]:
    """Each party's round times into `got` (and how late it started into `lates`) until all have reported,
    one reports an error, one has exited without reporting (killed, or it crashed before it could), or
    `deadline` passes; the errors, naming the party."""
    while len(got) < len(procs):
        try:
            role, times, late, err = results.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        except queue.Empty:
            # a party that put its result before exiting has it in the pipe by then (the queue's feeder
            # flushes at exit), so one gone without a result after a quiet second will not report
            silent = [p for p in procs if p.name.rpartition("-")[2] not in got]
            gone = [f"{p.name} exited with code {p.exitcode} without a result" for p in silent if p.exitcode is not None]
            if gone:
                return gone
            if time.monotonic() >= deadline:
                return [f"no result from {', '.join(p.name for p in silent)} in time"]
            continue
        got[role] = times
        lates.append(late)
        if err:
            return [f"{role}: {err}"]
    return []


def measure(config: Dict[str, Any], up_bytes: int, down_bytes: int, rounds: int = 3,
            timeout: float = 600.0, pieces: Optional[Tuple[List[int], List[int]]] = None) -> Dict[str, Any]:
    """Run the three parties; returns {"round_seconds": median, "round_seconds_all": [...],
    "start_late_seconds": the most a client learned of a round's start late (fate_job.wait_until)}.
    `config`: ChannelConfig fields (a per-run secret is added when none is given). `pieces`: (upload,
    download) array sizes in bytes, summing to `up_bytes` and `down_bytes`: send private arrays of those
    sizes instead of one buffer each way."""
    if pieces is not None and (sum(pieces[0]) != up_bytes or sum(pieces[1]) != down_bytes):
        raise ValueError(f"channel alone: the pieces sum to {sum(pieces[0])} / {sum(pieces[1])} bytes, "
                         f"not {up_bytes} / {down_bytes}")
    from fate_rdma.channel.auth import write_secret

    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="fate-rdma-channel-alone-") as tmp:
        config = dict(config)
        if not config.get("secret_file") and config.get("auth", "auto") != "none":
            config["secret_file"] = os.path.join(tmp, "secret")
            write_secret(config["secret_file"])
        addrs = {r: f"127.0.0.1:{p}" for r, p in zip(ROLES, free_ports(len(ROLES)))}
        barrier, start_at, results = ctx.Barrier(len(ROLES)), ctx.Value("d", 0.0), ctx.Queue()
        procs = [ctx.Process(target=_party, args=(r, config, addrs, up_bytes, down_bytes, rounds, barrier, start_at,
                                                  results, timeout, pieces), name=f"channel-alone-{r}", daemon=True)
                 for r in ROLES]
        for p in procs:
            p.start()
        got: Dict[str, List[float]] = {}
        lates = [0.0]
        errors = []
        try:
            errors += _collect(procs, results, got, lates, time.monotonic() + timeout * (rounds + 1))
        finally:
            for p in procs:
                p.join(5 if not errors else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
        if errors:
            raise RuntimeError("bench fate: the channel-alone run failed: " + "; ".join(errors))
    per_round = [max(a, b) for a, b in zip(got["guest"], got["host"])]
    return {"round_seconds": median(per_round), "round_seconds_all": per_round, "start_late_seconds": max(lates)}
