"""`fate-rdma flow setup|remove|check`: the once-per-site set-up of the fate-flow route.

A FATE-Flow 2.2 job switches fate-rdma on with a `fate_rdma` mapping under `dag.conf.extra` in its job
conf (per job: mode, chunk_bytes, window, threshold_bytes, fallback, ...). What is per site lives in
the site file this command writes: the endpoint (host:port) of each party this site runs and of its
peers, the provider and device. `setup` installs the start-up hook into the Python that runs
fate-flow's tasks (run it with that Python, or name it with --python), writes and checks the site file;
nothing is registered in fate-flow and the server needs no restart. Idempotent; --dry-run changes nothing.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional

SITE_HEADER = """\
# fate-rdma site file, written by `fate-rdma flow setup` (what is per site; edit or rerun setup).
# The per-job part is the job conf's dag.conf.extra.fate_rdma section. Read by every fate-flow task
# of a job that asks for fate-rdma, so a change applies to the next task, with no restart.
#   endpoints:   role:party_id -> host:port of that party's fate-rdma endpoint (this site's and its peers')
#   listen_host: interface the endpoints of this site bind (default: the host named in endpoints)
#   provider:    auto (pyverbs if an RDMA device exists, else soft = verbs emulated over TCP) | soft | pyverbs
#   device:      RDMA device name (e.g. mlx5_0), or null for the first one
#   flow_address: host:port of this site's fate-flow API, only where tasks cannot tell (they normally can)
#   secret_file: the federation's shared secret (the same at every site; `fate-rdma secret FILE`, mode 600):
#                endpoints prove it to each other before anything is allocated; required unless every
#                endpoint is on loopback (or tls is on)
#   tls:         true = mutual TLS 1.3 on every connection between endpoints (soft provider: data too);
#                each party's certificate names it ("guest:9999"), so one party cannot pose as another
#   tls_cert, tls_key, tls_ca: this site's certificate, its key (mode 600) and the federation's CA
#                certificate (PEM; `fate-rdma tls request` here, `fate-rdma tls sign` at the CA)
#   shared_secret_only: true = endpoints off loopback may run on secret_file alone, without tls (members can
#                then impersonate each other); without it they need tls
#   metrics_dir: the folder every task writes its Prometheus metrics to, for `fate-rdma exporter --dir`
#   soft_data_ports: LOW-HIGH: the soft provider's data listeners take ports of this range (open it to peers)
# Add by hand any policy a job must not loosen (docs/security.md, "The site's policy"): a job may choose a
# stronger checksum (none < crc32c < xxh3 < blake3 = blake2b), switch same_host off, and lower memory_budget_bytes,
# slot_bytes, slot_initial_bytes, pool_slots, max_payload_bytes, recv_cache_bytes, put_buffer_bytes and
# max_pending_handshakes, never the other way; a key not set here holds jobs to its default.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = ("examples:\n"
                "  fate-rdma flow setup --endpoint guest:9999=10.0.1.10:18600 "
                "--endpoint host:10000=10.0.2.10:18600 \\\n"
                "                       --endpoint arbiter:10000=10.0.3.10:18600\n"
                "  fate-rdma flow setup --dry-run ...     # say what would change, change nothing\n"
                "  fate-rdma flow check                   # is this site ready? (hook, site file, fate-flow)\n"
                "  fate-rdma flow remove                  # undo setup (the site file; --hook: the hook too)\n"
                "exit codes: 0 ok, 1 a check failed, 2 bad usage")
    sub = p.add_subparsers(dest="flow_action", metavar="ACTION", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--site", help="site file (default: $FATE_RDMA_SITE, else <this Python's "
                                       "prefix>/etc/fate_rdma/site.yaml)")
    common.add_argument("--python", help="the Python that runs fate-flow's tasks (its provider's venv), if not this "
                                         "one; fate-rdma must be installed there; the command reruns itself with it")
    common.add_argument("--dry-run", action="store_true", help="say what would be done, change nothing")
    s = sub.add_parser("setup", parents=[common], help="install the hook, write and check the site file",
                       description="Install the start-up hook into fate-flow's Python and write/check the site file.")
    s.add_argument("--endpoint", action="append", default=[], metavar="ROLE:PARTY_ID=HOST:PORT",
                   help="a party's fate-rdma endpoint; repeat for every party of the jobs (this site's and its peers')")
    s.add_argument("--listen-host", help="interface this site's endpoints bind (e.g. 0.0.0.0; default: the host "
                                         "of each party's --endpoint)")
    s.add_argument("--provider", choices=["auto", "soft", "pyverbs"], help="verbs provider (default auto)")
    s.add_argument("--device", help="RDMA device name (pyverbs), e.g. mlx5_0")
    s.add_argument("--flow-address", help="host:port of this site's fate-flow API (only where tasks cannot tell)")
    s.add_argument("--secret-file", help="the federation's shared secret (same file at every site; make one with "
                                         "`fate-rdma secret FILE`); needed unless all endpoints are on loopback")
    s.add_argument("--tls", dest="tls", action="store_const", const=True, default=None,
                   help="mutual TLS between endpoints (needs --tls-cert, --tls-key, --tls-ca, here or already set)")
    s.add_argument("--no-tls", dest="tls", action="store_const", const=False, help="switch TLS off")
    s.add_argument("--shared-secret-only", dest="shared_secret_only", action="store_const", const=True, default=None,
                   help="let endpoints off loopback run on --secret-file alone, without TLS: members can then "
                        "impersonate each other (writes shared_secret_only: true)"),
    s.add_argument("--tls-cert", help="this site's certificate (PEM; `fate-rdma tls init` makes one per party)")
    s.add_argument("--tls-key", help="the key of --tls-cert (PEM, mode 600)")
    s.add_argument("--tls-ca", help="the federation CA's certificate (PEM), the same at every site")
    s.add_argument("--soft-data-ports", metavar="LOW-HIGH",
                   help="the soft provider's data listener takes the first free port of this range (one per task "
                        "process with an endpoint at once), for the firewall; default: any free port")
    s.add_argument("--metrics-dir", help="write Prometheus metrics of every task here, for this site's `fate-rdma "
                                         "exporter --dir` (the same folder; docs/operations.md#metrics)")
    r = sub.add_parser("remove", parents=[common], help="remove the site file (and, with --hook, the start-up hook)",
                       description="Undo `flow setup`: remove the site file, so that fate-flow jobs of this site no "
                                   "longer switch fate-rdma on (a job asking for it fails naming the missing file). "
                                   "The start-up hook stays: `fate-rdma launch` uses it too, and it does nothing "
                                   "in a process without a fate-rdma section; --hook removes it as well.")
    r.add_argument("--keep-site", action="store_true", help="keep the site file")
    r.add_argument("--hook", action="store_true", help="also remove the start-up hook from this Python (then "
                                                       "`fate-rdma launch` needs `fate-rdma hook install` again)")
    c = sub.add_parser("check", parents=[common], help="check this site: hook, site file, optionally a job conf",
                       description="Check that fate-flow tasks of this Python can switch fate-rdma on.")
    c.add_argument("--job-conf", help="a fate-flow job conf (YAML) whose dag.conf.extra.fate_rdma to check against "
                                      "the site file")


def _parse_endpoints(items: List[str]) -> Dict[str, str]:
    out: Dict[str, str] = {}
    for item in items:
        key, sep, addr = item.partition("=")
        host, _, port = addr.rpartition(":")
        if not sep or key.count(":") != 1 or not host or not port.isdigit():
            print(f"fate-rdma flow setup: bad --endpoint {item!r}; want ROLE:PARTY_ID=HOST:PORT, "
                  "e.g. guest:9999=10.0.1.10:18600", file=sys.stderr)
            raise SystemExit(2)  # bad usage
        out[key] = f"{host}:{port}"
    return out


def _check_site(site: Dict[str, Any], path: str) -> List[str]:
    """Problems with a site file's content (empty list: fine)."""
    from ..errors import ConfigError
    from ..federation.config import RdmaFederationConfig

    if not site.get("endpoints"):
        return [f"{path}: no endpoints; give --endpoint ROLE:PARTY_ID=HOST:PORT for every party"]
    try:
        cfg = RdmaFederationConfig.from_section({k: v for k, v in site.items() if k != "flow_address"})
    except (ConfigError, TypeError, ValueError) as exc:
        return [f"{path}: {exc}"]
    off = cfg.hosts_off_loopback()
    if off and not cfg.proven_senders:  # else every task would fail as its endpoint starts
        return [f"{path}: endpoints (or listen_host) on {', '.join(off)} (not loopback) and no authentication: an "
                f"endpoint listens off "
                f"loopback only with the federation's shared secret or TLS; give --secret-file FILE (the same file at "
                f"every site, `fate-rdma secret FILE` makes one) or --tls with --tls-cert/--tls-key/--tls-ca"]
    if off and not cfg.channel.tls and not cfg.channel.shared_secret_only:
        return [f"{path}: endpoints (or listen_host) on {', '.join(off)} (not loopback) and no TLS: between hosts "
                f"peers prove their party by certificate; give --tls with --tls-cert/--tls-key/--tls-ca (fate-rdma tls "
                f"request at this site, tls sign at the federation's CA), or --shared-secret-only to run on the "
                f"secret alone (members can then impersonate each other)"]
    if cfg.channel.tls:  # the certificate must name one of the parties (this site's own)
        from ..channel.tls import certificate_names

        names = certificate_names(str(cfg.channel.tls_cert))
        if names is not None and not set(names) & set(cfg.endpoints):
            return [f"{path}: tls_cert {cfg.channel.tls_cert} names {', '.join(names)}, none of the parties in "
                    f"endpoints; give this site the certificate `fate-rdma tls init` issued for its party"]
    return []


def _rerun(args: argparse.Namespace) -> int:
    argv = [a for a in sys.argv[1:]]
    i = argv.index("--python") if "--python" in argv else None
    if i is not None:
        del argv[i:i + 2]
    else:
        argv = [a for a in argv if not a.startswith("--python=")]
    return subprocess.call([args.python, "-m", "fate_rdma.cli"] + argv)


def _flow_versions() -> Dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("fate-flow", "pyfate"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = ""
    return out


def run(args: argparse.Namespace) -> int:
    if args.python and os.path.realpath(args.python) != os.path.realpath(sys.executable):
        return _rerun(args)
    from ..federation.flow import default_site_path, load_site
    from ..federation.hook import PTH_LINE, pth_path

    site_path = os.path.abspath(args.site) if args.site else default_site_path()
    hook = pth_path()
    act = "would" if args.dry_run else "will"
    if args.flow_action == "remove":
        for path, what in ((hook if args.hook else None, "start-up hook"),
                           (None if args.keep_site else site_path, "site file")):
            if path is None:
                continue
            if os.path.exists(path):
                if not args.dry_run:
                    os.remove(path)
                print(f"{'would remove' if args.dry_run else 'removed'} {what} {path}")
            else:
                print(f"no {what} at {path}")
        if not args.hook:
            print(f"{'would keep' if args.dry_run else 'kept'} the start-up hook {hook} (`fate-rdma launch` uses it; "
                  f"--hook removes it too)")
        return 0

    endpoints = _parse_endpoints(args.endpoint) if args.flow_action == "setup" else {}  # bad usage: before any change
    problems: List[str] = []
    versions = _flow_versions()
    print(f"python: {sys.executable}")
    print(f"fate-flow {versions['fate-flow'] or 'NOT installed'}, pyfate {versions['pyfate'] or 'NOT installed'}")
    if not versions["pyfate"]:
        problems.append("FATE (pyfate) is not installed in this Python: fate-flow's tasks must run here "
                        "(pass --python with the provider's venv python)")
    if args.flow_action == "setup":
        current = None
        if os.path.exists(hook):
            with open(hook) as f:
                current = f.read()
        if current == PTH_LINE:
            print(f"hook: already installed at {hook}")
        else:
            if not args.dry_run:
                os.makedirs(os.path.dirname(hook), exist_ok=True)
                with open(hook, "w") as f:
                    f.write(PTH_LINE)
            print(f"hook: {'would install' if args.dry_run else 'installed'} {hook}")
        site: Dict[str, Any] = load_site(site_path) if os.path.exists(site_path) else {}
        new = dict(site)
        if args.endpoint:
            new["endpoints"] = {**(site.get("endpoints") or {}), **endpoints}
        paths = ("secret_file", "tls_cert", "tls_key", "tls_ca", "metrics_dir")
        for key in ("listen_host", "provider", "device", "flow_address", "tls", "shared_secret_only",
                    "soft_data_ports") + paths:
            val = getattr(args, key)
            if val is not None:
                new[key] = os.path.abspath(val) if key in paths else val
        new.setdefault("provider", "auto")
        problems += _check_site(new, site_path)
        if problems and not args.dry_run:
            for p in problems:
                print(f"PROBLEM: {p}", file=sys.stderr)
            print("site file not written", file=sys.stderr)
            return 1
        if new == site and os.path.exists(site_path):
            print(f"site file: unchanged {site_path}")
        else:
            import yaml

            text = SITE_HEADER + yaml.safe_dump(new, sort_keys=True)
            if not args.dry_run:
                os.makedirs(os.path.dirname(site_path), exist_ok=True)
                tmp = site_path + ".tmp"
                with open(tmp, "w") as f:
                    f.write(text)
                os.replace(tmp, site_path)
            print(f"site file: {'would write' if args.dry_run else 'wrote'} {site_path}:")
            print("  " + yaml.safe_dump(new, sort_keys=True).strip().replace("\n", "\n  "))
        print("fate-flow: nothing to register and no restart: a job asks with dag.conf.extra.fate_rdma in its conf")
    else:  # check
        print(f"hook: {'installed at ' + hook if os.path.exists(hook) else 'NOT installed (run fate-rdma flow setup)'}")
        if not os.path.exists(hook):
            problems.append(f"the start-up hook is not installed in {sys.executable}")
        found: Optional[Dict[str, Any]]  # the site file, if it could be read
        try:
            found = load_site(site_path)
            problems += _check_site(found, site_path)
            named = sorted((found.get('endpoints') or {}).items())
            print(f"site file: {site_path}: endpoints {', '.join(f'{k}={v}' for k, v in named)}")
        except Exception as exc:
            problems.append(str(exc))
            found = None
        if args.job_conf:
            problems += _check_job_conf(args.job_conf, found)
    for p in problems:
        print(f"PROBLEM: {p}", file=sys.stderr)
    if not problems:
        print(f"ok: fate-flow jobs of this site {act} switch fate-rdma on with dag.conf.extra.fate_rdma"
              if args.flow_action == "setup" else "ok")
    return 1 if problems else 0


def _check_job_conf(path: str, site: Any) -> List[str]:
    import yaml

    from ..errors import ConfigError
    from ..federation import site_policy
    from ..federation.config import RdmaFederationConfig
    from ..federation.flow import check_job_section

    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    conf = ((doc.get("dag") or {}).get("conf") or {})
    sec = (conf.get("extra") or {}).get("fate_rdma")
    if sec is None:
        return [f"{path}: no dag.conf.extra.fate_rdma section (a fate_rdma key directly under dag.conf is dropped by "
                f"fate-flow)"]
    try:
        check_job_section(sec)
        if site:
            cfg = RdmaFederationConfig.from_section(site_policy.merge(site, sec, f"{path}: dag.conf.extra.fate_rdma"))
            parties = [f"{p['role']}:{pid}" for p in (doc.get("dag") or {}).get("parties", []) for pid in p["party_id"]]
            missing = [p for p in parties if p not in cfg.endpoints]
            if missing:
                return [f"{path}: the site file has no endpoint for {', '.join(missing)}"]
    except ConfigError as exc:
        return [f"{path}: {exc}"]
    print(f"job conf {path}: dag.conf.extra.fate_rdma ok")
    return []
