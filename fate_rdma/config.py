"""Channel configuration: one frozen dataclass that rejects inconsistent values.

Loaded from YAML (`conf/`) only at the edges (CLI, FATE glue); library code receives the object.
Defaults and the network each was chosen for are written beside them (STYLE.md §4).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple, Union

from .errors import ConfigError

MiB = 1 << 20
MODES = ("fedrdma", "fedrdma-e")


def port_range(text: Any) -> Optional[Tuple[int, int]]:
    """(low, high) of a "LOW-HIGH" port range (a single port: "P"), or None where it is not one."""
    low, _, high = str(text).strip().partition("-")
    high = high or low
    if not (low.strip().isdigit() and high.strip().isdigit()):
        return None
    lo, hi = int(low), int(high)
    return (lo, hi) if 1 <= lo <= hi <= 65535 else None


def resolve_checksum(checksum: str, keyed: bool) -> str:
    """What checksum "auto" means: a keyed MAC where connections have a session key (`keyed`: a secret_file or
    TLS), else XXH3; any other value stands."""
    return ("blake3" if keyed else "xxh3") if checksum == "auto" else checksum


def is_loopback_host(host: str) -> bool:
    """Is `host` (a name or address as written in a configuration) this machine's loopback? (easypyverbs'
    is_loopback: "localhost" or a loopback address, 127.0.0.0/8, ::1, [::1]; any other name is not)"""
    from easypyverbs.admission import is_loopback

    return is_loopback(host)


def _tls_files_problem(cert: Optional[str], key: Optional[str], ca: Optional[str]) -> Optional[str]:
    """What is wrong with tls: true's files (None: nothing). Reads permissions only, never the key."""
    import os
    import stat

    if not (cert and key and ca):
        missing = [n for n, v in (("tls_cert", cert), ("tls_key", key), ("tls_ca", ca)) if not v]
        return (f"tls: true needs tls_cert, tls_key and tls_ca (PEM files; `fate-rdma tls init` makes them); "
                f"missing {', '.join(missing)}")
    for name, path in (("tls_cert", cert), ("tls_key", key), ("tls_ca", ca)):
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            return f"{name} {path} cannot be read: {exc.strerror or exc}"
    mode = stat.S_IMODE(os.stat(key).st_mode)
    if mode & stat.S_IRWXO:
        return f"tls_key {key} is accessible to other users (mode {mode:o}); chmod 600 it"
    return None


#: no_progress_timeout_s unless set: longer than the longest GIL hold of a peer (see ChannelConfig)
NO_PROGRESS_DEFAULT_S = 120.0


@dataclasses.dataclass(frozen=True)
class ChannelConfig:
    #: "fedrdma-e" (receive-slot pool, zero copy) or "fedrdma" (staging + reassembly)
    mode: str = "fedrdma-e"
    #: 4 MiB: the paper's best chunk from 4 Gbit/s up; small enough to survive a lossy WAN per chunk
    chunk_bytes: int = 4 * MiB
    #: chunks in flight; "auto" = bandwidth-delay product / chunk (+1), from an RTT probe at connect time
    #: (an emulated path: 6 BDPs, policy.SOFTWARE_WINDOW_BDPS)
    window: Union[int, str] = "auto"
    #: upper bound of the automatic window; 64 x 4 MiB = 256 MiB covers 10 Gbit/s x 200 ms
    max_window: int = 64
    #: lower bound of the automatic window: keeps a fast LAN's pipeline busy when the BDP is under a chunk
    min_auto_window: int = 4
    #: queue pairs per peer, chunks striped across them (several NIC ports or paths where present; the
    #: soft provider opens one TCP stream per QP). "auto": up to AUTO_QPS_MAX are set up, and once the
    #: RTT probe has measured the path, 1 is used below LONG_PATH_RTT_S and all of them above it: on a
    #: long path three clients sending to one arbiter at once finish within 10 % of each other where one
    #: stream each did not (`fate-rdma eval fairness`). It does not speed up one transfer: on a lossy
    #: long link under bbr one QP was faster than four since the automatic window keeps 6 BDP
    #: (`fate-rdma eval link --study qps`, docs/RESULTS.md section 2); set 1 where clients do not share
    #: a link. To a peer on this host (policy.one_host) without
    #: a link model, auto sets up one QP: there is no path to stripe over (with four set up, a same-host
    #: FATE round took 0.41 s against 0.25 s, cause not traced). The default; a number is taken as set
    qps_per_peer: Union[int, str] = "auto"
    #: Link-Enable (paper §4.3): one MTU-sized chunk first; "auto" = on from 4 Gbit/s nominal rate, off on the
    #: soft provider without its link model (same host, or its TCP streams: no link to bring up)
    link_enable: Union[bool, str] = "auto"
    #: nominal link rate for the automatic window; None = the soft link model's rate, else 10 Gbit/s
    link_rate_bps: Optional[float] = None
    #: what this endpoint requires of every transfer it receives (and sends with; both sides must agree):
    #: "auto" (the default) a keyed MAC ("blake3") wherever connections have a session key (secret_file or
    #: tls), else "xxh3"; "blake3" a keyed BLAKE3 MAC of the payload, metadata and header fields, keyed per
    #: connection and direction (a relay on the path can neither alter nor re-tag a payload); "blake2b" the
    #: same with BLAKE2b (~5 x BLAKE3's CPU here; for parties that predate blake3); "xxh3" an
    #: XXH3-128 tag (against accidents only: anyone can recompute it), "crc32c" (32 bits), or "none". An
    #: endpoint that listens off loopback with a secret or TLS takes an unkeyed one only under
    #: `integrity: unkeyed`
    checksum: str = "auto"
    #: "keyed" (the default): an endpoint listening off loopback whose connections are authenticated (secret_file
    #: or tls) refuses to start with an unkeyed checksum (xxh3, crc32c, none), which a relay on the path could
    #: recompute over altered weights; "unkeyed": allow it there (site only; logged at start as a warning)
    integrity: str = "keyed"
    #: FedRDMA-E receive slots per peer, and the largest payload one slot takes: a slot grows to it on
    #: demand (the sender asks before its first WRITE; the receiver reserves from memory_budget_bytes)
    pool_slots: int = 2
    slot_bytes: int = 256 * MiB
    #: a slot's room at connect and after it shrinks: 1 MiB takes FATE's small objects (metadata, scalars,
    #: small tensors) without a grow round trip; an idle peer costs pool_slots x (this + 64 KiB metadata area)
    slot_initial_bytes: int = 1 * MiB
    #: after this long without a transfer arriving, growing or being released, the receiver asks for its
    #: grown slots back and shrinks them to slot_initial_bytes; 0 = never. 30 s: longer than the gaps
    #: within one FedAvg exchange, so a round does not pay twice; an exchange after a shrink pays a GROW
    #: round trip and faults its slot's pages in again (~0.3-1.4 s/GB, the same as the first round)
    pool_idle_s: float = 30.0
    #: FedRDMA: largest payload accepted (the destination is allocated per transfer)
    max_payload_bytes: int = 64 << 30
    #: FedRDMA: reassembly buffers kept for reuse once nothing refers to them (fresh memory costs a page
    #: fault per 4 KiB, ~1.4 s/GB on small VMs); at most this many bytes stay resident, 0 = no reuse; one
    #: unused for pool_idle_s is let go of (buffers.RecvBuffers.trim)
    recv_cache_bytes: int = 4 << 30
    #: FedRDMA-E payload larger than a slot: "error" (PayloadTooLarge) or "fedrdma" (send that one chunked+staged)
    too_large: str = "error"
    #: a transfer whose peer shows no progress this long fails. Not shorter than the peer's longest hold: code
    #: that keeps its process's GIL (FATE's secure aggregation sums a client's model in one call: ~9 s for
    #: GPT-2 small on a 2-core VM, more for larger models) stops its channel meanwhile (easypyverbs.stalls;
    #: the held process logs each hold). A peer that is gone ends the transfer at once, whatever this says
    no_progress_timeout_s: float = NO_PROGRESS_DEFAULT_S
    #: a transfer not done this long after it started fails (TransferTimeout), whatever its progress
    transfer_timeout_s: float = 3600.0
    connect_timeout_s: float = 10.0
    #: a connection that breaks mid-transfer (a reset, a route flap, a peer host paused) is dialed again for
    #: this long, with backoff; the peers authenticate anew and the sender sends only what the receiver does not
    #: hold verified (FedRDMA: its first bytes; FedRDMA-E: its last, in the old receive slot), each transfer
    #: delivered once. Both ends keep the transfers' state meanwhile, within the memory budget. 0 = off: a
    #: broken connection fails its transfers at once (docs/operations.md, "Dropped links")
    resume_window_s: float = 60.0
    #: verbs provider: "auto", "pyverbs" or "soft"; device name for pyverbs
    provider: str = "auto"
    device: Optional[str] = None
    #: soft provider link model, e.g. "rate=10gbit,rtt=20ms" (emulation only)
    soft_link: Optional[str] = None
    #: soft provider: to a peer on this machine, copy payloads straight from the sender's memory (through a
    #: mapping where it is shared memory, as the FATE wrapper's put copies are, else process_vm_readv)
    #: instead of through loopback TCP; false = TCP, as between hosts. EASYPYVERBS_SOFT_SAME_HOST=off in the
    #: environment switches it off too (every endpoint of the process, whatever this says)
    same_host: bool = True
    #: FedRDMA-E's chunk on that same-host path, where a chunk is only a unit of copying (no wire to pace)
    #: and each costs a request, an answer and thread switches: 64 MiB is the smallest chunk that gets all
    #: of the gain of fewer chunks (docs/benchmarks.md). At least chunk_bytes; 0 = chunk_bytes
    same_host_chunk_bytes: int = 64 * MiB
    #: FedRDMA-E's chunk on the soft provider's TCP path with no link model (sites without RDMA NICs, or
    #: same_host off) once the RTT probe has measured a short path (< 10 ms: a LAN, this host): TCP cuts and
    #: resends the bytes, so a chunk is only a unit of a WRITE, and each costs a request, an ACK and Python
    #: time at the sender: larger chunks cost less per byte (docs/benchmarks.md). A long path, an RDMA device
    #: and the link model keep chunk_bytes.
    #: At least chunk_bytes; 0 = chunk_bytes
    tcp_chunk_bytes: int = 32 * MiB
    #: progress bar for long transfers (CLI); off in library use
    progress: bool = False
    #: peer authentication: "auto" = HMAC-SHA256 challenge-response when secret_file is set, else none;
    #: "hmac" requires secret_file; without a secret an endpoint may only listen on loopback
    auth: str = "auto"
    #: file holding the federation's shared secret (hex or raw, >= 16 bytes, mode 600): per site, never
    #: in a job conf; `fate-rdma secret FILE` writes one
    secret_file: Optional[str] = None
    #: mutual TLS 1.3 on the bootstrap connections and (soft provider) the data connections, for links
    #: that are not private; each side's certificate must name its party (commonName or URI SAN
    #: "fate-rdma:<party>"); `fate-rdma tls init` makes a CA and the parties' certificates
    tls: bool = False
    #: an endpoint that listens off loopback authenticates its peers by certificate (tls: true); false (the default)
    #: refuses to start it on the federation's shared secret alone. true allows that (site only, logged as a warning):
    #: members can impersonate each other, since every party holds the secret and may claim another's name
    shared_secret_only: bool = False
    #: PEM files, per site (never in a job conf): this party's certificate, its key (not readable by
    #: other users), the federation CA's certificate
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None
    tls_ca: Optional[str] = None
    #: handshakes of not-yet-authenticated peers at once; more connections are closed at accept
    max_pending_handshakes: int = 16
    #: receive memory (FedRDMA-E pools, FedRDMA staging and reassembly) one endpoint may hold;
    #: None = half of this machine's memory. A peer or transfer that would exceed it is refused.
    memory_budget_bytes: Optional[int] = None
    #: the most of memory_budget_bytes one peer may hold (its receive slots, staging and reassembly buffers, on
    #: all of its connections), so that one party cannot take what the others need; a refusal tells the peer
    #: only that it is over this endpoint's limit for it. 0.5: an arbiter receives from every client at once, and
    #: N >= 2 uploads that fit the budget together are each at most 1/N <= 1/2 of it, so no FedAvg job that
    #: fits is refused, while one client never holds more than half and the others share the rest. A party
    #: that receives from one peer only (a FedAvg client, a two-party job) uses at most half its budget: size
    #: memory_budget_bytes for twice that peer's largest payload there, or raise this to 1.0 at a site with one
    #: peer. An arbiter of N >= 3 clients whose budget is tight may lower it to 1/N: each client is then sure of
    #: its upload whatever the others do (docs/security.md)
    peer_budget_fraction: float = 0.5
    #: Prometheus metrics (site only): a folder where this site's processes write their samples for the site's
    #: exporter (`fate-rdma exporter --dir` the same folder; docs/operations.md#metrics); None: off
    metrics_dir: Optional[str] = None
    #: the soft provider's data listener (its emulated NIC, one per process with an endpoint): the first free
    #: port of "LOW-HIGH", so that a firewall can allow exactly those (site only); null: any free port
    soft_data_ports: Optional[str] = None
    #: the line each transfer of 1 MiB or more leaves in the log (logger fate_rdma.transfers, INFO): "text", or
    #: "json" (one JSON object: peer, bytes, seconds, gbit_s, mode, provider, path, integrity, ok, error)
    log_format: str = "text"

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ConfigError(f"fate-rdma config: {msg}")

        if self.mode not in MODES:
            bad(f"mode must be one of {MODES}, got {self.mode!r}")
        if not 4096 <= self.chunk_bytes <= 1 << 30:
            bad(f"chunk_bytes must be within [4096, 1 GiB], got {self.chunk_bytes}")
        if self.same_host_chunk_bytes and not 4096 <= self.same_host_chunk_bytes <= 1 << 30:
            bad(f"same_host_chunk_bytes must be 0 or within [4096, 1 GiB], got {self.same_host_chunk_bytes}")
        if self.tcp_chunk_bytes and not 4096 <= self.tcp_chunk_bytes <= 1 << 30:
            bad(f"tcp_chunk_bytes must be 0 or within [4096, 1 GiB], got {self.tcp_chunk_bytes}")
        if self.window != "auto" and (not isinstance(self.window, int) or isinstance(self.window, bool)
                                      or self.window < 1):
            bad(f"window must be 'auto' or an integer >= 1, got {self.window!r}")
        if not 1 <= self.min_auto_window <= self.max_window <= 1024:
            bad(f"need 1 <= min_auto_window <= max_window <= 1024, got {self.min_auto_window}, {self.max_window}")
        if isinstance(self.window, int) and self.window > self.max_window:
            bad(f"window {self.window} exceeds max_window {self.max_window}")
        if self.qps_per_peer != "auto" and (isinstance(self.qps_per_peer, bool)
                                            or not isinstance(self.qps_per_peer, int)
                                            or not 1 <= self.qps_per_peer <= 16):
            bad(f"qps_per_peer must be 'auto' or within [1, 16], got {self.qps_per_peer!r}")
        if self.link_enable not in (True, False, "auto"):
            bad(f"link_enable must be true, false or 'auto', got {self.link_enable!r}")
        if self.link_rate_bps is not None and self.link_rate_bps <= 0:
            bad("link_rate_bps must be positive")
        if self.checksum not in ("auto", "crc32c", "xxh3", "blake3", "blake2b", "none"):
            bad(f"checksum must be 'auto', 'crc32c', 'xxh3', 'blake3', 'blake2b' or 'none', got {self.checksum!r}")
        object.__setattr__(self, "checksum", resolve_checksum(self.checksum, self.keyed))
        if self.checksum in ("blake3", "blake2b") and not self.keyed:
            bad(f"checksum: {self.checksum} needs authenticated connections (secret_file or tls): its MAC is keyed "
                f"by the session key that each authenticated connection derives")
        if self.integrity not in ("keyed", "unkeyed"):
            bad(f"integrity must be 'keyed' or 'unkeyed', got {self.integrity!r}")
        if not 1 <= self.pool_slots <= 1024:
            bad(f"pool_slots must be within [1, 1024], got {self.pool_slots}")
        if self.slot_bytes < 1:
            bad("slot_bytes must be positive")
        if isinstance(self.slot_initial_bytes, bool) or not isinstance(self.slot_initial_bytes, int) \
                or self.slot_initial_bytes < 0:
            bad(f"slot_initial_bytes must be an integer >= 0, got {self.slot_initial_bytes!r}")
        if isinstance(self.pool_idle_s, bool) or not isinstance(self.pool_idle_s, (int, float)) \
                or not 0 <= self.pool_idle_s < float("inf"):
            bad(f"pool_idle_s must be >= 0 (0 = never shrink), got {self.pool_idle_s!r}")
        if self.too_large not in ("error", "fedrdma"):
            bad(f"too_large must be 'error' or 'fedrdma', got {self.too_large!r}")
        for name in ("no_progress_timeout_s", "transfer_timeout_s", "connect_timeout_s"):
            if getattr(self, name) <= 0:
                bad(f"{name} must be positive")
        if isinstance(self.resume_window_s, bool) or not isinstance(self.resume_window_s, (int, float)) \
                or not 0 <= self.resume_window_s < float("inf"):
            bad(f"resume_window_s must be >= 0 seconds (0 = off), got {self.resume_window_s!r}")
        if self.no_progress_timeout_s > self.transfer_timeout_s:
            if self.no_progress_timeout_s != NO_PROGRESS_DEFAULT_S:
                bad("no_progress_timeout_s exceeds transfer_timeout_s")
            # the default under a shorter total (a configuration written when the default was 30 s): the total
            object.__setattr__(self, "no_progress_timeout_s", float(self.transfer_timeout_s))
        if self.provider not in ("auto", "pyverbs", "soft"):
            bad(f"provider must be auto, pyverbs or soft, got {self.provider!r}")
        if self.soft_link and self.provider == "pyverbs":
            bad("soft_link applies to the soft provider only")
        if self.auth not in ("auto", "hmac", "none"):
            bad(f"auth must be auto, hmac or none, got {self.auth!r}")
        if self.auth == "hmac" and not self.secret_file:
            bad("auth: hmac needs secret_file (the federation's shared secret; `fate-rdma secret FILE` makes one)")
        if self.auth == "none" and self.secret_file:
            bad("auth: none and a secret_file contradict each other")
        if not isinstance(self.tls, bool):
            bad(f"tls must be true or false, got {self.tls!r}")
        if not isinstance(self.shared_secret_only, bool):
            bad(f"shared_secret_only must be true or false, got {self.shared_secret_only!r}")
        if self.tls:
            problem = _tls_files_problem(self.tls_cert, self.tls_key, self.tls_ca)
            if problem:
                bad(problem)
        if self.metrics_dir is not None and (not isinstance(self.metrics_dir, str) or not self.metrics_dir.strip()):
            bad(f"metrics_dir must be a folder's path or null, got {self.metrics_dir!r}")
        if self.soft_data_ports is not None and port_range(self.soft_data_ports) is None:
            bad(f"soft_data_ports must be LOW-HIGH with 1 <= LOW <= HIGH <= 65535, got {self.soft_data_ports!r}")
        if self.log_format not in ("text", "json"):
            bad(f"log_format must be text or json, got {self.log_format!r}")
        if not 1 <= self.max_pending_handshakes <= 1024:
            bad(f"max_pending_handshakes must be within [1, 1024], got {self.max_pending_handshakes}")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes < 1 << 20:
            bad(f"memory_budget_bytes must be at least 1 MiB, got {self.memory_budget_bytes}")
        if isinstance(self.peer_budget_fraction, bool) or not isinstance(self.peer_budget_fraction, (int, float)) \
                or not 0 < self.peer_budget_fraction <= 1:
            bad(f"peer_budget_fraction must be within (0, 1], got {self.peer_budget_fraction!r}")

    @property
    def keyed(self) -> bool:
        """Connections have a session key: they authenticate by the federation's secret or run inside TLS."""
        return bool(self.secret_file) or self.tls is True

    @property
    def budget_bytes(self) -> int:
        """memory_budget_bytes, or half of this machine's memory."""
        if self.memory_budget_bytes is not None:
            return self.memory_budget_bytes
        try:
            import os

            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
        except (ValueError, OSError, AttributeError):
            return 8 << 30

    @property
    def peer_budget_bytes(self) -> int:
        """The part of budget_bytes one peer may hold (peer_budget_fraction of it)."""
        return int(self.budget_bytes * self.peer_budget_fraction)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "ChannelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"fate-rdma config: unknown key(s) {', '.join(unknown)}; known: "
                              f"{', '.join(sorted(names))}")
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str, section: Optional[str] = "channel") -> "ChannelConfig":
        import yaml

        with open(path) as f:
            doc = yaml.safe_load(f) or {}
        if section:
            doc = doc.get(section, {})
        return cls.from_dict(doc)

    def replace(self, **kw: Any) -> "ChannelConfig":
        return dataclasses.replace(self, **kw)
