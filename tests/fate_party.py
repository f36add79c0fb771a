"""One FATE party (standalone or OSX engine) in its own process, for tests/test_federation.py: it gets
`--name` from the guest and prints the sha256 of what arrived, plus its fate-rdma stats, as JSON."""
import argparse
import hashlib
import json
import pickle
import sys


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--fed-id", required=True)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--section", default="null")
    p.add_argument("--names", default="w")
    p.add_argument("--osx", default=None, help="host:port of an OSX server: use FATE's OSX engine")
    a = p.parse_args()
    section = json.loads(a.section)
    from fate.arch.computing.backends.standalone import CSession
    from fate.arch.context import Context
    from fate.arch.federation import FederationBuilder

    from fate_rdma.federation import activate

    if section is not None:
        activate.install(section)
    party = ("host", "10000")
    cs = CSession(session_id=f"{a.fed_id}_host_10000", data_dir=a.data_dir)
    builder = FederationBuilder(federation_session_id=a.fed_id, party=party, parties=[("guest", "9999"), party])
    if a.osx:
        host, _, port = a.osx.rpartition(":")
        fed = builder.build_osx(cs, host, int(port))
    else:
        fed = builder.build_standalone(cs)
    ctx = Context(computing=cs, federation=fed)
    out = {}
    try:
        for name in a.names.split(","):
            out[name] = hashlib.sha256(pickle.dumps(ctx.guest.get(name))).hexdigest()
        rdma = getattr(fed, "fate_rdma", None)
        out["stats"] = rdma.stats if rdma else None
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out), flush=True)
    rdma = getattr(fed, "fate_rdma", None)
    if rdma:
        rdma.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
