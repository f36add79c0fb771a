"""`bench fate`'s report: the targets' verdicts (each ratio the median of the repetitions' own ratios, with
the second channel-alone baseline's decomposition where it ran), and where fate-rdma's round went per party."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

from fate_rdma_lab.bench.report import EMULATED_TAG, emit, human_bytes, median

TARGET_RATIO = 8.0  # FATE / fate-rdma, communication per round
CHANNEL_ALONE_TARGET = 1.5  # fate-rdma / the channel alone for the same bytes
#: the fate-rdma wrapper's timers (fate_rdma/federation/wrapper.py), in the order a round meets them
TIMERS = ("frame_seconds", "put_copy_seconds", "send_seconds", "descriptor_push_seconds", "descriptor_wait_seconds",
          "payload_wait_seconds", "unframe_seconds")


def pair_ratios(rows: List[Dict[str, Any]], data_path: str, num: str, den: str) -> List[Tuple[float, float, float]]:
    """(round seconds of method `num` / those of `den`, num's, den's) for each repetition (`pair`) of one
    case (`rows`: one scale and rank) in which both ran; FATE's own rows have path "-"."""
    out = []
    for k in sorted({r["pair"] for r in rows}):
        by = {r["method"]: r for r in rows if r["pair"] == k and r["path"] in ("-", data_path)}
        if num in by and den in by:
            a, b = by[num]["round_comm_seconds"], by[den]["round_comm_seconds"]
            out.append((a / b, a, b))
    return out


def _secs(x: float) -> str:
    """A round's time for a verdict line: seconds, or milliseconds below 0.1 s (LoRA's small ranks)."""
    return f"{x:.2f} s" if x >= 0.1 else f"{x * 1e3:.1f} ms"


def verdicts(rows: List[Dict[str, Any]], data_path: str) -> List[str]:
    """The targets' verdicts for one case (`rows`: one scale and rank, every repetition) on `data_path`:
    FATE / fate-rdma and fate-rdma / the channel alone, each the median of the repetitions' own ratios
    (and each repetition's, when there are several); their JSON lines are emitted here."""
    lines: List[str] = []
    emu = any(r["emulated"] for r in rows if r["method"] == "fate-rdma")
    tag = EMULATED_TAG if emu else ""
    first = next((r for r in rows if r["method"] == "fate-rdma"), None)
    if first is None:
        return lines
    for num, den, target, key, above in (("fate", "fate-rdma", TARGET_RATIO, "fate_over_fate_rdma", True),
                                         ("fate-rdma", "channel-alone", CHANNEL_ALONE_TARGET,
                                          "fate_rdma_over_channel_alone", False)):
        got = pair_ratios(rows, data_path, num, den)
        if not got:
            continue
        ratio, a, b = median([g[0] for g in got]), median([g[1] for g in got]), median([g[2] for g in got])
        met = ratio >= target if above else ratio <= target
        emit({"bench": "fate", "summary": "ratio" if above else "integration", "payload": first["payload"],
              "scale": first["scale"], "path": data_path, key: ratio, "pairs": len(got),
              "per_pair": [round(g[0], 4) for g in got], "target": target, "met": met, "emulated": emu})
        each = f" (median of {len(got)} pairs: {', '.join(f'{g[0]:.2f}' for g in got)})" if len(got) > 1 else ""
        verdict = f"target {'>=' if above else '<='} {target:g}x: {'met' if met else 'NOT met'}"
        if above:
            lines.append(f"{first['payload']} at scale {first['scale']:g}, fate-rdma path {data_path}: communication per "
                         f"round FATE {_secs(a)}, fate-rdma {_secs(b)}: {ratio:.1f}x less{each} ({verdict}){tag}")
        else:
            lines.append(f"{first['payload']} at scale {first['scale']:g}, path {data_path}: fate-rdma round {_secs(a)}, "
                         f"the channel alone {_secs(b)} for the same bytes: {ratio:.2f}x{each} ({verdict}){tag}")
    lines += _decomposition(rows, data_path, first, emu, tag)
    return lines


def _decomposition(rows: List[Dict[str, Any]], data_path: str, first: Dict[str, Any], emu: bool,
                   tag: str) -> List[str]:
    """With the second baseline (--channel-alone-arrays): fate-rdma's round against the channel alone sending
    the payload as FATE's put hands it over (the integration's own cost), and that baseline against the one
    buffer (what the payload's memory and shape cost the channel). No target: a decomposition of the first."""
    own, shape = pair_ratios(rows, data_path, "fate-rdma", "channel-alone-arrays"), \
        pair_ratios(rows, data_path, "channel-alone-arrays", "channel-alone")
    if not own or not shape:
        return []
    x_own, x_shape = median([g[0] for g in own]), median([g[0] for g in shape])
    arrays = median([g[2] for g in own])
    n = next(r["tensors"] for r in rows if r["method"] == "fate-rdma")
    emit({"bench": "fate", "summary": "decomposition", "payload": first["payload"], "scale": first["scale"],
          "path": data_path, "fate_rdma_over_channel_alone_arrays": x_own,
          "channel_alone_arrays_over_channel_alone": x_shape, "pairs": len(own),
          "per_pair_fate_rdma_over_arrays": [round(g[0], 4) for g in own],
          "per_pair_arrays_over_channel_alone": [round(g[0], 4) for g in shape],
          "tensors": n, "emulated": emu})
    return [f"{first['payload']} at scale {first['scale']:g}, path {data_path}: the channel alone sending the payload "
            f"as FATE's put hands it over ({n} private arrays each way) {_secs(arrays)}: fate-rdma's round is "
            f"{x_own:.2f}x that (the integration's own cost), and it is {x_shape:.2f}x the one-buffer baseline (what the "
            f"payload's memory and shape cost the channel; medians of {len(own)} pair(s), no target){tag}"]


def print_breakdowns(rows: List[Dict[str, Any]], pairs: int) -> None:
    """Per fate-rdma job, where its round went per party (the wrapper's timers), and what arrived or was copied
    into fresh and into recycled memory."""
    for r in rows:
        if r["method"] == "fate-rdma" and r.get("breakdown"):
            print(f"where fate-rdma's round went, {r['payload']} at scale {r['scale']:g}, path {r['path']}"
                  + (f", repetition {r['pair']}" if pairs > 1 else "") + " (seconds per round; waits include the other "
                  "parties)" + (EMULATED_TAG if r.get("emulated") else "") + ":")
            print("  party     " + "".join(f"{k.replace('_seconds', ''):>17}" for k in TIMERS))
            for role, t in r["breakdown"].items():
                print(f"  {role:<9} " + "".join(f"{t[k]:>17.3f}" for k in TIMERS))
            print("  received lent in place (FedRDMA-E slot, no copy) / into fresh memory / recycled buffers, whole "
                  "job: " + ", ".join(f"{role} {human_bytes(t['lent_recv_bytes'])} / {human_bytes(t['fresh_recv_bytes'])} / "
                                      f"{human_bytes(t['reused_recv_bytes'])}"
                for role, t in r["breakdown"].items()))
            print("  put copies into fresh memory / recycled buffers, whole job: " + ", ".join(
                f"{role} {human_bytes(t['fresh_put_copy_bytes'])} / {human_bytes(t['reused_put_copy_bytes'])}"
                for role, t in r["breakdown"].items()))


def print_late_starts(rows: List[Dict[str, Any]]) -> None:
    """A note where a round's start instant reached a client late (its round is timed from then)."""
    late = [r for r in rows if r.get("start_late_seconds", 0) > 0]
    if late:
        print(f"note: in {len(late)} job(s) a round's start instant reached a client late (typically the first round's, "
              f"as the parties connect; at most "
              f"{max(r['start_late_seconds'] for r in late) * 1e3:.1f} ms): that client's upload began late, and its round is "
              f"timed from then (the other client's includes waiting for it)"
              + (EMULATED_TAG if any(r.get("emulated") for r in late) else ""))
