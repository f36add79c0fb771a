"""easypyverbs: a small, typed verbs API over rdma-core's pyverbs, with a software provider.

    ctx = open_device()                      # pyverbs if an RDMA device exists, else soft
    pd = ctx.alloc_pd()
    mr = pd.reg_mr(bytearray(1 << 20), Access.all_rdma())
    cq = ctx.create_cq()
    qp = pd.create_qp(cq)
    qp.connect(peer_info)                    # QPInfo from the peer (see bootstrap / connection)
    qp.post_write(mr.sge(0, 4096), remote_mr, wr_id=1)
    cq.wait(timeout_s=5)

The soft provider emulates verbs over TCP (or shared memory between processes of one host) and says so
("soft (emulated verbs, not RDMA)");
`open_device(provider="soft", tls=MutualTLS.from_files(cert, key, ca))` puts its data connections in
mutual TLS.
"""
from .api import CQ, MR, PD, QP, SGE, Context
from .bootstrap import BootstrapConn, Listener, connect
from .connection import RCConnection, establish
from .device import Emulation, choose_provider, open_device
from .enums import Access, QPState, WCOpcode, WCStatus
from .errors import (BootstrapError, CompletionError, EasyVerbsError, NoDeviceError, PollTimeout,
                     UsageError)
from .providers.soft.link import LinkModel
from .resource import live_resources
from .tls import MutualTLS
from .types import WC, DataPath, DeviceInfo, PortInfo, QPCap, QPInfo, RemoteMR

__version__ = "0.1.0"

__all__ = [
    "Access", "BootstrapConn", "BootstrapError", "CQ", "CompletionError", "Context", "DataPath", "DeviceInfo",
    "EasyVerbsError", "LinkModel", "Listener", "MR", "MutualTLS", "NoDeviceError", "PD", "PollTimeout", "PortInfo",
    "QP", "QPCap", "QPInfo", "QPState", "RCConnection", "RemoteMR", "SGE", "UsageError", "WC",
    "WCOpcode", "WCStatus", "Emulation", "choose_provider", "connect", "establish", "live_resources", "open_device",
]
