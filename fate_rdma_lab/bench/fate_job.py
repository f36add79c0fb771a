"""One party of `fate-rdma bench fate` (run by FATE's multiprocess launcher): FedAvg rounds of GPT-2-
sized weights through FATE's own secure aggregation (`fate.arch.protocol.secure_aggregation`, the
protocol FATE-LLM's FedAvg uses): each client puts its mixed float64 arrays (2 x 8 bytes a parameter)
to the arbiter and gets the float64 average back. No training: this measures the federation.
Writes `<out>/<role>.json` with per-round communication seconds, payload bytes and peak RSS."""
# (no `from __future__ import annotations`: FATE's argument parser reads the dataclass field types)
import hashlib
import json
import os
import resource
import time
from dataclasses import dataclass, field
from typing import List, Tuple, cast

#: GPT-2 small (GPT2Config()): 124,439,808 parameters in 148 tensors
GPT2_PARAMS = 124_439_808
#: how far ahead the arbiter names each round's start instant: longer than a small object takes through
#: FATE's own federation or fate-rdma's here once the parties are connected (the first round's start
#: message, which meets the connections' set-up, gets FIRST_LEAD_S; one later still: `wait_until`)
START_LEAD_S = 0.3
#: the first round's lead: the first "go" through FATE's federation took about 1.2 s to reach a client here
#: (first use of the name; both methods), so with START_LEAD_S a client started ~0.9 s late and the other
#: client's first round counted that wait, a cost of the bench's own barrier that no job has
FIRST_LEAD_S = 3.0


def wait_until(start: float) -> float:
    """Sleep until `start` (time.monotonic(): one clock for every process of a host, which is where the
    launcher runs the parties); return the instant this party really starts its round: `start`, or now
    if it learned of `start` late. A round is timed from that, so what it counts is the party's own
    upload and download, never time before the upload began; with a late start the other client may
    wait for this one's upload, and that wait is in its round (as with the plain "go" of old)."""
    now = time.monotonic()
    if now < start:
        time.sleep(start - now)
        return start
    return now


def gpt2_shapes(n_layer: int = 12, d: int = 768, vocab: int = 50257, ctx: int = 1024):
    """The parameter shapes of GPT2LMHeadModel in `parameters()` order (lm_head is tied to wte)."""
    shapes: List[Tuple[int, ...]] = [(vocab, d), (ctx, d)]
    for _ in range(n_layer):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def lora_shapes(rank: int, n_layer: int = 12, d: int = 768):
    """peft LoRA of rank `rank` on GPT-2's c_attn: lora_A (r, d) and lora_B (3d, r) per layer."""
    return [s for _ in range(n_layer) for s in ((rank, d), (3 * d, rank))]


def scaled_shapes(scale: float, lora_rank: int = 0):
    """GPT-2's shapes (or its LoRA adapters') with the leading dimension of each scaled."""
    base = lora_shapes(lora_rank) if lora_rank > 0 else gpt2_shapes()
    if scale >= 1:
        return base
    return [(max(1, int(s[0] * scale)),) + tuple(s[1:]) for s in base]


def _check_average(avg, inputs, args, ranks, first_round: bool) -> bool:
    """The last round's average against what it must be: after round 1 every client holds the same
    weights, so the average equals this client's own inputs; in round 1 it is the plain mean of every
    client's initial weights (regenerated from their seeds, one tensor at a time). A payload garbled
    in any round shows here, since each round's inputs are the previous average."""
    import numpy as np

    shapes = scaled_shapes(args.scale, args.lora_rank)
    if len(avg) != len(shapes):
        return False
    rngs = [np.random.default_rng(args.seed + r) for r in ranks]
    for a, x, s in zip(avg, inputs, shapes):
        if first_round:  # sum() starts from 0, an array once added to (there is an rng per client)
            want = cast(np.ndarray, sum(rng.standard_normal(int(np.prod(s))) for rng in rngs)).reshape(s) / len(rngs)
        else:
            want = x
        if a.shape != want.shape or not np.allclose(a, want, rtol=1e-7, atol=1e-7):
            return False
    return True


@dataclass
class BenchArgs:
    rounds: int = field(default=2)
    scale: float = field(default=1.0)
    lora_rank: int = field(default=0, metadata={"help": "0: GPT-2's full weights; r: its LoRA (c_attn) adapters"})
    seed: int = field(default=0)
    out: str = field(default="bench_fate_out")


def _record(ctx, args: BenchArgs, role: str, comm, extra) -> None:
    rdma = getattr(ctx.federation, "fate_rdma", None)
    rec = {"role": role, "comm_seconds": comm, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "transport": "fate-rdma" if rdma else "fate", "label": rdma.endpoint.label if rdma else "FATE federation",
           "emulated": bool(rdma and rdma.endpoint.ctx.emulated), "rdma": dict(rdma.stats) if rdma else None,
           "recv_buffers": {"reused_bytes": rdma.endpoint.recv_buffers.reused_bytes,
                            "fresh_bytes": rdma.endpoint.recv_buffers.fresh_bytes} if rdma else None,
           "put_copies": {"reused_bytes": rdma.put_copies.reused_bytes,
                          "fresh_bytes": rdma.put_copies.fresh_bytes} if rdma else None, **extra}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{role}.json"), "w") as f:
        json.dump(rec, f)


def run(ctx) -> None:
    """Secure aggregation exactly as FATE's SecureAggregatorClient/Server do it (same names, same
    payloads), with the compute (masking, summing) kept out of the timed part: per round, the clients
    mix their weights first, then all three meet at a small barrier: the arbiter names an instant
    START_LEAD_S ahead (FIRST_LEAD_S in the first round), both clients start their upload at it, and the clock runs from it (from the
    start message's arrival where that came later: wait_until) until each client holds the unpickled
    average, less the arbiter's summing time. (Timed from each client's receipt of a plain "go"
    instead, a round also counted the gap between the two receipts, some milliseconds here, the second
    client's upload starting that much later: a cost of the barrier's own messages, which no FedAvg
    round has and `bench fate`'s channel-alone baseline never had.) The arbiter's summing time reaches the
    clients with the next round's "go" (the last round's after the loop): sent right after the average,
    as before 2026-11-29, it was two more transfers in the round's window, beside the downloads, which
    neither a FedAvg round nor the channel-alone baseline has."""
    import numpy as np
    from fate.arch.launchers.argparser import HfArgumentParser
    from fate.arch.protocol.secure_aggregation._secure_aggregation import SecureAggregatorClient
    from fate_utils.secure_aggregation_helper import MixAggregate

    args = HfArgumentParser(BenchArgs).parse_args_into_dataclasses(return_remaining_strings=True)[0]
    role = ctx.local.role
    ranks = [ctx.guest.rank, *ctx.hosts.ranks]
    send, recv = "bench_model_mixed_client_values", "bench_model_aggregated_values"
    if role == "arbiter":
        agg_seconds: List[float] = []
        wall: List[float] = []
        for i, rctx in ctx.ctxs_range(args.rounds):
            for r in ranks:
                rctx.parties[r].get("ready")
            start = time.monotonic() + (START_LEAD_S if i else FIRST_LEAD_S)
            for r in ranks:  # with the previous round's summing time (kept out of that round's window)
                rctx.parties[r].put("go", (start, agg_seconds[-1] if i else 0.0))
            start = wait_until(start)
            mix, total = MixAggregate(), 0.0
            spent = 0.0
            for r in ranks:
                arrays, w = rctx.parties[r].get(send)
                t1 = time.perf_counter()
                mix.aggregate(arrays)
                total += w
                del arrays
                spent += time.perf_counter() - t1
            t1 = time.perf_counter()
            avg = mix.finalize(total)
            spent += time.perf_counter() - t1
            for r in ranks:
                rctx.parties[r].put(recv, avg)
            del avg, mix
            agg_seconds.append(spent)
            wall.append(time.monotonic() - start)
        for r in ranks:  # the last round's summing time (each earlier one came with the next round's "go")
            ctx.parties[r].put("agg_seconds", agg_seconds[-1])
        return _record(ctx, args, role, [w - a for w, a in zip(wall, agg_seconds)], {"aggregate_seconds": agg_seconds})
    rng = np.random.default_rng(args.seed + ctx.local.rank)
    weights = [rng.standard_normal(int(np.prod(s))).reshape(s) for s in scaled_shapes(args.scale, args.lora_rank)]
    n = sum(w.size for w in weights)
    client = SecureAggregatorClient(prefix="bench_model")
    client.dh_exchange(ctx, ranks)
    elapsed, agg, mix_seconds, go_late = [], [], [], []
    for i, rctx in ctx.ctxs_range(args.rounds):
        if i:
            weights = [a * 0.999 for a in avg]  # the next round's "local update" (the same on every client)
            del avg
        t0 = time.perf_counter()
        mixed = client._get_mixer().mix(weights, 0.5)
        mix_seconds.append(time.perf_counter() - t0)
        rctx.arbiter.put("ready", True)
        named, last_agg = rctx.arbiter.get("go")
        if i:
            agg.append(last_agg)
        start = wait_until(named)
        go_late.append(start - named)
        rctx.arbiter.put(send, (mixed, 0.5))
        del mixed
        avg = rctx.arbiter.get(recv)
        elapsed.append(time.monotonic() - start)
    agg.append(ctx.arbiter.get("agg_seconds"))
    comm = [e - a for e, a in zip(elapsed, agg)]
    # checked once all rounds are timed, so the check never competes with another party's timed part;
    # the clients also compare digests, so an average that differs between them cannot pass
    verified = _check_average(avg, weights, args, ranks, first_round=args.rounds == 1)
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in avg)).hexdigest()
    others = [p for p in ranks if p != ctx.local.rank]
    for r in others:
        ctx.parties[r].put("bench_final_digest", digest)
    verified = verified and all(ctx.parties[r].get("bench_final_digest") == digest for r in others)
    _record(ctx, args, role, comm, {"params": n, "tensors": len(weights), "up_bytes": 16 * n, "down_bytes": 8 * n,
                                    "mix_seconds": mix_seconds, "go_late_seconds": go_late, "verified": verified,
                                    "aggregate_seconds": agg})

if __name__ == "__main__":
    from fate.arch.launchers.multiprocess_launcher import launch

    launch(run, extra_args_desc=[BenchArgs])
