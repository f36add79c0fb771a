"""The fate-rdma channel: endpoints, per-peer connections, transfers (futures) and messages.

Where things are:
    endpoint.py    Endpoint: listens, dials, keeps one Connection per peer, the inbox of messages
    dialer.py      a dial: the bootstrap connection (retried while the peer is at its cap), TLS, the proof
    accepting.py   an accept: TLS, the proof, the federation's parties, the seal (refusals counted)
    holds.py       what an endpoint says when its process stood still (no Python ran)
    connection.py  Connection: set-up (hello, memory, QPs, the modes' parts), the user's side, teardown
    engine.py      Engine: the loop that runs both modes (requests, turns taken in the caller's or the
                   soft NIC's thread, deadlines), their port
    inbound.py     the engine's half that reads: completions and the peer's control frames, checked
    ending.py      the engine's end: what becomes of its transfers and of what it was receiving
    resume.py      transfers that outlive a connection which broke under them: redial, ask, send the rest
    holding.py     the receiver's side of that: what arrived of them, kept for the window; delivered once
    port.py        the port a mode sees of its connection (SendPort, RecvPort: typing.Protocol)
    wire.py        a connection's QPs as the engine posts on them, and its signalled WRs
    path.py        a connection's path as the policy sizes transfers for it (RTT, chunk, window, QPs)
    handshake.py   the hello each side sends (validated field by field), the set-up confirmation, the goodbye
    layout.py      the registered memory of a connection and where each thing sits in it
    fedrdma.py     FedRDMA, a mode: chunks through staging buffers, ACKs, reassembly
    fedrdma_e.py   FedRDMA-E, a mode: chunks into receive slots, the receiver's verdict
    control.py     control frames as SENDs (sealed with their number where the connection has a key), the RTT probe
    outgoing.py    the engine's record of a transfer it sends; request and WR kinds
    transfer.py    what users get: TransferFuture, Message; Payload (buffers as MRs, zero copy)
    buffers.py     recycled FedRDMA reassembly buffers; the memory budget and a connection's share
    checksum.py    whole-payload digests (crc32c, XXH3, BLAKE3, BLAKE2b leaves) in parallel blocks; each
                   direction's checksum and MAC key
    auth.py        peer authentication (HMAC-SHA256 challenge-response), the session key, its keys per
                   direction and purpose, sealing the bootstrap after the proof
    tls.py         mutual TLS on the bootstrap; the party a certificate names
    posture.py     what an endpoint's settings protect, in words (its start-up log, doctor)
The protocol itself (frames, state machines, mode and window policy) is fate_rdma.protocol.
"""
from .connection import Connection
from .endpoint import Endpoint
from .transfer import Message, TransferFuture

__all__ = ["Connection", "Endpoint", "Message", "TransferFuture"]
