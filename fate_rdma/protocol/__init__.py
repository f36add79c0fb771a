"""The sans-IO protocol of fate-rdma: frames and the hello (frames.py, hello.py), the numbers the wire packs
(packing.py), events, one state machine per transfer mode and side with its transition table (fedrdma.py,
fedrdma_e.py, pool.py), PLACED notes (placed.py), the ERROR codes (refusal.py) and the policy (policy.py).

No socket, thread, asyncio, time, grpc, fate or easypyverbs import here (a test enforces it): the
machines take bytes, completions and clock readings, and answer with the work to do.
"""
from .chunking import Chunk, plan_chunks
from .fedrdma import FedRdmaReceiver, FedRdmaSender, RecvState
from .fedrdma_e import FedRdmaEReceiver, FedRdmaESender, SlotRecvState
from .frames import (CTRL, HEADER, Ctrl, CtrlKind, Header, HeaderKind, decode_ctrl, decode_header,
                     encode_ctrl, encode_header)
from .hello import Hello, PoolOffer, StagingOffer
from .integrity import Integrity
from .packing import PlacedNote, SlotWrite, StagedWrite, decode_imm, decode_placed, encode_placed
from .pool import GrantState, ReceivePool, SlotRing, SlotState

__all__ = [
    "CTRL", "Chunk", "Ctrl", "CtrlKind", "FedRdmaEReceiver", "FedRdmaESender", "FedRdmaReceiver",
    "FedRdmaSender", "GrantState", "HEADER", "Header", "HeaderKind", "Hello", "Integrity", "PlacedNote", "PoolOffer",
    "ReceivePool", "RecvState", "SlotRecvState", "SlotRing", "SlotState", "SlotWrite", "StagedWrite", "StagingOffer",
    "decode_ctrl", "decode_header", "decode_imm", "decode_placed", "encode_ctrl", "encode_header", "encode_placed",
    "plan_chunks",
]
