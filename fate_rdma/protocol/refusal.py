"""The ERROR frame's codes in both directions: which code a receiver refuses a transfer with, for the error its
checks raised (`code_for`), and which error the sender fails the transfer with, for the code it reads
(`refusal`). One table, so that both ends read a code alike.
"""
from __future__ import annotations

from typing import Dict, Type

from ..errors import (FateRdmaError, IntegrityError, PayloadTooLarge, RemoteProtocolError, TransferError,
                      TransferTimeout)
from .frames import Ctrl, CtrlKind, ErrorCode

#: what each ERROR code stands for; a code not here (from a newer peer) reads as a plain TransferError
ERRORS: Dict[ErrorCode, Type[FateRdmaError]] = {
    ErrorCode.INTEGRITY: IntegrityError, ErrorCode.TOO_LARGE: PayloadTooLarge, ErrorCode.PROTOCOL: RemoteProtocolError,
    ErrorCode.TIMEOUT: TransferTimeout}


def code_for(exc: BaseException) -> ErrorCode:
    """The code a receiver refuses a transfer with when its checks raised `exc` (a protocol error when the
    table names nothing more specific)."""
    for code, cls in ERRORS.items():
        if code is not ErrorCode.PROTOCOL and isinstance(exc, cls):
            return code
    return ErrorCode.PROTOCOL


def error_frame(transfer_id: int, code: ErrorCode, reason: str) -> Ctrl:
    """The ERROR that refuses `transfer_id` (its reason cut to what a control buffer holds with room to spare)."""
    return Ctrl(CtrlKind.ERROR, transfer_id, int(code), 0, reason[:500])


def refusal(c: Ctrl, peer: str) -> FateRdmaError:
    """What the peer's ERROR frame `c` (it refused transfer `c.transfer_id`) fails that transfer with."""
    cls = ERRORS.get(ErrorCode(c.value), TransferError) if c.value in ErrorCode.__members__.values() else TransferError
    why = f"transfer {c.transfer_id} refused by {peer}: {c.reason}"
    return cls(why, c.transfer_id) if issubclass(cls, TransferError) else cls(why)
