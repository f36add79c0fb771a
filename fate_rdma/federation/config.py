"""The `fate_rdma` section of a FATE job/task configuration.

    fate_rdma:
      enabled: true
      mode: fedrdma-e            # any ChannelConfig key: chunk_bytes, window, provider, device, ...
      threshold_bytes: 1048576   # pickles at or above this go over the channel (default 1 MiB)
      fallback: error            # unreachable peer: "error" (names party and address) or "fate" (FATE's path,
                                 # logged once)
      pull_timeout_s: 600        # descriptors: fate: how long a get() waits for the payload after its
                                 # descriptor arrived
      get_timeout_s: 86400       # descriptors: channel: how long a get() waits for its object, the sender's work
                                 # before its put included (a round of local training); logged every 5 min.
                                 # An object no get took within max(get_timeout_s, pull_timeout_s) of its
                                 # arrival is dropped (logged), in either descriptors mode
      descriptors: auto          # how a get learns what was put: "channel" (every object and its description
                                 # over the channel, FATE's path unused: lower latency; needs secret_file or
                                 # tls, and fallback: error), "fate" (a small descriptor through FATE's own
                                 # federation; small objects stay on FATE's path), "auto" (channel where it
                                 # can be, else fate; every party must end up with the same)
      buffer_puts: auto          # a put of arrays copies them (as FATE's pickling does) and returns at once while
                                 # its bytes go in the background (true), or waits until they have arrived
                                 # (false, no copy); auto: copies a put whose copy costs less than the round trip
                                 # to its parties (bytes <= RTT x PUT_COPY_BYTES_PER_S), as small payloads on a WAN,
                                 # and every put of at most 16 MiB (PUT_COPY_SMALL_BYTES), on any link
      put_buffer_bytes: 1073741824  # buffered bytes in flight at most (then a put waits); 0: no put is buffered
      endpoints:                 # (role, party_id) -> host:port of that party's fate-rdma endpoint
        guest:9999: 10.0.0.1:18600
        host:10000: 10.0.0.2:18600
        arbiter:10000: 10.0.0.3:18600
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
from typing import Any, Dict, List, Optional, Sequence, Union

from ..config import ChannelConfig, is_loopback_host
from ..errors import ConfigError

FED_KEYS = {"enabled", "threshold_bytes", "fallback", "pull_timeout_s", "get_timeout_s", "put_buffer_bytes",
            "endpoints", "listen_host", "descriptors", "buffer_puts"}

#: what `buffer_puts: auto` takes a put's copy to cost: a second per GB, about what the copies ran at inside
#: `bench fate` rounds on a 2-core machine with three busy parties. A copy pays where it costs less than the
#: round trip a put that waits for its bytes spends on their confirmation (docs/fate.md, "Buffered puts";
#: over a long link small LoRA uploads gain, the largest stop paying: docs/benchmarks.md)
PUT_COPY_BYTES_PER_S = 1e9
#: what `buffer_puts: auto` copies whatever the round trip: a put that waits for its bytes pays, besides the
#: round trip, a transfer's fixed costs at both ends (framing, the receiver's verdict, thread hand-offs: 2-5 ms
#: a transfer on the 2-core test machine) and the sending of the caller's many separate arrays, and a party
#: that puts to several parties in turn (FATE's SecureAggregatorServer, the average to each client) pays them
#: once per party; copied into one recycled buffer, such puts return at once and their transfers overlap.
#: 16 MiB copies the uploads of LoRA ranks up to 16 of GPT-2 small, which shortened their rounds; a 32 MiB
#: floor gained nothing more (`bench fate --lora-ranks`, docs/benchmarks.md)
PUT_COPY_SMALL_BYTES = 16 << 20


#: the longest wait a timeout may ask for (a year; Python's own limit is threading.TIMEOUT_MAX)
MAX_WAIT_S = min(365 * 86400.0, threading.TIMEOUT_MAX)


def party_key(party: Sequence[str]) -> str:
    """A party (role, party_id), as FATE gives it (a tuple or a list), as the key of `endpoints`: 'role:party_id'."""
    return f"{party[0]}:{party[1]}"


@dataclasses.dataclass(frozen=True)
class RdmaFederationConfig:
    endpoints: Dict[str, str]
    enabled: bool = True
    #: 1 MiB: FATE's own max_message_size; anything FATE would slice goes over the channel instead
    threshold_bytes: int = 1 << 20
    fallback: str = "error"
    #: descriptors: fate: a get's wait for a payload its descriptor (through FATE) has announced
    pull_timeout_s: float = 600.0
    #: descriptors: channel: a get's wait for its object, which starts before the sender has made it (its
    #: local training round included), as FATE's own get waits; a day, beyond any sane round
    get_timeout_s: float = 86400.0
    #: buffered puts (MPI_Bsend's idea): a put copies its arrays into a recycled buffer, pushes its
    #: descriptor and returns, and the bytes go in the background, so puts to several parties in turn
    #: (FATE's SecureAggregatorServer) overlap; at most this many bytes in flight, 0 = every put waits
    #: until its bytes have arrived
    put_buffer_bytes: int = 1 << 30
    #: which puts are buffered (copied, the put returning at once): True all (within put_buffer_bytes), False
    #: none (a put waits until its bytes have arrived), "auto" those whose copy costs less than the measured
    #: round trip to their parties, and every put of at most PUT_COPY_SMALL_BYTES (buffers_put)
    buffer_puts: Union[bool, str] = "auto"
    #: interface this party's endpoint binds (default: the host of its own endpoints entry)
    listen_host: Optional[str] = None
    #: "fate": a large object's descriptor travels through FATE's own federation (FATE's ordering and blocking
    #: get; small objects take FATE's path); "channel": every object, with its name, tag and length, goes over
    #: the channel and FATE's federation is not used for bytes at all (one round trip less per object: what
    #: small payloads such as low-rank LoRA adapters pay for); the sender must then be proven (secret_file or
    #: tls) and an unreachable peer is an error. "auto": channel when the senders are proven and fallback is
    #: error, else fate (descriptors_in_use)
    descriptors: str = "auto"
    channel: ChannelConfig = ChannelConfig()

    def __post_init__(self) -> None:
        if self.fallback not in ("error", "fate"):
            raise ConfigError(f"fate_rdma.fallback must be 'error' or 'fate', got {self.fallback!r}")
        if self.descriptors not in ("auto", "fate", "channel"):
            raise ConfigError(f"fate_rdma.descriptors must be 'auto', 'fate' or 'channel', got {self.descriptors!r}")
        if self.descriptors == "channel" and self.fallback == "fate":
            raise ConfigError("fate_rdma.descriptors: channel cannot fall back to FATE's path (the receiver waits on "
                              "the channel alone): set fallback: error, or descriptors: fate")
        if self.threshold_bytes < 1:
            raise ConfigError("fate_rdma.threshold_bytes must be positive")
        if isinstance(self.put_buffer_bytes, bool) or not isinstance(self.put_buffer_bytes, int) \
                or self.put_buffer_bytes < 0:
            raise ConfigError(f"fate_rdma.put_buffer_bytes must be a byte count >= 0, got {self.put_buffer_bytes!r}")
        if not (isinstance(self.buffer_puts, bool) or self.buffer_puts == "auto"):
            raise ConfigError(f"fate_rdma.buffer_puts must be true, false or 'auto', got {self.buffer_puts!r}")
        for key in ("pull_timeout_s", "get_timeout_s"):
            value = getattr(self, key)
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_WAIT_S):
                raise ConfigError(f"fate_rdma.{key} must be a positive number of seconds up to {MAX_WAIT_S:g}, "
                                  f"got {value!r}")
        if not isinstance(self.endpoints, dict) or not self.endpoints:
            raise ConfigError("fate_rdma.endpoints must map 'role:party_id' to 'host:port' for every party")
        for k, v in self.endpoints.items():
            host, _, port = str(v).rpartition(":")
            if ":" not in str(k) or not host or not port.isdigit():
                raise ConfigError(f"fate_rdma.endpoints: bad entry {k!r}: {v!r} (want 'role:party_id': 'host:port')")

    @property
    def proven_senders(self) -> bool:
        """Does every connection prove its party (a shared secret or TLS certificates)?"""
        return bool(self.channel.secret_file or self.channel.tls)

    def hosts_off_loopback(self, listen: bool = True) -> List[str]:
        """The hosts of the endpoints (and, with `listen`, listen_host) that are not this machine's loopback: an
        endpoint listens there only with the federation's secret or TLS (the channel refuses to start otherwise)."""
        hosts = [str(a).rpartition(":")[0] for a in self.endpoints.values()]
        hosts += [self.listen_host] if listen and self.listen_host else []
        return sorted({h for h in hosts if not is_loopback_host(h)})

    @property
    def descriptors_in_use(self) -> str:
        """"channel" or "fate": what `descriptors` comes to with this configuration."""
        if self.descriptors != "auto":
            return self.descriptors
        return "channel" if self.proven_senders and self.fallback == "error" else "fate"

    def buffers_put(self, nbytes: int, rtt_s: float) -> bool:
        """Is a put of `nbytes` of arrays copied (and returns at once) rather than sending them and waiting
        for them to arrive, the slowest round trip to its parties being `rtt_s` (0 where none is measured, or
        the parties are processes of this host)? Under auto: where the copy costs less than the round trip
        the waiting put spends on the receiver's confirmation (the transfer itself it pays either way on a
        link that the puts share), and any put of at most PUT_COPY_SMALL_BYTES (whose copy costs less than a
        transfer's fixed costs). Within put_buffer_bytes only (the wrapper checks the room)."""
        if self.buffer_puts == "auto":
            return nbytes <= max(PUT_COPY_SMALL_BYTES, rtt_s * PUT_COPY_BYTES_PER_S)
        return bool(self.buffer_puts)

    def address_of(self, party: Sequence[str]) -> str:
        key = party_key(party)
        if key not in self.endpoints:
            raise ConfigError(f"fate_rdma.endpoints has no entry for party {key}; known: "
                              f"{', '.join(sorted(self.endpoints))}")
        return self.endpoints[key]

    @classmethod
    def from_section(cls, section: Dict[str, Any]) -> "RdmaFederationConfig":
        if not isinstance(section, dict):
            raise ConfigError(f"fate_rdma section must be a mapping, got {type(section).__name__}")
        fed = {k: v for k, v in section.items() if k in FED_KEYS}
        chan = {k: v for k, v in section.items() if k not in FED_KEYS}
        fed["endpoints"] = {str(k): str(v) for k, v in (fed.get("endpoints") or {}).items()}
        return cls(channel=ChannelConfig.from_dict(chan), **fed)


def load_section(text_or_path: str) -> Optional[Dict[str, Any]]:
    """A `fate_rdma` section from a YAML/JSON file path or an inline JSON string (FATE_RDMA_CONF): at the
    top level, under `conf` (a task conf) or under `dag.conf` (a fate-flow job)."""
    return section_in(read_conf(text_or_path))


def read_conf(text_or_path: str) -> Dict[str, Any]:
    """The mapping in a YAML/JSON file, or in an inline JSON string; ConfigError naming what is wrong."""
    if text_or_path.lstrip().startswith("{"):
        try:
            doc = json.loads(text_or_path)
        except ValueError as exc:
            raise ConfigError(f"FATE_RDMA_CONF holds inline JSON that does not parse: {exc}") from exc
    else:
        if not os.path.exists(text_or_path):
            raise ConfigError(f"FATE_RDMA_CONF names {text_or_path!r}, which does not exist")
        import yaml

        try:
            with open(text_or_path) as f:
                doc = yaml.safe_load(f) or {}
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise ConfigError(f"{text_or_path}: not a readable YAML/JSON file: {exc}") from exc
    if not isinstance(doc, dict):
        raise ConfigError(f"{text_or_path}: the configuration must be a mapping (with a fate_rdma section), "
                          f"got {type(doc).__name__}")  # (inline JSON starts with "{": always a mapping)
    return doc


def section_in(doc: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The `fate_rdma` section of a configuration mapping (see load_section), or None."""
    if "fate_rdma" in doc:
        return doc["fate_rdma"]
    dag = doc.get("dag")
    for holder in (doc, dag if isinstance(dag, dict) else {}):  # task conf, fate-flow DAG
        conf = holder.get("conf") if isinstance(holder.get("conf"), dict) else None
        if conf and "fate_rdma" in conf:
            return conf["fate_rdma"]
        extra = conf.get("extra") if conf and isinstance(conf.get("extra"), dict) else None
        if extra and "fate_rdma" in extra:  # where a fate-flow job conf keeps it (see flow.py)
            return extra["fate_rdma"]
    return None
