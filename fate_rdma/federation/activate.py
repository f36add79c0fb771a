"""Switching fate-rdma on for FATE: patches FederationBuilder so every engine's federation is wrapped.

Configuration comes from, in order: `install(section)` called explicitly; a `fate_rdma` section of
the task configuration FATE parsed (captured by the import hook); for a task started by fate-flow,
its job's `dag.conf.extra.fate_rdma` merged with the site file (see flow.py); the
FATE_RDMA_CONF environment variable (a YAML/JSON file with a `fate_rdma` section, or inline JSON;
the multiprocess launcher's children inherit it). With none of them, FATE is left untouched. Where this
machine has a site file, a section from the first, second or last source runs under the site's policy
(site_policy.py), as a fate-flow job's does.
"""
from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any, Dict, Optional

from .. import trace
from .config import party_key

log = logging.getLogger("fate_rdma.federation")

_explicit: Optional[Dict[str, Any]] = None
_from_task_conf: Optional[Dict[str, Any]] = None
ENGINE_BUILDERS = ("build_standalone", "build_osx", "build_rabbitmq", "build_pulsar")


def current_section() -> Optional[Dict[str, Any]]:
    if _explicit is not None:
        return _explicit
    if _from_task_conf is not None:
        return _from_task_conf
    env = os.environ.get("FATE_RDMA_CONF")
    if env:
        from .config import load_section

        return load_section(env)
    return None


def wrap(fed: Any, computing: Any) -> Any:
    """Wrap `fed` if fate-rdma is configured and enabled; else return it untouched."""
    if getattr(fed, "fate_rdma", None) is not None:
        return fed
    if _explicit is None and _from_task_conf is None:
        from . import flow

        task = flow.current_task()
        if task is not None and flow.wrap_flow_task(fed, computing, task):
            return fed  # the fate-flow job's own section decided (on, off, or fell back)
    section = current_section()
    if not section or not section.get("enabled", True) or getattr(fed, "fate_rdma", None) is not None:
        return fed
    from .flow import apply_site_policy
    from .config import RdmaFederationConfig
    from .wrapper import RdmaFederation

    section = apply_site_policy(section, "this job's fate_rdma section")
    RdmaFederation(fed, computing, RdmaFederationConfig.from_section(section))
    return fed


def mark(fn: Any) -> None:
    """Mark `fn` as fate-rdma's replacement of a FATE function (`_fate_rdma`): patching again leaves it be."""
    fn._fate_rdma = True


def patch_builder(builder_cls: Any) -> None:
    """Wrap what each engine's build method returns (idempotent)."""
    for meth in ENGINE_BUILDERS:
        orig = getattr(builder_cls, meth, None)
        if orig is None or getattr(orig, "_fate_rdma", False):
            continue

        def make(orig: Any) -> Any:
            @functools.wraps(orig)
            def build(self: Any, computing_session: Any = None, *args: Any, **kwargs: Any) -> Any:
                fed = orig(self, computing_session, *args, **kwargs)
                computing = computing_session if computing_session is not None else kwargs.get("computing_session")
                return wrap(fed, computing)

            mark(build)
            return build

        setattr(builder_cls, meth, make(orig))


def capture_task_conf(spec_cls: Any) -> None:
    """Remember `conf.fate_rdma` of the task configuration FATE parses (pydantic drops unknown keys)."""
    orig = spec_cls.parse_obj
    if getattr(orig, "_fate_rdma", False):
        return

    def parse_obj(cls: Any, obj: Any) -> Any:
        global _from_task_conf
        conf = obj.get("conf") if isinstance(obj, dict) else None
        if isinstance(conf, dict) and isinstance(conf.get("fate_rdma"), dict):
            _from_task_conf = conf["fate_rdma"]
        from . import flow  # a fate-flow task: its job's dag.conf.extra.fate_rdma is read at federation build

        flow.set_task(flow.task_from_config(obj))
        return orig.__func__(cls, obj)

    mark(parse_obj)
    spec_cls.parse_obj = classmethod(parse_obj)


def patch_serdes(pickler_cls: Any, unpickler_cls: Any) -> None:
    """Let a wrapped federation carry array-heavy objects as frames (see frames.py); FATE's own
    serializer stays in charge of everything else and of every federation fate-rdma did not wrap."""
    from . import frames

    push = pickler_cls.push
    if not getattr(push, "_fate_rdma", False):
        def push_framed(cls: Any, value: Any, federation: Any, computing: Any, name: str, tag: str, parties: Any,
                        *args: Any, **kwargs: Any) -> Any:
            rdma = getattr(federation, "fate_rdma", None)
            frame = rdma.frame(value) if rdma is not None else None
            if frame is None:
                return push.__func__(cls, value, federation, computing, name, tag, parties, *args, **kwargs)
            federation.push_bytes(v=frame, name=name, tag=tag, parties=parties)

        mark(push_framed)
        pickler_cls.push = classmethod(push_framed)
    pull = unpickler_cls.pull
    if not getattr(pull, "_fate_rdma", False):
        def pull_framed(cls: Any, buffers: Any, ctx: Any, federation: Any, name: str, tag: str, party: Any) -> Any:
            if isinstance(buffers, frames.InFrame):
                t0 = time.perf_counter()
                try:
                    return frames.decode(buffers, cls, ctx, federation, name, tag, party)
                finally:  # a get's last step: the frame's arrived bytes back to the object FATE's get returns
                    rdma = getattr(federation, "fate_rdma", None)
                    if rdma is not None:
                        rdma.stats["unframe_seconds"] += time.perf_counter() - t0
                    trace.event("got", name=name, tag=tag, src=party_key(party))
            return pull.__func__(cls, buffers, ctx, federation, name, tag, party)

        mark(pull_framed)
        unpickler_cls.pull = classmethod(pull_framed)


def install(section: Optional[Dict[str, Any]] = None) -> None:
    """Activate in this process now (imports FATE). `section`: a `fate_rdma` mapping; None: from env/task conf."""
    global _explicit
    if section is not None:
        _explicit = section
    from fate.arch.federation import _builder
    from fate.arch.federation.api import _serdes

    patch_builder(_builder.FederationBuilder)
    patch_serdes(_serdes.TableRemotePersistentPickler, _serdes.TableRemotePersistentUnpickler)
