"""The fate-rdma channel: endpoints, per-peer connections, transfers (futures) and messages.

Where things are:
    endpoint.py    Endpoint: listens, dials, keeps one Connection per peer, the inbox of messages
    connection.py  Connection: set-up, and the engine loop shared by both modes (requests, turns taken
                   in the caller's thread, deadlines, teardown)
    turns.py       a connection's turns taken in borrowed threads: a user's send, release or cancel
                   at once, the soft NIC's completions where they land
    completions.py a connection's work completions and the peer's control frames
    handshake.py   the hello each side sends (validated field by field), the set-up confirmation
    layout.py      the registered memory of a connection and where each thing sits in it
    fedrdma.py     FedRDMA's engine: chunks through staging buffers, ACKs, reassembly
    fedrdma_e.py   FedRDMA-E's engine: chunks into receive slots, the receiver's verdict
    control.py     control frames as SENDs, and the RTT probe
    outgoing.py    the engine's record of a transfer it sends; request and WR kinds
    transfer.py    what users get: TransferFuture, Message; Payload (buffers as MRs, zero copy)
    buffers.py     recycled FedRDMA reassembly buffers
    checksum.py    whole-payload crc32c or BLAKE2b leaves in parallel blocks; each direction's checksum
    auth.py        peer authentication (HMAC-SHA256 challenge-response) and the session key
The protocol itself (frames, state machines, mode and window policy) is fate_rdma.protocol.
"""
from .connection import Connection
from .endpoint import Endpoint
from .transfer import Message, TransferFuture

__all__ = ["Connection", "Endpoint", "Message", "TransferFuture"]
