"""`easypyverbs doctor` / `fate-rdma doctor`: what this machine offers for verbs, and why."""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, List

from .device import choose_provider
from .providers import pyverbs_provider as pv
from .api import SOFT_LABEL


def report() -> Dict[str, Any]:
    ok, why, devices = pv.status()
    out: Dict[str, Any] = {
        "python": f"{sys.version.split()[0]} ({sys.executable})",
        "pyverbs": {"importable": ok, "location": pv.version() if ok else "", "detail": why,
                    "enums_module": _enums_name() if ok else ""},
        "devices": [],
        "soft": {"available": True, "label": SOFT_LABEL, "emulated": True,
                 "link_model_env": os.environ.get("EASYPYVERBS_SOFT_LINK", ""),
                 "same_host_path": _same_host(), "write_digests": True, "deferred_answers": _deferred_answers()},
    }
    for name in devices:
        try:
            from .providers.pyverbs_provider import PyverbsContext

            with PyverbsContext(name) as ctx:
                info = ctx.query()
                windows = ctx.memory_windows
            out["devices"].append({
                "name": name, "max_mr_bytes": info.max_mr_bytes, "max_qp_wr": info.max_qp_wr,
                "max_mw": info.max_mw, "label": info.notes or f"pyverbs ({name})",
                "revocable_grants": "memory window" if windows else "registered anew",
                "ports": [{"port": p.port_num, "state": p.state, "mtu": p.mtu, "max_msg_bytes": p.max_msg_bytes,
                           "lid": p.lid, "link_layer": p.link_layer,
                           "gids": [{"index": i, "gid": g, "type": t} for i, g, t in p.gids]} for p in info.ports],
            })
        except Exception as exc:  # report, don't crash: doctor must explain
            out["devices"].append({"name": name, "error": str(exc)})
    chosen, reason = choose_provider("auto")
    out["auto"] = {"provider": chosen, "reason": reason}
    out["usable"] = True  # the soft provider always works
    return out


def _enums_name() -> str:
    try:
        import pyverbs.libibverbs_enums  # noqa: F401

        return "pyverbs.libibverbs_enums (rdma-core >= 57)"
    except ImportError:
        return "pyverbs.enums (rdma-core < 57)"


def render(rep: Dict[str, Any]) -> str:
    lines: List[str] = ["easypyverbs doctor", f"  python      {rep['python']}"]
    p = rep["pyverbs"]
    if p["importable"]:
        lines.append(f"  pyverbs     importable from {p['location']} [{p['enums_module']}]")
    else:
        lines.append(f"  pyverbs     NOT importable: {p['detail']}")
    if rep["devices"]:
        for d in rep["devices"]:
            if "error" in d:
                lines.append(f"  device      {d['name']}: cannot open: {d['error']}")
                continue
            lines.append(f"  device      {d['name']} (max MR {d['max_mr_bytes']} B, max QP WR {d['max_qp_wr']}, "
                         f"memory windows {d['max_mw'] or 'none'}): {d['label']}")
            why = ("EASYPYVERBS_MEMORY_WINDOWS=off: registered anew instead" if d["revocable_grants"] == "memory window"
                   else "EASYPYVERBS_MEMORY_WINDOWS=off" if d["max_mw"] else "the device has no memory windows")
            lines.append(f"    revocable MRs (FedRDMA-E slot grants): {d['revocable_grants']} at each grant ({why})")
            for port in d["ports"]:
                lines.append(f"    port {port['port']}   {port['state']}, {port['link_layer']}, MTU {port['mtu']}, "
                             f"max_msg_sz {port['max_msg_bytes']}, LID {port['lid']}")
                empty = [g for g in port["gids"] if not g["gid"].replace("0", "").replace(":", "")]
                for g in port["gids"]:
                    if g not in empty:
                        lines.append(f"      GID[{g['index']}] {g['gid']} {g['type']}")
                if empty:
                    lines.append(f"      ({len(empty)} empty GID entries not shown; --json lists them)")
    else:
        lines.append(f"  devices     none ({p['detail']})")
    s = rep["soft"]
    lines.append(f"  soft        available: {s['label']} -- an emulation, not RDMA; figures from it are not RDMA "
                 f"figures")
    if s["link_model_env"]:
        lines.append(f"              link model from EASYPYVERBS_SOFT_LINK: {s['link_model_env']}")
    sh = s["same_host_path"]
    split = f"; copies of 2 MiB and more split over {sh['copy_threads']} threads"
    lines.append(f"              same-host path to peers on this machine (shared memory mapped, else "
                 f"process_vm_readv): {'on' if sh['on'] else 'off'} ({sh['why']}"
                 + (split if sh.get("copy_threads", 1) > 1 else "")
                 + "); EASYPYVERBS_SOFT_SAME_HOST=off forces TCP")
    if sh["on"]:
        lines.append(f"              shared memory (memfd senders' buffers, read through a mapping at memcpy speed): "
                     f"{'on' if sh.get('shared_memory') else 'off'} ({sh.get('shared_memory_why', '')})")
        lines.append(f"              push (the sender copies WRITEs of {sh.get('push_min_bytes', 0) >> 20} MiB and "
                     f"more into a receiver's shared-memory slots itself, another process of this host): "
                     f"{'on' if sh.get('push') else 'off'}; a receiver takes it only while it copies another WRITE "
                     f"(else it reads faster itself); EASYPYVERBS_SOFT_PUSH=always: every one, off: none")
    lines.append("              WRITEs into tracked MRs digested as they land (MR.track_writes: fate-rdma's "
                 "receive slots check crc32c/xxh3 with no second pass over all but the short last block)")
    from .providers.soft.responder import DEFERRED_ACK_S

    lines.append(f"              deferred answers (a control frame's transport answer rides a later one's, or waits up "
                 f"to {DEFERRED_ACK_S * 1e3:g} ms): {'on' if s['deferred_answers'] else 'off'}; "
                 f"EASYPYVERBS_SOFT_DEFER_ACK=off turns them off")
    lines.append(f"  auto picks  {rep['auto']['provider']}: {rep['auto']['reason']}")
    return "\n".join(lines)


def _deferred_answers() -> bool:
    from .providers.soft import wire

    return wire.defer_ack_enabled()


def _same_host() -> Dict[str, Any]:
    from .providers.soft import samehost, shm

    ok, why = samehost.available()
    if not samehost.enabled_by_env():
        return {"on": False, "why": why}
    shm_ok, shm_why = shm.self_test() if ok else (False, "the same-host path is off")
    from .providers.soft.requester import PUSH_MIN_BYTES

    return {"on": ok, "why": why, "copy_threads": samehost.COPY_THREADS, "shared_memory": shm_ok,
            "shared_memory_why": shm_why, "push": bool(ok and shm.push_enabled()),
            "push_min_bytes": PUSH_MIN_BYTES}


def main(argv: List[str]) -> int:
    as_json = "--json" in argv
    rep = report()
    print(json.dumps(rep, indent=2) if as_json else render(rep))
    return 0 if rep["usable"] else 1
