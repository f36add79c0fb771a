"""The fate-flow route: a FATE-Flow 2.2 job switches fate-rdma on with `dag.conf.extra.fate_rdma`.

Why this route (FATE-Flow 2.2.0 source):
- `DAGSchema(**dag)` parses `dag.conf` into `JobConfSpec` (entity/spec/dag/_job.py), a pydantic model
  that drops unknown keys; its `extra` field is a free mapping that is kept in the stored DAG.
- `TaskParser.task_conf` (controller/parser.py) builds each task's conf from server settings only, so
  nothing of the job conf reaches the task process by itself.
- The task does know its job (`TaskConfigSpec.job_id`) and its fate-flow: `FlowWraps._output_artifacts`
  (hub/components_wraps/fate/_wraps.py) gives every task a `metric` output whose URI is this party's
  fate-flow API (`http://HOST:PORT/v2/worker/metric/save/...`).
So when a task builds its federation, fate-rdma asks that fate-flow for the job (`GET /v2/job/query`,
apps/client/job_app.py: `query_job`) and reads `dag.conf.extra.fate_rdma`. Nothing in FATE-Flow is
edited or registered, the server is not restarted, and a job without the section is untouched.

What is per job (the section) and what is per site (the site file, written once by the operator with
`fate-rdma flow setup`): the section may carry any channel key (mode, chunk_bytes, window, slot_bytes,
...) and enabled, threshold_bytes, fallback, pull_timeout_s, get_timeout_s, put_buffer_bytes, buffer_puts; the
site file carries `endpoints` (this site's parties and its peers), `listen_host`, `provider`, `device`, optionally
`flow_address`, the security keys (`secret_file`, `auth`, `tls`, `tls_cert`, `tls_key`, `tls_ca`: a job
can neither point at other credentials nor switch them off) and channel defaults. A site key in the section is an
error, and so is a section that loosens the site's checksum, same_host or memory bounds (site_policy.py): that one
fails the task even under `fallback: fate`.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import sys
import urllib.parse
import urllib.request
from typing import Any, Dict, Mapping, Optional

from ..errors import ConfigError, FateRdmaError
from . import site_policy
from .site_policy import SITE_ONLY_KEYS

log = logging.getLogger("fate_rdma.federation")

SITE_ENV = "FATE_RDMA_SITE"
#: the job query is local (this party's own fate-flow); 10 s covers a busy server on a small machine
FLOW_QUERY_TIMEOUT_S = 10.0
SETUP_HINT = "fate-rdma flow setup --endpoint ROLE:PARTY_ID=HOST:PORT ... (once per site)"


class FlowRouteError(ConfigError):
    """A fate-flow job asked for fate-rdma and cannot have it; the message names the cause and the fix."""

    def __init__(self, cause: str, fix: Optional[str] = None) -> None:
        super().__init__(cause if fix is None else f"{cause}. Fix: {fix}")


def default_site_path() -> str:
    """The site file of this Python environment (FATE_RDMA_SITE in fate-flow's environment overrides)."""
    return os.environ.get(SITE_ENV) or os.path.join(sys.prefix, "etc", "fate_rdma", "site.yaml")


def apply_site_policy(job: Mapping[str, Any], where: str, path: Optional[str] = None) -> Dict[str, Any]:
    """`job` (a launcher job's whole `fate_rdma` section) under the site file's policy where this machine has a
    site file (`path`, default default_site_path()); `job` itself where it has none."""
    if not isinstance(job, dict):
        raise ConfigError(f"fate_rdma section must be a mapping, got {type(job).__name__}")
    path = path or default_site_path()
    if not os.path.exists(path):
        return dict(job)
    return site_policy.merge(load_site(path), job, where, path)


@dataclasses.dataclass(frozen=True)
class FlowTask:
    """Who this fate-flow task is, from the task config FATE parses."""
    job_id: str
    role: str
    party_id: str
    task_name: str
    flow_url: Optional[str]  # http://host:port of this party's fate-flow, or None

    @property
    def label(self) -> str:
        return f"job {self.job_id} task {self.task_name} ({self.role}:{self.party_id})"


def task_from_config(obj: Any) -> Optional[FlowTask]:
    """A FlowTask when `obj` is a fate-flow task config (it has a job id); else None."""
    if not isinstance(obj, dict) or not obj.get("job_id"):
        return None
    flow_url = None
    metric = (obj.get("output_artifacts") or {}).get("metric")
    uri = metric.get("uri") if isinstance(metric, dict) else None
    if isinstance(uri, str) and uri.startswith(("http://", "https://")):
        u = urllib.parse.urlsplit(uri)
        flow_url = f"{u.scheme}://{u.netloc}"
    return FlowTask(str(obj["job_id"]), str(obj.get("role", "")), str(obj.get("party_id", "")),
                    str(obj.get("task_name", "")), flow_url)


def load_site(path: str) -> Dict[str, Any]:
    if not os.path.exists(path):
        raise FlowRouteError(f"the fate-rdma site file {path} does not exist", f"run `{SETUP_HINT}` on this site")
    import yaml

    try:
        with open(path) as f:
            site = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise FlowRouteError(f"the fate-rdma site file {path} cannot be read: {exc}",
                             f"fix it or write it again with `{SETUP_HINT}`") from exc
    if not isinstance(site, dict):
        raise FlowRouteError(f"the fate-rdma site file {path} is not a mapping", f"write it again with `{SETUP_HINT}`")
    return site


def fetch_job_conf(flow_url: str, task: FlowTask, timeout_s: float = FLOW_QUERY_TIMEOUT_S) -> Dict[str, Any]:
    """`dag.conf` of the task's job as this party's fate-flow stored it."""
    q = urllib.parse.urlencode({"job_id": task.job_id, "role": task.role, "party_id": task.party_id})
    url = f"{flow_url}/v2/job/query?{q}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            resp = json.loads(r.read())
    except (OSError, ValueError) as exc:
        raise FateRdmaError(f"fate-flow job query {url} failed: {exc}") from exc
    if resp.get("code") != 0 or not resp.get("data"):
        raise FateRdmaError(f"fate-flow job query {url} answered code {resp.get('code')}: {resp.get('message')}")
    dag = resp["data"][0].get("dag") or {}
    return ((dag.get("dag") or {}).get("conf")) or {}


def check_job_section(sec: Any) -> Dict[str, Any]:
    """Validate a job's `fate_rdma` section on its own (no site needed); returns it."""
    where = "dag.conf.extra.fate_rdma"
    if not isinstance(sec, dict):
        raise FlowRouteError(f"{where} must be a mapping, got {type(sec).__name__} {sec!r}",
                             "write it as `fate_rdma: {mode: fedrdma-e, ...}` (see examples/fate_flow/README.md)")
    site_keys = sorted(k for k in sec if k in SITE_ONLY_KEYS)
    if site_keys:
        raise FlowRouteError(f"{where} sets {', '.join(site_keys)}, which belong to the site, not the job",
                             "remove them from the job conf; each site sets them once with `fate-rdma flow setup`")
    from .config import RdmaFederationConfig

    probe = dict(sec, endpoints={"probe:0": "127.0.0.1:1"})
    try:
        RdmaFederationConfig.from_section(probe)
    except (ConfigError, TypeError, ValueError) as exc:
        raise FlowRouteError(f"{where} is malformed: {exc}",
                             "correct the section (every key is documented in conf/fate_rdma_launcher.yaml)") from exc
    return sec


#: the fate-flow task this process runs, captured when FATE parses its task config (see activate.py)
_task: Optional[FlowTask] = None


def set_task(task: Optional[FlowTask]) -> None:
    global _task
    _task = task


def current_task() -> Optional[FlowTask]:
    return _task


def wrap_flow_task(fed: Any, computing: Any, task: FlowTask) -> bool:
    """Apply the job's `dag.conf.extra.fate_rdma` to `fed`. Returns False when the job has no section
    (the caller may then try other sources); True when the section decided (wrapped, off, or fell back).
    Raises FlowRouteError when the job asked and cannot have it (unless the section says fallback: fate)."""
    site_path = default_site_path()
    flow_url = task.flow_url
    if flow_url is None and os.path.exists(site_path):
        addr = load_site(site_path).get("flow_address")
        flow_url = f"http://{addr}" if addr and "://" not in str(addr) else addr
    if flow_url is None:
        log.warning("fate-rdma: %s: this fate-flow task names no fate-flow address (no http metric output) and the "
                    "site file %s sets no flow_address, so its job conf cannot be read; fate-rdma stays off here",
                    task.label, site_path)
        return False
    try:
        conf = fetch_job_conf(flow_url, task)
    except FateRdmaError as exc:
        log.warning("fate-rdma: %s: cannot read the job conf (%s); fate-rdma stays off in this task even if the job "
                    "asked for it. Fix: let this task reach its fate-flow's job query API, or set flow_address in %s",
                    task.label, exc, site_path)
        return False
    sec = (conf.get("extra") or {}).get("fate_rdma") if isinstance(conf.get("extra"), dict) else None
    if sec is None:
        return False
    engine = type(fed).__name__.replace("Federation", "").lower() or type(fed).__name__
    fallback = sec.get("fallback", "error") if isinstance(sec, dict) else "error"
    try:
        check_job_section(sec)
        if not sec.get("enabled", True):
            log.info("fate-rdma: off for %s (dag.conf.extra.fate_rdma.enabled: false); engine %s carries everything",
                     task.label, engine)
            return True
        # a section that loosens the site's policy is a ConfigError, not a FlowRouteError: no fallback takes it
        merged = site_policy.merge(load_site(site_path), sec, f"{task.label}: dag.conf.extra.fate_rdma", site_path)
        from .config import RdmaFederationConfig, party_key

        try:
            cfg = RdmaFederationConfig.from_section(merged)
        except (ConfigError, TypeError, ValueError) as exc:
            raise FlowRouteError(f"the site file {site_path} with this job's section is not a valid configuration: "
                                 f"{exc}", f"correct the site file (`{SETUP_HINT}` writes it)") from exc
        me = party_key(tuple(fed.local_party))
        if me not in cfg.endpoints:
            raise FlowRouteError(f"this party ({me}) has no endpoint in the site file {site_path} "
                                 f"(it names {', '.join(sorted(cfg.endpoints))})",
                                 f"add it: `fate-rdma flow setup --endpoint {me}=HOST:PORT ...`")
        missing = [party_key(tuple(p)) for p in getattr(fed, "parties", []) or []
                   if party_key(tuple(p)) not in cfg.endpoints]
        if missing:
            raise FlowRouteError(f"the site file {site_path} has no endpoint for the job's parties "
                                 f"{', '.join(missing)}",
                                 "add each peer's address with "
                                 "`fate-rdma flow setup --endpoint ROLE:PARTY_ID=HOST:PORT`")
        from .wrapper import RdmaFederation

        try:
            rdma = RdmaFederation(fed, computing, cfg)
        except (FateRdmaError, OSError) as exc:
            raise FlowRouteError(f"this party's endpoint {cfg.endpoints[me]} cannot be opened: {exc}",
                                 "free that port, or name another in the site file; check `fate-rdma doctor`") from exc
    except FlowRouteError as exc:
        if fallback == "fate":
            log.warning("fate-rdma: OFF for %s, FATE's own %s federation carries everything (fallback: fate): %s",
                        task.label, engine, exc)
            return True
        raise FlowRouteError(f"fate-rdma: {task.label} asked for fate-rdma (dag.conf.extra.fate_rdma) and cannot have "
                             f"it: {exc} (or set `fallback: fate` in the section to run on FATE's own "
                             f"federation)") from exc
    emulated = getattr(getattr(rdma.endpoint, "ctx", None), "emulated", None)
    kind = "EMULATED verbs, not RDMA" if emulated else "RDMA"
    log.info("fate-rdma: ON for %s: engine %s, provider %s [%s], mode %s, endpoint %s, %s", task.label, engine,
             rdma.endpoint.label, kind, cfg.channel.mode, rdma.endpoint.name,
             "every object over the channel (descriptors: channel)" if rdma.announce else
             f"payloads >= {rdma.threshold} bytes, descriptors through FATE (descriptors: fate)")
    atexit.register(_report, rdma, task)
    return True


def _report(rdma: Any, task: FlowTask) -> None:
    """At the end of the task: what crossed the channel, in the task log; then close the endpoint."""
    s = rdma.stats
    log.info("fate-rdma: counters for %s: rdma_transfers=%d rdma_bytes=%d fate_fallbacks=%d rdma_seconds=%.3f "
             "small_transfers=%d holds=%d (longest %.1f s); over the channel in all (small objects too, under "
             "descriptors: channel): channel_transfers=%d channel_bytes=%d", task.label, s["rdma_transfers"],
             s["rdma_bytes"], s["fate_fallbacks"], s["rdma_seconds"], s["small_transfers"], rdma.endpoint.holds,
             rdma.endpoint.longest_hold_s, s["rdma_transfers"] + s["small_transfers"],
             s["rdma_bytes"] + s["small_bytes"])
    if s["rdma_transfers"] + s["small_transfers"] == 0 and s["below_threshold"]:
        log.warning("fate-rdma: nothing of %s crossed the channel: its %d object(s) were all under "
                    "threshold_bytes (%d) and took FATE's federation. Lower threshold_bytes in the job's section "
                    "(small LoRA adapters), or give the sites a secret or certificates (descriptors: channel then "
                    "carries every object)",
                    task.label, s["below_threshold"], rdma.threshold)
    try:
        rdma.close()
    except Exception:  # the process is ending; the counters are what matters
        pass
