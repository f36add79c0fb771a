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
