"""One party of examples/fedavg_weights/fedavg.py (the launcher example's `run(ctx)`, unchanged) on FATE's
rabbitmq federation engine, for tests/test_rabbitmq.py. FATE 2.2's multiprocess launcher only builds
standalone (local) or OSX (cluster) contexts, so this builds the context the way FATE's component
runner does for a rabbitmq task (`fate/components/core/_load_federation.py`):
FederationBuilder(...).build_rabbitmq(computing, host, port, options).

fate-rdma is on when FATE_RDMA_CONF is set (as for the launcher's children). Every AMQP message this
party publishes, from this process or from FATE's computing workers (forked), is counted in
`<out>/<role>.mq` (one line per message: its body's length). After writing its result the party waits
for the others' results before ctx.destroy() (FATE's rabbitmq destroy deletes the shared vhosts), as
the launcher waits for all ranks before destroying."""
import argparse
import json
import logging
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROLES = {"guest": "9999", "host": "10000", "arbiter": "10000"}


def count_published(path: str) -> None:
    from fate.arch.federation.backends.rabbitmq._mq_channel import MQChannel

    orig = MQChannel.produce

    def produce(self, body, properties):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{len(body)}\n".encode())
        finally:
            os.close(fd)
        return orig(self, body, properties)

    MQChannel.produce = produce


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--role", required=True, choices=sorted(ROLES))
    p.add_argument("--fed-id", required=True)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--rabbitmq", required=True, help="JSON: FederationBuilder.build_rabbitmq's options")
    p.add_argument("--out", required=True)
    p.add_argument("--params", type=int, default=400_000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--wait-s", type=float, default=120, help="how long to wait for the other parties' results")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format=f"[{a.role}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("fate_rdma").setLevel(logging.INFO)
    os.makedirs(a.out, exist_ok=True)
    count_published(os.path.join(a.out, f"{a.role}.mq"))

    from fate.arch.computing.backends.standalone import CSession
    from fate.arch.context import Context
    from fate.arch.federation import FederationBuilder

    if os.environ.get("FATE_RDMA_CONF"):
        from fate_rdma.federation import activate

        activate.install()  # what the start-up hook does on import (a no-op if it already did)
    opts = json.loads(a.rabbitmq)
    party = (a.role, ROLES[a.role])
    parties = [(r, pid) for r, pid in ROLES.items()]
    cs = CSession(session_id=f"{a.fed_id}_{a.role}_{party[1]}", data_dir=a.data_dir)
    fed = FederationBuilder(federation_session_id=a.fed_id, party=party, parties=parties).build_rabbitmq(
        cs, host=opts["host"], port=opts["port"], options=opts)
    ctx = Context(computing=cs, federation=fed)
    with open(os.path.join(a.out, f"{a.role}.engine.json"), "w") as f:
        json.dump({"federation": type(fed).__name__, "wrapped": getattr(fed, "fate_rdma", None) is not None}, f)
    sys.path.insert(0, os.path.join(ROOT, "examples", "fedavg_weights"))
    import fedavg

    sys.argv = [fedavg.__file__, "--params", str(a.params), "--rounds", str(a.rounds), "--out", a.out]
    try:
        fedavg.run(ctx)
        deadline = time.monotonic() + a.wait_s
        while not all(os.path.exists(os.path.join(a.out, f"{r}.json")) for r in ROLES):
            if time.monotonic() > deadline:
                print(f"[{a.role}] the other parties' results did not appear within {a.wait_s:g} s", file=sys.stderr)
                return 3
            time.sleep(0.1)
    finally:
        ctx.destroy()  # FATE's rabbitmq clean-up (vhosts, queues, the session's user); fate-rdma's endpoint
    return 0


if __name__ == "__main__":
    sys.exit(main())
