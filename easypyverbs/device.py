"""Opening a device: `open_device(name=None, provider="auto")`.

`auto` picks pyverbs when rdma-core lists at least one RDMA device, else the soft provider, and
logs which and why. The choice can also come from configuration: `provider=` here, or the
`EASYPYVERBS_PROVIDER` environment variable (read when `open_device` runs, never at import).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from .api import Context
from .errors import NoDeviceError, UsageError
from .providers.soft.link import LinkModel

log = logging.getLogger("easypyverbs")

PROVIDERS = ("auto", "pyverbs", "soft")


@dataclasses.dataclass(frozen=True)
class Emulation:
    """What the soft provider (verbs emulated over TCP or shared memory) takes should it be the provider
    opened; a real device has no use for any of it. None leaves the provider's default.

    link: a `LinkModel` or "rate=10gbit,rtt=20ms,loss=0.0001" (else `EASYPYVERBS_SOFT_LINK`); a real device
        refuses one (UsageError) rather than ignore it.
    bind_host: the address its data connections listen on, where the soft provider was asked for by name
        (`auto` falling back to it binds loopback).
    same_host, retry_timeout_s, tls: as the soft provider's options of those names.
    known_sources: whether a source address is a peer's the caller expects (the job's parties): the soft NIC
        admits its data connections on slots strangers cannot take (easypyverbs.admission).
    ports: (low, high): the soft NIC's data listener takes the first free port of that range (a firewall can
        then name them), else any free port.
    """
    link: Union[None, str, LinkModel] = None
    bind_host: Optional[str] = None
    same_host: Optional[bool] = None
    retry_timeout_s: Optional[float] = None
    tls: Any = None
    known_sources: Optional[Callable[[str], bool]] = None
    ports: Optional[Tuple[int, int]] = None


def pyverbs_status() -> Tuple[bool, str, List[str]]:
    """(importable, explanation, device names)."""
    from .providers import pyverbs_provider as pv

    return pv.status()


def choose_provider(requested: str = "auto") -> Tuple[str, str]:
    """Resolve `auto` to a provider name; returns (provider, reason)."""
    if requested not in PROVIDERS:
        raise UsageError(f"unknown provider {requested!r}; choose one of {', '.join(PROVIDERS)}")
    if requested != "auto":
        return requested, "requested explicitly"
    ok, why, devices = pyverbs_status()
    if ok and devices:
        return "pyverbs", f"RDMA device(s) found: {', '.join(devices)}"
    return "soft", (f"no RDMA device usable ({why}); using the soft provider (emulated verbs over TCP or, on one "
                    f"host, shared memory; not RDMA)")


def open_device(
    name: Optional[str] = None,
    provider: Optional[str] = None,
    *,
    link: Union[None, str, LinkModel] = None,
    emulation: Optional[Emulation] = None,
    **options: Any,
) -> Context:
    """Open a verbs device.

    name: RDMA device name for pyverbs (e.g. "mlx5_0"; default: the first device).
    provider: "auto" (default), "pyverbs" or "soft".
    link: soft provider only, a `LinkModel` or a string like "rate=10gbit,rtt=20ms,loss=0.0001";
        defaults to `EASYPYVERBS_SOFT_LINK` if set.
    options: provider-specific: soft takes bind_host, advertise_host, max_msg_bytes,
        rnr_timeout_s, retry_timeout_s, same_host, tls (an `easypyverbs.tls.MutualTLS`: mutual TLS
        on every data connection); pyverbs takes port_num, gid_index.
    emulation: the soft provider's options as one typed object (`Emulation`), applied only if it is chosen,
        so that a caller need not know which provider `auto` picks.
    """
    requested = provider or os.environ.get("EASYPYVERBS_PROVIDER", "auto")
    chosen, why = choose_provider(requested)
    log.info("easypyverbs: provider %s (%s)", chosen, why)
    if emulation is not None:
        if link is None:
            link = emulation.link
        if chosen == "soft":
            given = (("same_host", emulation.same_host), ("retry_timeout_s", emulation.retry_timeout_s),
                     ("tls", emulation.tls), ("known_sources", emulation.known_sources),
                     ("ports", emulation.ports))
            extra = {k: v for k, v in given if v is not None}
            if emulation.bind_host is not None and requested == "soft":
                extra["bind_host"] = emulation.bind_host
            options = {**extra, **options}
    if chosen == "soft":
        from .providers.soft import SoftContext

        text = link if link is not None else os.environ.get("EASYPYVERBS_SOFT_LINK")
        model = LinkModel.parse(text) if isinstance(text, str) else text
        return SoftContext(link=model, **options)
    if link is not None:
        raise UsageError("a link model applies to the soft provider only")
    from .providers import pyverbs_provider as pv

    return pv.open_pyverbs(name, **options)


def describe_auto() -> Dict[str, Any]:
    chosen, why = choose_provider("auto")
    return {"provider": chosen, "reason": why}


def require_device(provider: str) -> None:
    """Raise NoDeviceError unless `provider` can open a device here."""
    if provider == "pyverbs":
        ok, why, devices = pyverbs_status()
        if not (ok and devices):
            raise NoDeviceError(f"pyverbs provider unusable: {why}")
