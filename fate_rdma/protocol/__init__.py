"""The sans-IO protocol of fate-rdma: frames, events, and one state machine per transfer mode.

No socket, thread, asyncio, time, grpc, fate or easypyverbs import here (a test enforces it): the
machines take bytes, completions and clock readings, and answer with the work to do.
"""
from .chunking import Chunk, plan_chunks
from .fedrdma import FedRdmaReceiver, FedRdmaSender
from .fedrdma_e import FedRdmaEReceiver, FedRdmaESender
from .frames import (CTRL, HEADER, Ctrl, CtrlKind, Header, HeaderKind, decode_ctrl, decode_header,
                     encode_ctrl, encode_header)
from .integrity import Integrity
from .pool import GrantState, ReceivePool, SlotRing, SlotState

__all__ = [
    "CTRL", "Chunk", "Ctrl", "CtrlKind", "FedRdmaEReceiver", "FedRdmaESender", "FedRdmaReceiver",
    "FedRdmaSender", "GrantState", "HEADER", "Header", "HeaderKind", "Integrity", "ReceivePool", "SlotRing",
    "SlotState", "decode_ctrl", "decode_header",
    "encode_ctrl", "encode_header", "plan_chunks",
]
