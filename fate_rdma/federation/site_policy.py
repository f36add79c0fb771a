"""The site's policy wins: how a job's `fate_rdma` section and the site file make one configuration.

A site file (`fate-rdma flow setup` writes it; `$FATE_RDMA_SITE`, else `<prefix>/etc/fate_rdma/site.yaml`) is
the operator's; a job's section (a FATE-Flow job's `dag.conf.extra.fate_rdma`, or a launcher job's conf) is the
job initiator's. The job may set any key for its own performance (mode, chunk_bytes, window, timeouts, ...),
but nothing that would loosen what the site set to protect itself:

- site only (`SITE_ONLY_KEYS`): endpoints (they are also the peers allowed to connect), listen_host, provider,
  device, flow_address, secret_file, auth, tls and its files, metrics_dir, soft_data_ports. A FATE-Flow job
  section may not name them at all (flow.check_job_section); a launcher job's conf, which is a whole
  configuration, may repeat the site's value (endpoints: any of the site's entries), nothing else.
- tighten only (`TIGHTEN_ONLY_KEYS`): the job may choose a stricter value, never a looser one: `checksum`
  (none < crc32c < xxh3 < blake3 = blake2b; "auto" counts as what it means at the site: blake3 where the site
  sets a secret_file or tls), `integrity` (keyed, not unkeyed), `tls` (on, not off), `shared_secret_only`
  (off, not on), `auth` (an authenticating one, not none), `same_host` (off, not on), and the memory bounds
  (`memory_budget_bytes`, `peer_budget_fraction`, `slot_bytes`, `slot_initial_bytes`, `pool_slots`,
  `max_payload_bytes`, `recv_cache_bytes`, `put_buffer_bytes`) and `max_pending_handshakes` (lower, not higher).
  A key the site file does not set stands at its default, and the job is held to that.

A job that asks for less gets a `ConfigError` naming the key, its value and the site's, and does not run.
Where there is no site file (a launcher job on one machine) the job's conf is the only policy.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from ..config import ChannelConfig, resolve_checksum
from ..errors import ConfigError

SITE_ONLY_KEYS = ("endpoints", "listen_host", "provider", "device", "flow_address", "secret_file", "auth", "tls",
                  "tls_cert", "tls_key", "tls_ca", "metrics_dir", "soft_data_ports")
#: weakest first; the two MACs are equally strong
CHECKSUM_ORDER = ("none", "crc32c", "xxh3", "blake3", "blake2b")
_CHECKSUM_RANK = {"none": 0, "crc32c": 1, "xxh3": 2, "blake3": 3, "blake2b": 3}
#: memory one endpoint may hold (receive pools, staging, reassembly, buffered puts) and the strangers' handshakes
#: it runs at once: a job may lower them, not raise them
LOWER_ONLY_KEYS = ("memory_budget_bytes", "peer_budget_fraction", "slot_bytes", "slot_initial_bytes", "pool_slots",
                   "max_payload_bytes", "recv_cache_bytes", "put_buffer_bytes", "max_pending_handshakes")
TIGHTEN_ONLY_KEYS = ("checksum", "integrity", "tls", "shared_secret_only", "auth", "same_host") + LOWER_ONLY_KEYS
_PATH_KEYS = ("secret_file", "tls_cert", "tls_key", "tls_ca", "metrics_dir")


def _show(v: Any) -> str:
    """A value as a YAML file spells it."""
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _default(key: str) -> Any:
    from .config import RdmaFederationConfig

    for cls in (ChannelConfig, RdmaFederationConfig):
        for f in dataclasses.fields(cls):
            if f.name == key:
                return f.default
    return None


def _count(v: Any) -> Optional[float]:
    """A byte count, a count or a fraction (peer_budget_fraction) as a number (memory_budget_bytes' null: half of
    this machine's memory, what it means); None for a value the key does not take."""
    if v is None:
        return ChannelConfig().budget_bytes
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _not_more(job: Any, site: Any) -> Optional[bool]:
    j, s = _count(job), _count(site)
    return None if j is None or s is None else j <= s


def _checksum_not_weaker(job: Any, site: Any) -> Optional[bool]:
    if job not in _CHECKSUM_RANK or site not in _CHECKSUM_RANK:
        return None
    return _CHECKSUM_RANK[job] >= _CHECKSUM_RANK[site]


def _keyed_not_unkeyed(job: Any, site: Any) -> Optional[bool]:
    return None if job not in ("keyed", "unkeyed") else job == "keyed" or site == "unkeyed"


def _on_not_off(job: Any, site: Any) -> Optional[bool]:
    return None if not isinstance(job, bool) else job or not site


def _off_not_on(job: Any, site: Any) -> Optional[bool]:
    return None if not isinstance(job, bool) else not job or bool(site)


def _auth_level(auth: Any, secret_file: Any) -> int:
    """0: connections unauthenticated; 1: they prove the federation's secret (auth: auto with a secret, or hmac)."""
    return 1 if auth == "hmac" or (auth in ("auto", None) and secret_file) else 0


#: key -> (what a job may do, whether the job's value is at least as strict as the site's: None where the job's
#: value is not one the key takes, which the configuration's own check then names). auth: in merge (it depends on
#: secret_file too)
_TIGHTEN: Dict[str, Tuple[str, Callable[[Any, Any], Optional[bool]]]] = {
    "checksum": ("a job may choose a stronger checksum (none < crc32c < xxh3 < blake3 = blake2b), never a weaker one",
                 _checksum_not_weaker),
    "integrity": ("a job may not accept unkeyed payload checks where the site requires keyed ones",
                  _keyed_not_unkeyed),
    "tls": ("a job may switch TLS on, not off", _on_not_off),
    "shared_secret_only": ("a job may not accept a shared secret alone between hosts where the site does not",
                           _off_not_on),
    "same_host": ("a job may switch the same-host path off, not on", _off_not_on),
    **{key: ("a job may lower it, not raise it", _not_more) for key in LOWER_ONLY_KEYS},
}


def merge(site: Mapping[str, Any], job: Mapping[str, Any], where: str,
          site_path: str = "the site file") -> Dict[str, Any]:
    """The configuration section a job runs with: the site file's keys (`site`, flow_address aside), then the
    job's (`job`, named `where` in errors) wherever the site's policy lets them; ConfigError where it does not."""
    merged = {k: v for k, v in site.items() if k != "flow_address"}

    def refuse(key: str, site_value: Any, rule: str) -> ConfigError:
        shown = _show(site_value) + ("" if key in site else " (the default: the site file does not set it)")
        return ConfigError(f"fate-rdma: {where} sets {key}: {_show(job[key])}, which this site's policy does not "
                           f"allow: {site_path} has {key}: {shown}; {rule}")

    for key, value in job.items():
        site_value = site[key] if key in site else _default(key)
        if key == "auth":
            pass  # (below, once secret_file is known)
        elif key in _TIGHTEN:
            rule, stricter = _TIGHTEN[key]
            if key == "checksum":  # "auto": what it means at this site (a keyed MAC where the site authenticates)
                keyed = bool(site.get("secret_file")) or site.get("tls") is True
                value, site_value = (resolve_checksum(v, keyed) if isinstance(v, str) else v
                                     for v in (value, site_value))
            if stricter(value, site_value) is False:
                raise refuse(key, site_value, rule)
        elif key == "endpoints" and key in site:
            theirs = {str(k): str(v) for k, v in (site_value or {}).items()}
            if not isinstance(value, dict) or any(theirs.get(str(k)) != str(v) for k, v in value.items()):
                raise refuse(key, site_value, "a job may name only parties of the site's endpoints, at the site's "
                                              "addresses (they are also the peers allowed to connect)")
        elif key in SITE_ONLY_KEYS and key in site and not _same(key, value, site_value):
            raise refuse(key, site_value, "it is set by the site only; a job may repeat the site's value, no other")
        merged[key] = value
    if "auth" in job and _auth_level(merged.get("auth"), merged.get("secret_file")) \
            < _auth_level(site.get("auth", "auto"), site.get("secret_file")):
        raise refuse("auth", site.get("auth", "auto"), "a job may not switch off the authentication the site's "
                                                       "secret_file gives")
    return merged


def _same(key: str, a: Any, b: Any) -> bool:
    if key in _PATH_KEYS and isinstance(a, str) and isinstance(b, str):
        return os.path.realpath(a) == os.path.realpath(b)
    return bool(a == b)
