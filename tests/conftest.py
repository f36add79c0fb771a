"""Shared fixtures: every test ends with no easypyverbs object open and no soft-provider thread alive."""
from __future__ import annotations

import threading
import time

import pytest

import easypyverbs as ev


def soft_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("soft-") and t.is_alive()]


@pytest.fixture(autouse=True)
def no_leaks():
    yield
    left = ev.live_resources()
    for r in left:
        r.close()
    assert not left, f"test leaked open verbs objects: {left}"
    deadline = time.monotonic() + 5
    while soft_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not soft_threads(), f"test leaked soft-provider threads: {soft_threads()}"


def require_same_host() -> None:
    """Skip, naming why, a test of the soft provider's same-host path where an endpoint would not take it
    (switched off by EASYPYVERBS_SOFT_SAME_HOST, or process_vm_readv refused): it would run over TCP instead."""
    from easypyverbs.providers.soft import samehost

    ok, why = samehost.available()
    if not ok:
        pytest.skip(f"the soft provider's same-host path is not available here: {why}")
