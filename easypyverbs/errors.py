"""Exceptions of easypyverbs: one root, split by whose fault it is.

- `EasyVerbsError` is the root; it carries `errno` (as pyverbs' `PyverbsRDMAError` does) when the
  failure came from a verbs call or a socket.
- `UsageError`: the caller misused the API (bad offset, closed object, queue full).
- `NoDeviceError`: no provider or RDMA device is usable.
- `CompletionError`: a work request completed with an error status; carries the `WC`.
- `PollTimeout`: a bounded wait for a completion ran out.
- `BootstrapError`: the out-of-band TCP exchange failed or the peer sent something malformed.
"""
from __future__ import annotations

import errno as _errno
from typing import Any, Optional


class EasyVerbsError(Exception):
    """Root of every error raised by easypyverbs."""

    def __init__(self, msg: str, errno: Optional[int] = None) -> None:
        super().__init__(msg if errno is None else f"{msg} (errno {errno}: {_errno.errorcode.get(errno, '?')})")
        self.errno = errno


class UsageError(EasyVerbsError):
    """The caller used the API wrongly (local fault)."""


class NoDeviceError(EasyVerbsError):
    """No usable verbs provider or RDMA device."""


class PollTimeout(EasyVerbsError):
    """No completion arrived within the given time."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg, _errno.ETIMEDOUT)


class BootstrapError(EasyVerbsError):
    """The TCP bootstrap exchange failed (peer gone, garbage, timeout)."""


class CompletionError(EasyVerbsError):
    """A work completion carried an error status."""

    def __init__(self, wc: Any, msg: str = "") -> None:
        self.wc = wc
        self.status = wc.status
        super().__init__(msg or f"work request {wc.wr_id} completed with {wc.status.name}")
