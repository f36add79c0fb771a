"""`fate-rdma site init`: from one small federation description, every piece one site needs.

The description (the same file at every site; docs/sites.md):

    parties:                       # role:party_id -> where that party's site is
      guest:9999:    {host: 10.0.1.10}
      host:10000:    {host: 10.0.2.10}
      arbiter:10001: {host: 10.0.3.10, ports: {endpoint: 18610}}   # a party may override any port
    ports:                         # defaults for every party (these values when left out)
      endpoint: 18600              # fate-rdma's endpoint: TCP, from every peer
      soft_data: 18700-18763       # the soft provider's data listeners: TCP, from every peer
      osx: 9370                    # the site's OSX: TCP, from the peers' OSX
      flow_grpc: 9360              # the site's FATE-Flow gRPC: from its own OSX
      flow_http: 9380              # the site's FATE-Flow HTTP: local (flow client, tasks)
    security: tls                  # tls (certificates; the default) or shared-secret
    provider: auto                 # auto, soft or pyverbs

`init` writes into OUT (never into an installed package): `site.yaml` (fate-rdma's site file), the site's key and
certificate request (`tls/`, security tls) or the place of the federation secret (shared-secret),
`osx/broker.properties` and `osx/route_table.json` (FATE's OSX: the peers' OSX, the local FATE-Flow),
`fate_flow/service_conf.yaml` (the keys to set in FATE-Flow's own service_conf.yaml: party id, OSX as
federation engine and scheduling proxy, ports), `firewall.txt` (every port to open, from where) and `NEXT.txt`
(the steps that remain: the CA's signature, copying the OSX and FATE-Flow files, the hook, `site check`).
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..config import port_range
from ..errors import ConfigError

DEFAULT_PORTS: Dict[str, Any] = {"endpoint": 18600, "soft_data": "18700-18763", "osx": 9370, "flow_grpc": 9360,
                                 "flow_http": 9380}
SECURITY = ("tls", "shared-secret")


def _bad(msg: str) -> ConfigError:
    return ConfigError(f"federation description: {msg}")


def parse(doc: Any) -> Tuple[Dict[str, Dict[str, Any]], str, str]:
    """(party -> {host, ports}, security, provider) of a federation description, each field checked."""
    if not isinstance(doc, dict) or not isinstance(doc.get("parties"), dict) or not doc["parties"]:
        raise _bad("needs `parties:`, a mapping of role:party_id to {host: ...}")
    unknown = set(doc) - {"parties", "ports", "security", "provider"}
    if unknown:
        raise _bad(f"unknown key(s) {', '.join(sorted(unknown))} (parties, ports, security, provider)")
    base = dict(DEFAULT_PORTS)
    base.update(_ports(doc.get("ports") or {}, "ports"))
    parties: Dict[str, Dict[str, Any]] = {}
    ids: Dict[str, str] = {}
    for party, spec in doc["parties"].items():
        role, _, pid = str(party).partition(":")
        if not role or not pid.isdigit():
            raise _bad(f"party {party!r} is not role:party_id (e.g. guest:9999)")
        if pid in ids:
            raise _bad(f"{party} and {ids[pid]} share party id {pid}: each site is one party id (FATE-Flow and OSX "
                       f"route by it)")
        ids[pid] = str(party)
        if not isinstance(spec, dict) or not isinstance(spec.get("host"), str) or not spec["host"].strip():
            raise _bad(f"{party}: needs {{host: ADDRESS}} (the address its peers reach it at)")
        ports = dict(base)
        ports.update(_ports(spec.get("ports") or {}, f"{party}.ports"))
        parties[str(party)] = {"host": spec["host"].strip(), "ports": ports}
    seen: Dict[str, str] = {}
    for party, v in parties.items():
        where = f"{v['host']}:{v['ports']['endpoint']}"
        if where in seen:
            raise _bad(f"{party} and {seen[where]} have the same endpoint {where}")
        seen[where] = party
        lo, hi = port_range(v["ports"]["soft_data"]) or (0, -1)
        taken = {k: v["ports"][k] for k in ("endpoint", "osx", "flow_grpc", "flow_http")}
        inside = [k for k, port in taken.items() if lo <= port <= hi]
        if inside or len(set(taken.values())) < len(taken):
            raise _bad(f"{party}: its ports overlap ({', '.join(f'{k} {p}' for k, p in taken.items())}, soft_data "
                       f"{v['ports']['soft_data']}): each needs its own")
    security = str(doc.get("security", "tls"))
    if security not in SECURITY:
        raise _bad(f"security must be tls or shared-secret, got {security!r}")
    provider = str(doc.get("provider", "auto"))
    if provider not in ("auto", "soft", "pyverbs"):
        raise _bad(f"provider must be auto, soft or pyverbs, got {provider!r}")
    return parties, security, provider


def _ports(ports: Any, where: str) -> Dict[str, Any]:
    if not isinstance(ports, dict):
        raise _bad(f"{where} must be a mapping")
    out: Dict[str, Any] = {}
    for key, value in ports.items():
        if key not in DEFAULT_PORTS:
            raise _bad(f"{where}.{key}: unknown port (one of {', '.join(DEFAULT_PORTS)})")
        if key == "soft_data":
            if port_range(value) is None:
                raise _bad(f"{where}.soft_data must be LOW-HIGH, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
            raise _bad(f"{where}.{key} must be a port number, got {value!r}")
        out[key] = value
    return out


def site_file(parties: Mapping[str, Mapping[str, Any]], me: str, security: str, provider: str,
              out: str) -> Dict[str, Any]:
    """The fate-rdma site file of party `me` (its files under `out`)."""
    site: Dict[str, Any] = {
        "endpoints": {p: f"{v['host']}:{v['ports']['endpoint']}" for p, v in parties.items()},
        "provider": provider,
        "soft_data_ports": str(parties[me]["ports"]["soft_data"]),
    }
    stem = me.replace(":", "_")
    if security == "tls":
        site.update(tls=True, tls_cert=os.path.join(out, "tls", f"{stem}.pem"),
                    tls_key=os.path.join(out, "tls", f"{stem}.key"), tls_ca=os.path.join(out, "tls", "ca.pem"))
    else:
        site.update(secret_file=os.path.join(out, "federation.secret"), shared_secret_only=True)
    return site


def route_table(parties: Mapping[str, Mapping[str, Any]], me: str) -> Dict[str, Any]:
    """OSX's route_table.json at `me`'s site: each peer party id -> its site's OSX; this party id -> the local
    FATE-Flow's gRPC (role fateflow: FATE-Flow's scheduling calls) and this OSX (default)."""
    table: Dict[str, Any] = {}
    for p, v in parties.items():
        pid = p.partition(":")[2]
        if p == me:
            table[pid] = {"default": [{"ip": "127.0.0.1", "port": v["ports"]["osx"]}],
                          "fateflow": [{"ip": "127.0.0.1", "port": v["ports"]["flow_grpc"]}]}
        else:
            table[pid] = {"default": [{"ip": v["host"], "port": v["ports"]["osx"]}]}
    return {"route_table": table, "self_party": [me.partition(":")[2]]}


def broker_properties(parties: Mapping[str, Mapping[str, Any]], me: str) -> str:
    p = parties[me]
    return (f"# OSX broker settings for {me} (fate-rdma site init): set these keys in OSX's "
            f"conf/broker/broker.properties\n"
            f"grpc.port={p['ports']['osx']}\nbind.host=0.0.0.0\nself.party={me.partition(':')[2]}\n"
            f"open.http.server=false\nopen.grpc.tls.server=false\n")


def service_conf(parties: Mapping[str, Mapping[str, Any]], me: str) -> Dict[str, Any]:
    """The keys of FATE-Flow's service_conf.yaml at `me`'s site (merged into its own file, not replacing it)."""
    p = parties[me]["ports"]
    return {"party_id": me.partition(":")[2],
            "fateflow": {"host": "127.0.0.1", "http_port": p["flow_http"], "grpc_port": p["flow_grpc"],
                         "proxy_name": "osx"},
            "default_engines": {"federation": "osx"},
            "federation": {"osx": {"host": "127.0.0.1", "port": p["osx"], "mode": "queue"}}}


def firewall(parties: Mapping[str, Mapping[str, Any]], me: str, provider: str) -> List[str]:
    """Every port to open at `me`'s site: (protocol port, from where, what)."""
    p, peers = parties[me]["ports"], sorted(v["host"] for q, v in parties.items() if q != me)
    src = ", ".join(peers) or "-"
    lines = [f"tcp {p['endpoint']:<11} from {src}: fate-rdma endpoint (bootstrap, proof, control frames)",
             f"tcp {p['soft_data']:<11} from {src}: fate-rdma soft provider data connections (soft_data_ports)",
             f"tcp {p['osx']:<11} from {src}: OSX (the peers' OSX: FATE's federation and FATE-Flow's scheduling)",
             f"tcp {p['flow_grpc']:<11} from this host only: FATE-Flow gRPC (its OSX forwards scheduling calls)",
             f"tcp {p['flow_http']:<11} from this host only: FATE-Flow HTTP (flow client, tasks)"]
    if provider in ("auto", "pyverbs"):
        lines.append(f"udp {4791:<11} from {src}: RoCE v2 between the RDMA NICs (pyverbs provider)")
    return lines


def write(doc: Any, me: str, out: str, force: bool = False, request: Optional[Any] = None) -> List[str]:
    """Write `me`'s files into `out`; returns the next steps. `request(folder, party)` makes the site's key
    and certificate request (fate-rdma tls request), security tls only."""
    import yaml

    parties, security, provider = parse(doc)
    if me not in parties:
        raise ConfigError(f"--party {me} is not one of the description's parties ({', '.join(parties)})")
    out = os.path.abspath(out)
    target = os.path.join(out, "site.yaml")
    if os.path.exists(target) and not force:
        raise FileExistsError(f"{target} exists: this site was initialised already (--force writes it again, "
                              f"keeping its key)")
    for d in ("osx", "fate_flow"):
        os.makedirs(os.path.join(out, d), exist_ok=True)
    site = site_file(parties, me, security, provider, out)
    with open(target, "w") as f:
        f.write(f"# fate-rdma site file of {me} (fate-rdma site init): FATE_RDMA_SITE={target} in FATE-Flow's "
                f"environment,\n# or copy it to <FATE-Flow's Python prefix>/etc/fate_rdma/site.yaml\n")
        yaml.safe_dump(site, f, sort_keys=False)
    with open(os.path.join(out, "osx", "route_table.json"), "w") as f:
        json.dump(route_table(parties, me), f, indent=2)
    with open(os.path.join(out, "osx", "broker.properties"), "w") as f:
        f.write(broker_properties(parties, me))
    with open(os.path.join(out, "fate_flow", "service_conf.yaml"), "w") as f:
        f.write(f"# keys for {me}'s FATE-Flow: set them in its conf/service_conf.yaml (the rest stays as it is)\n")
        yaml.safe_dump(service_conf(parties, me), f, sort_keys=False)
    with open(os.path.join(out, "firewall.txt"), "w") as f:
        f.write(f"# inbound ports of {me}'s site ({parties[me]['host']})\n" + "\n".join(firewall(parties, me, provider))
                + "\n")
    steps: List[str] = []
    if security == "tls":
        stem = me.replace(":", "_")
        key = os.path.join(out, "tls", f"{stem}.key")
        if not os.path.exists(key) and request is not None:
            request(os.path.join(out, "tls"), me)
        steps.append(f"send {os.path.join(out, 'tls', stem + '.csr')} to the federation's CA, which runs `fate-rdma "
                     f"tls sign CA_DIR {stem}.csr --party {me}`; put the {stem}.pem and ca.pem it returns into "
                     f"{os.path.join(out, 'tls')} (the key never leaves this site)")
    else:
        steps.append(f"put the federation's secret (`fate-rdma secret FILE` once, the same file at every site) at "
                     f"{site['secret_file']} (mode 600); members can impersonate each other on a secret alone")
    steps += [f"OSX: set the keys of {out}/osx/broker.properties in OSX's conf/broker/broker.properties, copy "
              f"{out}/osx/route_table.json over its conf/broker/route_table.json, and (re)start it",
              f"FATE-Flow: set the keys of {out}/fate_flow/service_conf.yaml in its conf/service_conf.yaml and "
              f"restart it",
              f"fate-rdma: `fate-rdma hook install` with FATE-Flow's Python, and FATE_RDMA_SITE={target} in "
              f"FATE-Flow's environment (or copy the file to <its prefix>/etc/fate_rdma/site.yaml); "
              f"`fate-rdma flow check --site {target}`",
              f"open the ports of {out}/firewall.txt",
              f"when every site is done: `fate-rdma site check --serve --site {target}` at the peers, then "
              f"`fate-rdma site check --site {target}` here"]
    with open(os.path.join(out, "NEXT.txt"), "w") as f:
        f.write("".join(f"{i}. {s}\n" for i, s in enumerate(steps, 1)))
    return steps
