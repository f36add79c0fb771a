"""FATE federation with and without fate-rdma: GPT-2 FedAvg payloads, guest + host + arbiter.

Runs the same three-party job twice through FATE's multiprocess launcher (standalone engine), first
over FATE's own federation, then with fate-rdma switched on, and reports per-round communication
seconds (median over rounds; measured at the clients from a start instant the arbiter names,
fate_job, until the average is unpickled, less the arbiter's summing time), payload bytes and each
party's peak RSS. The payloads are what FATE-LLM's FedAvg sends with FATE's default secure
aggregation for GPT-2 small: 124,439,808 parameters as float64, mixed (2 x 8 bytes a parameter,
~1.99 GB) up, the float64 average (~0.995 GB) down, per client per round. `--scale` shrinks every
tensor's leading dimension (memory: FATE's own path peaks near 8x the upload per client). Figures
from the soft provider are an emulation over TCP on one machine and are labelled so; they are not
RDMA figures.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional, Tuple

from fate_rdma.config import ChannelConfig
from fate_rdma.protocol.policy import slot_chunk_bytes
from fate_rdma.hugepages import requested as huge_pages_requested, with_huge_pages, without_huge_pages
from fate_rdma.trace import ENV as TRACE_ENV
from fate_rdma_lab.bench.local import PARTIES, local_endpoints, run_group
from fate_rdma_lab.bench.fate_report import TIMERS, print_breakdowns, print_late_starts, verdicts
from fate_rdma_lab.bench.report import emit, human_bytes, median, table
from fate_rdma_lab.bench.timeline import print_report as print_timeline

ROLES = ("guest", "host", "arbiter")
#: the channel's chunk (the bench's configuration leaves chunk_bytes at its default)
CHUNK = ChannelConfig().chunk_bytes


def nominal_chunk(mode: str, data_path: str, soft_link: Optional[str]) -> int:
    """The chunk fate-rdma's large messages go in on `data_path` with the default configuration (the table's
    nominal count): FedRDMA-E's larger chunk on the same-host path and over the soft provider's TCP between
    these processes (a short path, once probed), chunk_bytes under a link model and in FedRDMA."""
    c = ChannelConfig()
    if mode != "fedrdma-e" or soft_link:
        return c.chunk_bytes
    return slot_chunk_bytes(c.chunk_bytes, c.same_host_chunk_bytes, data_path == "same-host", c.tcp_chunk_bytes,
                            short_tcp=data_path == "tcp")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="scale 0.25, 3 rounds (about two minutes)")
    p.add_argument("--scale", type=float, default=None,
                   help="fraction of GPT-2's parameters (default 1; FATE's own path is run at the largest "
                        "scale this machine's memory allows, and fate-rdma at that scale too, for the ratio)")
    p.add_argument("--rounds", type=int, default=None, help="FedAvg rounds per job (default 3)")
    p.add_argument("--lora-ranks", default=None,
                   help="comma list of LoRA ranks: GPT-2 LoRA (c_attn) payloads instead of full weights, one "
                        "pair of jobs per rank (the FedRDMA paper's Table 3), e.g. 4,8,16,32,64,128,256,512,1024")
    p.add_argument("--mode", default="fedrdma", choices=["fedrdma", "fedrdma-e"],
                   help="channel mode (default fedrdma, as the demo's part 2; the benchmarks page's figures use fedrdma-e, the "
                        "channel's default, whose slots grow to the payload: ~2 GB per client at the arbiter at full size)")
    p.add_argument("--methods", default="fate,fate-rdma", help="comma list of fate, fate-rdma")
    p.add_argument("--provider", default="auto", help="verbs provider for fate-rdma (auto, soft, pyverbs)")
    p.add_argument("--path", default="tcp", choices=["tcp", "same-host", "both"],
                   help="soft provider's data path between the parties (all on this machine here): tcp (default: "
                        "as between sites), same-host (a copy between the processes: shared memory or "
                        "process_vm_readv, as when parties share a host), or both "
                        "(separate rows and ratios, never mixed)")
    p.add_argument("--descriptors", default="auto", choices=["auto", "fate", "channel"],
                   help="how fate-rdma's gets learn what was put: channel (every object and its description over "
                        "the channel; the launcher's per-job secret proves the senders), fate (a descriptor through "
                        "FATE's own federation, small objects on FATE's path), auto (default, as in a job conf: "
                        "channel here)")
    p.add_argument("--soft-link", default=None, metavar="SPEC",
                   help="the soft provider's link model between the parties, e.g. rate=10gbit,rtt=20ms: an emulated "
                        "WAN for fate-rdma's jobs and the channel-alone baseline (FATE's own path runs unshaped on "
                        "loopback, so compare fate-rdma's rows with each other, not with FATE's)")
    p.add_argument("--buffer-puts", default="auto", choices=["auto", "true", "false"],
                   help="fate-rdma's buffer_puts (default auto, as in a job conf: a put is copied and returns at once "
                        "where it is at most 16 MiB or costs less than the round trip to its parties (on this machine's "
                        "loopback: puts of at most 16 MiB); true: every put is copied, the default before 2026-11-27; false: none)")
    p.add_argument("--timeout", type=int, default=3000, help="seconds allowed for each job (default 3000)")
    p.add_argument("--huge-pages", choices=["auto", "off"], default="auto",
                   help="auto (default, as `fate-rdma launch`): every job's processes, FATE's own included, and the "
                        "channel-alone baselines start with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 where the kernel "
                        "and glibc allow it (the arrays FATE allocates with malloc in huge pages, as numpy's own "
                        "are: fate_rdma/hugepages.py); off: none of them")
    p.add_argument("--trace", action="store_true",
                   help="trace every fate-rdma job (FATE_RDMA_TRACE, fate_rdma/trace.py) and print after it where each "
                        "transfer spent its time, from FATE's put to FATE's get returning (`bench timeline`)")
    p.add_argument("--keep", default=None, help="keep the parties' result files in this folder")
    p.add_argument("--pairs", type=int, default=1,
                   help="run each case's jobs this many times, FATE's job first in odd repetitions and fate-rdma's "
                        "(with its channel-alone baseline) first in even ones; each ratio is then the median of the "
                        "repetitions' ratios, so that a drift of the machine's speed during the run weighs on both "
                        "sides alike (default 1; 3 or more for a verdict on a shared machine)")
    p.add_argument("--no-channel-alone", dest="channel_alone", action="store_false",
                   help="skip the baseline run beside every fate-rdma job: the same bytes between three processes "
                        "through the channel alone (no FATE), to show what the integration adds")
    p.add_argument("--channel-alone-arrays", action="store_true",
                   help="beside each channel-alone baseline (one buffer each way, in shared memory on the same-host "
                        "path: the strictest), a second with the payload as FATE's put hands it over: private arrays "
                        "of the job's tensor sizes (148 at GPT-2 full). fate-rdma's round against it is the "
                        "integration's own cost; the first baseline against it, what the payload's memory and shape "
                        "cost the channel. The target's verdict stays against the first")


#: peak memory of FATE's own path, all three parties, per byte of one client's upload (measured here:
#: 3.6 GiB per client and 2.6 GiB at the arbiter for a 475 MiB upload; a full-size run was OOM-killed)
FATE_MEM_PER_UPLOAD_BYTE = 21.0
RDMA_MEM_PER_UPLOAD_BYTE = 8.0


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def _upload_bytes(scale: float, lora_rank: int) -> int:
    return sum(payload_pieces(scale, lora_rank)[0])


def fitting_scale(per_byte: float, budget: int) -> float:
    """The largest scale (a multiple of 0.05, at most 1) whose estimated peak fits in `budget` bytes."""
    full = _upload_bytes(1.0, 0) * per_byte
    return max(0.05, min(1.0, int(budget / full * 20) / 20))


def _channel_fields(args: argparse.Namespace, upload: int, data_path: str) -> Dict[str, Any]:
    """The ChannelConfig fields of the bench's fate-rdma jobs (and of the channel-alone baseline)."""
    fields: Dict[str, Any] = {"mode": args.mode, "provider": args.provider, "window": "auto",
                              "same_host": data_path == "same-host"}
    if args.soft_link:
        fields["soft_link"] = args.soft_link
    if args.mode == "fedrdma-e":
        # two slots (the default): the payload the application holds in place (lent) and one that circulates
        fields.update(pool_slots=2, slot_bytes=upload + (16 << 20))
    return fields


def _conf(path: str, args: argparse.Namespace, upload: int, data_path: str = "tcp") -> None:
    sec: Dict[str, Any] = {"enabled": True, "threshold_bytes": 1 << 20, "fallback": "error",
                           "descriptors": args.descriptors,
                           "buffer_puts": {"true": True, "false": False}.get(args.buffer_puts, args.buffer_puts),
                           "endpoints": local_endpoints(), **_channel_fields(args, upload, data_path)}
    with open(path, "w") as f:
        json.dump({"fate_rdma": sec}, f)


def payload_pieces(scale: float, lora_rank: int) -> Tuple[List[int], List[int]]:
    """The byte sizes of the arrays of a `bench fate` round: each client's upload (FATE's secure aggregation
    mixes each float64 tensor into 16 bytes a parameter) and the arbiter's download (8 bytes a parameter)."""
    from fate_rdma_lab.bench.fate_job import scaled_shapes

    numels = []
    for s in scaled_shapes(scale, lora_rank):
        k = 1
        for d in s:
            k *= d
        numels.append(k)
    return [16 * k for k in numels], [8 * k for k in numels]


def _channel_alone_row(row: Dict[str, Any], args: argparse.Namespace, rounds: int, data_path: str,
                       arrays: bool = False) -> Dict[str, Any]:
    from fate_rdma_lab.bench import channel_alone

    pieces = payload_pieces(row["scale"], row["lora_rank"]) if arrays else None
    shape = f"as {len(pieces[0])} private arrays each way" if pieces else "as one buffer each way"
    print(f"# channel alone: {human_bytes(row['up_bytes'])} up / {human_bytes(row['down_bytes'])} down per client, "
          f"{shape}, three processes, path {data_path}", file=sys.stderr, flush=True)
    got = channel_alone.measure(_channel_fields(args, row["up_bytes"], data_path), row["up_bytes"], row["down_bytes"],
                                rounds, timeout=args.timeout, pieces=pieces)
    return dict(row, method="channel-alone-arrays" if arrays else "channel-alone", descriptors="-", buffer_puts="-",
                round_comm_seconds=got["round_seconds"],
                round_comm_seconds_all=got["round_seconds_all"], start_late_seconds=got["start_late_seconds"],
                peak_rss_bytes=0, arbiter_peak_rss_bytes=0,
                aggregate_seconds=0.0, breakdown=None)


def _job(method: str, out: str, conf: Optional[str], scale: float, lora_rank: int, rounds: int,
         timeout: int, trace_dir: Optional[str] = None, huge_pages: str = "auto") -> Dict[str, Any]:
    job = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fate_job.py")
    cmd = [sys.executable, job]
    if conf:  # (run() gave every job the same environment: launch adds nothing to it, or takes nothing out)
        cmd = [sys.executable, "-m", "fate_rdma.cli", "launch", "--conf", conf, "--huge-pages", huge_pages, job]
    cmd += ["--parties", *PARTIES, "--log_level", "WARNING", "--scale", str(scale), "--lora_rank", str(lora_rank),
            "--rounds", str(rounds),
            "--out", out]
    print(f"# {method}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    try:
        p = run_group(cmd, timeout, out, {**os.environ, TRACE_ENV: trace_dir} if trace_dir else None)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"bench fate: the {method} job did not finish within {timeout} s (stopped)")
    missing = [r for r in ROLES if not os.path.exists(os.path.join(out, f"{r}.json"))]
    if p.returncode != 0 or missing:
        sys.stderr.write(p.stdout[-4000:] + p.stderr[-4000:])
        raise SystemExit(f"bench fate: the {method} job failed (exit {p.returncode}; no result from {missing})")
    return {r: json.load(open(os.path.join(out, f"{r}.json"))) for r in ROLES}


def _row(method: str, res: Dict[str, Any], mode: str, scale: float, lora_rank: int) -> Dict[str, Any]:
    g, h, a = res["guest"], res["host"], res["arbiter"]
    per_round = [max(x, y) for x, y in zip(g["comm_seconds"], h["comm_seconds"])]  # the slower client
    return {
        "bench": "fate", "payload": f"gpt2-lora-r{lora_rank}" if lora_rank else "gpt2-full", "scale": scale,
        "lora_rank": lora_rank, "method": method, "mode": mode if method == "fate-rdma" else "fate-standalone",
        "provider": g["label"], "emulated": bool(g["emulated"]), "rounds": len(per_round),
        "round_comm_seconds": median(per_round), "round_comm_seconds_all": per_round,
        "payload_bytes": g["up_bytes"] + g["down_bytes"], "up_bytes": g["up_bytes"], "down_bytes": g["down_bytes"],
        "params": g["params"], "tensors": g["tensors"], "verified": bool(g["verified"] and h["verified"]),
        "peak_rss_bytes": max(g["peak_rss_bytes"], h["peak_rss_bytes"]), "arbiter_peak_rss_bytes": a["peak_rss_bytes"],
        "aggregate_seconds": median(a["aggregate_seconds"]),
        # how late the round's start instant reached a client, when it did (that client started late: fate_job)
        "start_late_seconds": max([0.0, *g.get("go_late_seconds", []), *h.get("go_late_seconds", [])]),
        "breakdown": _breakdown(res, len(per_round)),
    }


def _breakdown(res: Dict[str, Any], rounds: int) -> Optional[Dict[str, Dict[str, float]]]:
    """Per party, where fate-rdma's puts and gets spent their time, per round (the job's totals / rounds;
    the waits include waiting for the other parties)."""
    if not res["guest"].get("rdma") or not rounds:
        return None
    out: Dict[str, Dict[str, float]] = {r: {k: res[r]["rdma"].get(k, 0.0) / rounds for k in TIMERS} for r in ROLES}
    for r in ROLES:  # whole job, not per round: what arrived lent in place (FedRDMA-E slots, no copy), and
        # how much of what was copied or reassembled landed in memory faulted in fresh
        out[r]["lent_recv_bytes"] = res[r]["rdma"].get("lent_bytes", 0)
        for record, what in (("recv_buffers", "recv"), ("put_copies", "put_copy")):  # (older records lack them)
            for memory in ("fresh", "reused"):
                out[r][f"{memory}_{what}_bytes"] = (res[r].get(record) or {}).get(f"{memory}_bytes", 0)
    return out


def _cases(args: argparse.Namespace, methods: List[str]) -> List[Tuple[float, int, List[str]]]:
    """(scale, lora_rank, methods) for each pair of jobs to run."""
    rounds_scale = args.scale if args.scale is not None else (0.25 if args.quick else 1.0)
    if args.lora_ranks:
        ranks = [int(r) for r in args.lora_ranks.split(",") if r.strip()]
        return [(1.0, r, methods) for r in ranks]
    cases = []
    if "fate" in methods:
        budget = int(_available_bytes() * 0.85)
        fit = fitting_scale(FATE_MEM_PER_UPLOAD_BYTE, budget)
        if rounds_scale > fit:
            print(f"bench fate: FATE's own path needs about {FATE_MEM_PER_UPLOAD_BYTE * _upload_bytes(rounds_scale, 0) / 2**30:.0f} "
                  f"GiB for three parties at scale {rounds_scale:g}, {budget / 2**30:.0f} GiB is available: both methods "
                  f"are compared at scale {fit:g}, and fate-rdma alone runs the full size", file=sys.stderr)
            cases.append((fit, 0, methods))
            if "fate-rdma" in methods:
                cases.append((rounds_scale, 0, ["fate-rdma"]))
            return cases
    return [(rounds_scale, 0, methods)]


def run(args: argparse.Namespace) -> int:
    rounds = args.rounds if args.rounds is not None else 3
    pairs = args.pairs
    if pairs < 1:
        print("bench fate: --pairs must be at least 1", file=sys.stderr)
        return 2
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in ("fate", "fate-rdma")]
    if bad or not methods:
        print(f"bench fate: unknown method(s) {bad}; use fate, fate-rdma", file=sys.stderr)
        return 2
    if args.channel_alone_arrays and not args.channel_alone:
        print("bench fate: --channel-alone-arrays is a second channel-alone baseline; it cannot go with "
              "--no-channel-alone", file=sys.stderr)
        return 2
    if args.scale is not None and not 0 < args.scale <= 1:
        print("bench fate: --scale must be in (0, 1]", file=sys.stderr)
        return 2
    if args.soft_link:
        from easypyverbs import EasyVerbsError, LinkModel, choose_provider

        try:
            LinkModel.parse(args.soft_link)
            soft = choose_provider(args.provider)[0] == "soft"
        except (ValueError, EasyVerbsError) as exc:
            print(f"bench fate: --soft-link: {exc}", file=sys.stderr)
            return 2
        if "fate" in methods or args.path != "tcp" or not soft:
            print("bench fate: --soft-link shapes the soft provider's TCP path only: use it with --methods fate-rdma, "
                  "--path tcp and the soft provider (FATE's own path would run unshaped beside it)", file=sys.stderr)
            return 2
    if args.path != "tcp" and "fate-rdma" in methods:
        from easypyverbs import choose_provider
        from easypyverbs.providers.soft import samehost

        ok, why = samehost.available()
        if not ok and choose_provider(args.provider)[0] == "soft":  # its rows would name a path not taken
            print(f"bench fate: --path {args.path} needs the soft provider's same-host path, not available here: {why}"
                  + (" (--path tcp measures the TCP path alone)" if args.path == "both" else ""), file=sys.stderr)
            return 2
    try:
        import fate.arch  # noqa: F401
    except ImportError:
        print("bench fate: FATE is not installed here (pip install 'fate-rdma[fate]', or make venv)", file=sys.stderr)
        return 2
    try:
        cases = _cases(args, methods)
    except ValueError:
        print(f"bench fate: --lora-ranks wants a comma list of integers, got {args.lora_ranks!r}", file=sys.stderr)
        return 2
    saved = dict(os.environ)
    try:
        return _run(args, methods, cases, rounds, pairs)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _run(args: argparse.Namespace, methods: List[str], cases: List[Tuple[float, int, List[str]]], rounds: int,
         pairs: int) -> int:
    # every job and baseline process of the run starts with the same environment (FATE's own job too)
    env, done = with_huge_pages(os.environ) if args.huge_pages == "auto" else \
        (without_huge_pages(os.environ), "off (--huge-pages off)")
    os.environ.clear()
    os.environ.update(env)
    huge = huge_pages_requested(os.environ)
    print(f"# malloc huge pages in every job's and baseline's processes: {done}", file=sys.stderr, flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fate-rdma-bench-") as tmp:
        base = args.keep or tmp
        paths = ["tcp", "same-host"] if args.path == "both" else [args.path]
        for scale, rank, ms in cases:
            for pair in range(pairs):
                order = [(m, p) for m in ms for p in (paths if m == "fate-rdma" else ["-"])]
                if pair % 2:  # fate-rdma's jobs (each with its channel-alone run) first in even repetitions
                    order.reverse()
                for method, data_path in order:
                    suffix = ("" if data_path in ("-", "tcp") else f"-{data_path}") + (f"-p{pair + 1}" if pairs > 1 else "")
                    out = os.path.join(base, f"{method}{suffix}-s{scale:g}-r{rank}")
                    os.makedirs(out, exist_ok=True)
                    conf = None
                    if method == "fate-rdma":
                        conf = os.path.join(out, "fate_rdma.json")
                        _conf(conf, args, _upload_bytes(scale, rank), data_path)
                    traced = os.path.join(out, "trace") if args.trace and method == "fate-rdma" else None
                    if traced:  # (a --keep folder used before holds an earlier job's files)
                        shutil.rmtree(traced, ignore_errors=True)
                    res = _job(method, out, conf, scale, rank, rounds, args.timeout, traced, args.huge_pages)
                    row = _row(method, res, args.mode, scale, rank)
                    chunk = nominal_chunk(args.mode, data_path, args.soft_link)
                    if traced:
                        print_timeline(traced, 1 << 20, f" of the fate-rdma job, path {data_path}, pair {pair + 1}")
                    row.update(path=data_path, pair=pair + 1, malloc_huge_pages=huge,
                               descriptors=args.descriptors if method == "fate-rdma" else "-",
                               buffer_puts=args.buffer_puts if method == "fate-rdma" else "-",
                               chunk_bytes=chunk, chunks_up=-(-row["up_bytes"] // chunk) if method == "fate-rdma" else None,
                               fate_slices_up=-(-row["up_bytes"] // (1 << 20)))
                    emit(row)
                    rows.append(row)
                    if method == "fate-rdma" and args.channel_alone:
                        # the one-buffer baseline, and the arrays one beside it (their order alternating with the
                        # pairs, as the methods' does)
                        kinds = [False, True][:2 if args.channel_alone_arrays else 1]
                        for arrays in kinds if pair % 2 == 0 else kinds[::-1]:
                            base_row = _channel_alone_row(row, args, rounds, data_path, arrays)
                            emit(base_row)
                            rows.append(base_row)
    for r in rows:
        r["size"] = human_bytes(r["up_bytes"]) + " up / " + human_bytes(r["down_bytes"]) + " down"
        r["peak_rss"] = human_bytes(r["peak_rss_bytes"]) if r["peak_rss_bytes"] else "-"
    for r in rows:
        r["chunks"] = (f"~{r['chunks_up']} x {human_bytes(r.get('chunk_bytes') or CHUNK)}" if r["method"] != "fate"
                       else f"{r['fate_slices_up']} x 1 MiB slices")
    table(rows, ["payload", "scale", "method", "mode", "provider", "path", "descriptors", "size", "chunks", "pair", "rounds",
                 "round_comm_seconds", "peak_rss", "verified"])
    print_breakdowns(rows, pairs)
    print_late_starts(rows)
    print(f"malloc huge pages: {'on' if huge else 'off'} in FATE's own jobs and fate-rdma's alike (they speed up FATE's "
          f"own path too: compare runs with the same --huge-pages)")
    ok = True
    for (scale, rank, ms), data_path in [(c, p) for c in cases for p in paths]:
        for line in verdicts([r for r in rows if r["scale"] == scale and r["lora_rank"] == rank], data_path):
            print(line)
    if not all(r["verified"] for r in rows):
        print("bench fate: an average did not match the expected one", file=sys.stderr)
        ok = False
    return 0 if ok else 1
