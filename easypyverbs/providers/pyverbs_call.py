"""Calls into pyverbs, whatever they raise turned into easypyverbs errors: the one place the pyverbs provider
(pyverbs_provider.py) and its memory windows (pyverbs_windows.py) both go through to reach rdma-core."""
from __future__ import annotations

from typing import Any, Callable

from ..errors import EasyVerbsError, UsageError


def call(what: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """Run pyverbs code; whatever it raises leaves as an easypyverbs error (errno kept).

    PyverbsUserError (pyverbs refused the arguments before any verbs call) and the TypeError /
    ValueError / OverflowError of its Cython argument conversion become UsageError; every other
    PyverbsError (a failed verbs call) becomes EasyVerbsError with the call's errno.
    """
    from pyverbs.pyverbs_error import PyverbsError, PyverbsUserError

    try:
        return fn(*args, **kw)
    except PyverbsUserError as exc:
        raise UsageError(f"{what}: pyverbs refused it: {exc}") from exc
    except PyverbsError as exc:
        code = getattr(exc, "error_code", None)
        raise EasyVerbsError(f"{what} failed: {exc}", abs(code) if isinstance(code, int) and code else None) from exc
    except (TypeError, ValueError, OverflowError) as exc:
        raise UsageError(f"{what}: pyverbs rejected the arguments: {exc}") from exc
