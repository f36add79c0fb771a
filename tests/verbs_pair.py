"""An RC pair stood up in one process (swap QPInfo directly), for the conformance suite."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List

import pytest

import easypyverbs as ev

#: "soft" takes the same-host path here (both ends in one process), copying by process_vm_readv; "soft-shm"
#: the same path with every buffer in shared memory (easypyverbs.buffers.shared_array, a memoryview of it),
#: copied through the responder's mapping of the requester's region; "soft-tcp" is the soft provider
#: with that path off, i.e. as between hosts; "soft-tls" is soft-tcp with mutual TLS on every data
#: connection (tls: true): the conformance suite runs on all three
PROVIDERS = ["soft", "soft-shm", "soft-tcp", "soft-tls", "pyverbs"]
_tls: Dict[str, Any] = {}


def soft_tls() -> Any:
    """Mutual TLS contexts from a throwaway CA (made once per test process with `fate-rdma tls init`'s
    function, the openssl tool)."""
    if "ctx" not in _tls:
        import atexit
        import shutil
        import tempfile

        from easypyverbs.tls import MutualTLS
        from fate_rdma.cli.tls import make_certificates

        if shutil.which("openssl") is None:
            pytest.skip("soft-tls needs the openssl command line tool to make certificates")
        folder = tempfile.mkdtemp(prefix="fate-rdma-test-tls-")
        atexit.register(shutil.rmtree, folder, True)
        f = make_certificates(folder, ["verbs-pair"])["verbs-pair"]
        _tls["ctx"] = MutualTLS.from_files(f.cert, f.key, f.ca)
    return _tls["ctx"]


def require(provider: str) -> None:
    if provider == "pyverbs":
        ok, why, devices = ev.device.pyverbs_status()
        if not (ok and devices):
            pytest.skip(f"pyverbs provider not usable here: {why}")


def open_ctx(provider: str, **soft_opts: Any) -> ev.Context:
    if provider in ("soft", "soft-shm", "soft-tcp", "soft-tls"):
        opts = {"rnr_timeout_s": 0.3, "retry_timeout_s": 3.0, "same_host": provider in ("soft", "soft-shm")}
        if provider == "soft-tls":
            opts["tls"] = soft_tls()
        opts.update(soft_opts)
        return ev.open_device(provider="soft", **opts)
    return ev.open_device(provider="pyverbs")


@dataclasses.dataclass
class Side:
    ctx: ev.Context
    pd: ev.PD
    cq: ev.CQ
    qp: ev.QP
    buf: bytearray
    mr: ev.MR


def make_pair(provider: str, size: int = 1 << 16, cap: ev.QPCap = ev.QPCap(), **soft_opts: Any) -> List[Side]:
    sides = []
    for _ in range(2):
        ctx = open_ctx(provider, **soft_opts)
        pd = ctx.alloc_pd()
        cq = ctx.create_cq(1024)
        qp = pd.create_qp(cq, cq, cap)
        buf: Any = memoryview(ev.buffers.shared_array(size)) if provider == "soft-shm" else bytearray(size)
        mr = pd.reg_mr(buf, ev.Access.all_rdma())
        sides.append(Side(ctx, pd, cq, qp, buf, mr))
    a, b = sides
    ia, ib = a.qp.info(), b.qp.info()
    a.qp.connect(ib)
    b.qp.connect(ia)
    return sides


def close_pair(sides: List[Side]) -> None:
    for s in sides:
        s.ctx.close()
