"""Errors of fate-rdma: one root, classes per failure, split by whose fault it is (STYLE.md §2)."""
from __future__ import annotations

from typing import Optional


class FateRdmaError(Exception):
    """Root of every fate-rdma error."""


class ConfigError(FateRdmaError, ValueError):
    """Inconsistent or invalid configuration."""


class LocalProtocolError(FateRdmaError):
    """This side used the protocol wrongly (an event that is not allowed in the current state)."""


class RemoteProtocolError(FateRdmaError):
    """The peer sent something malformed or out of place."""


class TransferError(FateRdmaError):
    """A transfer failed; `transfer_id` names it when known."""

    def __init__(self, msg: str, transfer_id: Optional[int] = None) -> None:
        super().__init__(msg)
        self.transfer_id = transfer_id


class TransferTimeout(TransferError):
    """No progress within the no-progress deadline, or the total deadline passed."""


class TransferCancelled(TransferError):
    """Cancelled by this side or by the peer."""


class IntegrityError(TransferError):
    """A checksum did not match: the bytes that arrived are not the bytes that were sent."""


class PayloadTooLarge(TransferError):
    """The payload exceeds what the peer accepts (e.g. its FedRDMA-E receive MR size)."""


class PeerUnreachable(TransferError):
    """The peer cannot be reached or its connection died."""


class PeerLeft(PeerUnreachable):
    """The peer closed its endpoint and said so: nothing it was sending will be resumed."""


class AuthenticationError(RemoteProtocolError):
    """The peer did not prove that it holds the federation's secret, or proved another identity than
    the one it must have."""
