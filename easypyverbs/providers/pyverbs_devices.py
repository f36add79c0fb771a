"""The RDMA devices rdma-core lists here, how an rxe device is named, and pyverbs' own version (pyverbs_provider.py
opens them)."""
from __future__ import annotations

import logging
import os
from typing import Any, List, Tuple

#: how logs, doctor and benchmark lines name Soft-RoCE (rxe): real kernel verbs over a software NIC
SOFT_ROCE_TCG_VM = "Soft-RoCE (rxe) in a TCG VM: verbs semantics, not RDMA performance"
SOFT_ROCE_KVM_VM = "Soft-RoCE (rxe) in a KVM VM: verbs semantics, not RDMA performance"
SOFT_ROCE = "Soft-RoCE (rxe): kernel verbs over a software NIC, not RDMA hardware performance"
RXE_VENDOR_ID = 0xFFFFFF  # what rdma_rxe reports as ibv_device_attr.vendor_id


def _import_device_module() -> Any:
    """Import pyverbs.device without its side effect: pyverbs calls logging.basicConfig(level=INFO)
    on import, which would turn on every library's INFO logs in the host process."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        import pyverbs.device as d
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return d


def status() -> Tuple[bool, str, List[str]]:
    """(pyverbs importable, explanation, RDMA device names)."""
    try:
        d = _import_device_module()
    except ImportError as exc:
        return False, f"pyverbs is not importable ({exc}); run deploy/install-rdma-core.sh", []
    try:
        devs = d.get_device_list()
    except Exception as exc:  # PyverbsRDMAError('Failed to get devices list') when there is none
        return True, f"rdma-core lists no RDMA device ({exc})", []
    names = [dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name) for dev in devs]
    if not names:
        return True, "rdma-core lists no RDMA device", []
    return True, "ok", names


def version() -> str:
    try:
        import pyverbs

        return getattr(pyverbs, "__version__", "") or os.path.dirname(pyverbs.__file__)
    except ImportError:
        return ""


def soft_roce_label() -> str:
    """The label of an rxe device here: in the project's qemu VM (frvm.accel= on the kernel
    command line, set by `fate-rdma vm run`) it names the accelerator."""
    try:
        with open("/proc/cmdline") as f:
            args = f.read().split()
    except OSError:
        args = []
    accel = next((a.split("=", 1)[1] for a in args if a.startswith("frvm.accel=")), "")
    return {"tcg": SOFT_ROCE_TCG_VM, "kvm": SOFT_ROCE_KVM_VM}.get(accel, SOFT_ROCE)


def gid_type(dev: str, port: int, index: int) -> str:
    try:
        with open(f"/sys/class/infiniband/{dev}/ports/{port}/gid_attrs/types/{index}") as f:
            return f.read().strip()
    except OSError:
        return ""
