"""`fate-rdma site check`: before any job, does this site reach every peer of its site file, and do they prove
who they are? For each peer: connect and authenticate (as a task would: this site's party name, its secret or
certificate), then a verified transfer each way (the peer echoes it), and what came of it: reachable, identity
proven (by certificate, by the shared secret, or not at all on loopback), connect time, RTT, rate, MTU, provider
and data path; or the stage that failed and its likely cause, named (refused, no answer, wrong CA, clocks apart,
another secret).

The peer answers only where `fate-rdma site check --serve` runs at its site (on its party's endpoint address,
which a running job holds: check before jobs, or between them). A job's endpoint takes the check's connection
and transfer but does not echo: the check then says so.
"""
from __future__ import annotations

import dataclasses
import os
import re
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from ..channel import Endpoint
from ..errors import AuthenticationError, FateRdmaError, PeerUnreachable, TransferTimeout
from .config import RdmaFederationConfig

#: the metadata key of a check's payload (and of its echo)
KEY = "fate_rdma_site_check"


@dataclasses.dataclass
class PeerResult:
    party: str
    address: str
    ok: bool = False
    stage: str = "connect"  # where it stopped: connect, identity, transfer, echo, or done
    why: str = ""
    identity: str = ""
    connect_s: Optional[float] = None
    rtt_s: Optional[float] = None
    seconds: Optional[float] = None
    nbytes: int = 0
    provider: str = ""
    path: str = ""
    mtu: Optional[int] = None

    def line(self) -> str:
        head = f"{self.party} at {self.address}: "
        if not self.ok:
            return head + f"FAILED at {self.stage}: {self.why}"
        rtt = "same host" if not self.rtt_s else f"{self.rtt_s * 1e3:.2f} ms"
        rate = self.nbytes * 2 * 8 / self.seconds / 1e9 if self.seconds else 0.0
        return (head + f"ok: reachable, {self.identity}; connect {self.connect_s or 0.0:.3f} s, RTT {rtt}, "
                f"{self.nbytes} bytes out and back verified in {self.seconds or 0.0:.3f} s ({rate:.2f} Gbit/s), "
                f"provider {self.provider}, path {self.path}, MTU {self.mtu}")


def explain(exc: BaseException, address: str, timeout_s: float) -> str:
    """The likely cause of a failed connect or proof, in words an operator acts on."""
    text = str(exc)
    low = text.lower()
    if "refused" in low and isinstance(exc, PeerUnreachable):
        return (f"connection refused: nothing listens at {address} (is `fate-rdma site check --serve` running at "
                f"that site, on the right port?) [{text}]")
    data_port = re.search(r"cannot reach peer NIC (\S+): (.*?) \(the peer's soft data port", text)
    if data_port:  # (the bootstrap port answered: the soft provider's data connection did not)
        return (f"the endpoint at {address} answered, but its soft data port {data_port.group(1)} did not "
                f"({data_port.group(2)}): open that site's soft_data_ports to this host in its firewall [{text}]")
    silent = ("timed out", "timeout", "no answer", "not done within", "closed", "connection lost")
    if isinstance(exc, PeerUnreachable) and any(w in low for w in silent):
        return (f"no answer from {address} within {timeout_s:g} s: a firewall dropping the port, a wrong address, "
                f"or something else listening there [{text}]")
    if isinstance(exc, AuthenticationError):
        if "not yet valid" in low or "expired" in low:
            return (f"identity not proven: a certificate outside its validity (are the two hosts' clocks apart?) "
                    f"[{text}]")
        if "certificate" in low or "tls" in low or "ssl" in low:
            return (f"identity not proven: TLS refused (a certificate from another CA than this site's tls_ca, or one "
                    f"that does not name the party at {address}?) [{text}]")
        if "secret" in low or "prove" in low:
            return f"identity not proven: the proof failed (the two sites hold different secret files?) [{text}]"
        return f"identity not proven: {text}"
    return text


def _endpoint(cfg: RdmaFederationConfig, party: str, port: Optional[int]) -> Endpoint:
    me = cfg.endpoints[party]
    host, _, own_port = me.rpartition(":")
    return Endpoint(cfg.channel, cfg.listen_host or host, int(own_port) if port is None else port, name=me,
                    allowed_peers=set(cfg.endpoints.values()) - {me},
                    party_names={addr: p for p, addr in cfg.endpoints.items()})


def serve(cfg: RdmaFederationConfig, party: str, stop: threading.Event,
          say: Callable[[str], None] = print) -> None:
    """Answer checks on `party`'s endpoint (echo each check's payload to its sender) until `stop` is set."""
    with _endpoint(cfg, party, None) as ep:
        say(f"fate-rdma site check: answering checks for {party} at {ep.address} ({ep.label}); Ctrl-C stops")
        while not stop.is_set():
            try:
                msg = ep.recv(timeout=0.5)
            except TransferTimeout:
                continue
            md = msg.metadata if isinstance(msg.metadata, dict) else {}
            try:
                if KEY not in md:
                    continue
                data = bytes(msg.view)
            finally:
                msg.release()
            try:
                ep.send(msg.peer, data, {KEY: md[KEY], "echo": True}).result(cfg.channel.transfer_timeout_s)
                say(f"answered a check from {msg.peer} ({len(data)} bytes)")
            except (FateRdmaError, OSError) as exc:  # (TimeoutError too: one check's failure ends no serving)
                say(f"could not answer the check from {msg.peer}: {exc}")


def _identity(cfg: RdmaFederationConfig, conn: Any) -> str:
    if not conn.identity.authenticated:
        return "NOT authenticated (no secret_file, no tls: loopback only)"
    if cfg.channel.tls:
        return "identity proven by its certificate (mutual TLS)"
    return "identity proven by the federation's shared secret (members can impersonate each other)"


def check(cfg: RdmaFederationConfig, party: str, nbytes: int = 1 << 20, timeout_s: float = 20.0,
          peers: Optional[List[str]] = None) -> List[PeerResult]:
    """Check every peer of `party` (or those of `peers`), one after another."""
    results: List[PeerResult] = []
    others = [p for p in cfg.endpoints if p != party and (peers is None or p in peers)]
    # a peer host that takes the connection and says nothing is waited for `timeout_s`, not the patience a task
    # gives a held peer (no_progress_timeout_s)
    cfg = dataclasses.replace(cfg, channel=dataclasses.replace(
        cfg.channel, no_progress_timeout_s=min(cfg.channel.no_progress_timeout_s, timeout_s)))
    with _endpoint(cfg, party, 0) as ep:
        mtu = next(iter(ep.ctx.query().ports), None)
        for p in others:
            r = PeerResult(p, cfg.endpoints[p], mtu=mtu.mtu if mtu is not None else None)
            results.append(r)
            t0 = time.monotonic()
            try:
                conn = ep.connect(r.address)
            except (FateRdmaError, OSError) as exc:
                r.stage = "identity" if isinstance(exc, AuthenticationError) else "connect"
                r.why = explain(exc, r.address, max(cfg.channel.connect_timeout_s, timeout_s))
                continue
            r.connect_s = time.monotonic() - t0
            r.identity, r.provider, r.path = _identity(cfg, conn), conn.where["provider"], conn.path_kind.value
            deadline = time.monotonic() + 2.0  # (the connection's RTT probe: answered within a round trip)
            while not conn.near and not ep.round_trip_s(r.address) and time.monotonic() < deadline:
                time.sleep(0.02)
            r.rtt_s = ep.round_trip_s(r.address)
            data, nonce = os.urandom(nbytes), os.urandom(8).hex()
            r.stage, t1 = "transfer", time.monotonic()
            try:
                ep.send(r.address, data, {KEY: nonce}).result(timeout_s)
            except (FateRdmaError, OSError) as exc:
                r.why = f"the check's transfer to {r.address} failed: {exc}"
                continue
            r.stage = "echo"
            try:
                while True:
                    msg = ep.recv(timeout=max(0.1, timeout_s - (time.monotonic() - t1)))
                    md: Dict[str, Any] = msg.metadata if isinstance(msg.metadata, dict) else {}
                    same = md.get(KEY) == nonce and bytes(msg.view) == data
                    mine = md.get(KEY) == nonce
                    msg.release()
                    if mine:
                        break
            except TransferTimeout:
                r.why = (f"{r.address} took the check's {nbytes} bytes but sent nothing back within {timeout_s:g} s: "
                         f"is it `fate-rdma site check --serve`? (a job's endpoint does not answer checks)")
                continue
            if not same:
                r.why = f"the bytes {r.address} sent back differ from those sent"
                continue
            r.seconds, r.nbytes, r.ok, r.stage = time.monotonic() - t1, nbytes, True, "done"
    return results
