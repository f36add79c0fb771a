"""What an endpoint's settings protect and what not, in words: logged when an endpoint starts, printed by
`fate-rdma doctor --config`. docs/security.md is the long form."""
from __future__ import annotations

from typing import List, Optional, Tuple

from ..config import ChannelConfig, is_loopback_host
from ..protocol.integrity import KEYED

#: (level, line): level "ok", "note" or "warning" (a warning is what an operator should act on)
Line = Tuple[str, str]


def posture(cfg: ChannelConfig, host: Optional[str] = None) -> List[Line]:
    """The security posture of an endpoint with `cfg` listening on `host` (None: not known, as in a configuration
    read by doctor; the lines that depend on it then say so)."""
    off_loopback = host is None or not is_loopback_host(host)
    where = "" if host is not None else " (where it listens off loopback)"
    out: List[Line] = []
    if cfg.secret_file and cfg.tls:
        out.append(("ok", "peers: each proves the federation's secret (HMAC-SHA256) and its party by certificate "
                          "(mutual TLS 1.3)"))
    elif cfg.tls:
        out.append(("ok", "peers: each proves its party by certificate (mutual TLS 1.3)"))
    elif cfg.secret_file:
        out.append(("ok", "peers: each proves the federation's secret (HMAC-SHA256)"))
        if off_loopback:
            allowed = "shared_secret_only: true" if cfg.shared_secret_only else "refused to start unless " \
                "shared_secret_only: true"
            out.append(("warning", f"shared secret only{where} ({allowed}): members can impersonate each other (any "
                                   f"holder of the secret can claim another party's name); between sites set tls: "
                                   f"true with each party's certificate (fate-rdma tls request, then sign at the CA)"))
    else:
        out.append(("warning", "peers: NOT authenticated (no secret_file, no tls): loopback only, any local process "
                               "can connect"))
    if cfg.keyed:
        out.append(("ok", "set-up messages and control frames: sealed (a MAC and a sequence number each, under the "
                          "connection's session key)"))
    else:
        out.append(("note", "set-up messages and control frames: not sealed (no session key)"))
    if cfg.checksum in KEYED:
        out.append(("ok", f"payloads: {cfg.checksum}, a MAC under each connection's key: a relay cannot alter them"))
    elif cfg.keyed and off_loopback:
        out.append(("warning", f"payloads: {cfg.checksum}, UNKEYED (integrity: {cfg.integrity}): a relay on the path "
                               f"can alter weights and recompute it"))
    else:
        out.append(("note", f"payloads: {cfg.checksum} (against accidents, not a forger)"))
    if cfg.tls:
        out.append(("ok", "confidentiality: the bootstrap and the soft provider's data connections are encrypted "
                          "(TLS 1.3); on an RDMA device the payloads are not (the MAC still protects them)"))
    else:
        out.append(("note", "confidentiality: none (weights and memory keys travel in clear; tls: true encrypts "
                            "the soft provider's connections)"))
    if cfg.resume_window_s > 0:
        out.append(("ok", f"dropped links: a transfer whose connection breaks is resumed on a new one within "
                          f"resume_window_s ({cfg.resume_window_s:g} s), the peers authenticated anew, what the "
                          f"receiver holds told in {'sealed ' if cfg.keyed else ''}control frames"))
    else:
        out.append(("warning", "dropped links: NOT resumed (resume_window_s: 0): a connection that breaks fails its "
                               "transfers, and the FATE task with them"))
    return out
