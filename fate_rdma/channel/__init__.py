"""The fate-rdma channel: endpoints, per-peer connections, transfers (futures) and messages."""
from .connection import Connection
from .endpoint import Endpoint
from .transfer import Message, TransferFuture

__all__ = ["Connection", "Endpoint", "Message", "TransferFuture"]
