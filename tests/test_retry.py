"""The retry policy, driven by a fake clock and wait: no test sleeps."""
from __future__ import annotations

import socket
from typing import List

import pytest

import easypyverbs as ev
from easypyverbs.bootstrap import connect_with
from easypyverbs.retry import Retry


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.waits: List[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.waits.append(s)
        self.now += s


def test_pauses_double_up_to_the_cap_and_stop_at_the_deadline() -> None:
    t = FakeTime()
    r = Retry(timeout_s=2.0, first_pause_s=0.1, max_pause_s=0.5, clock=t.clock, sleep=t.sleep)
    attempts = list(r)
    assert t.waits == [0.1, 0.2, 0.4, 0.5, 0.5]  # 1.7 s waited; one more 0.5 s would pass the deadline
    assert attempts == [0, 1, 2, 3, 4, 5] and r.attempts == 6
    assert r.left_s() == pytest.approx(0.3)


def test_a_zero_timeout_still_makes_one_attempt() -> None:
    t = FakeTime()
    assert list(Retry(timeout_s=0.0, clock=t.clock, sleep=t.sleep)) == [0] and t.waits == []


def test_bad_policies_are_refused() -> None:
    for kw in ({"timeout_s": -1.0}, {"timeout_s": 1.0, "first_pause_s": 0.0},
               {"timeout_s": 1.0, "first_pause_s": 0.5, "max_pause_s": 0.1}):
        with pytest.raises(ValueError, match="bad retry policy"):
            Retry(**kw)


def test_bootstrap_connect_retries_a_refused_port_and_names_the_attempts() -> None:
    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        t = FakeTime()
        with pytest.raises(ev.BootstrapError, match=r"within 1 s \(\d+ attempts\)") as info:
            connect_with("127.0.0.1", port, Retry(timeout_s=1.0, clock=t.clock, sleep=t.sleep))
    assert len(t.waits) >= 4 and sum(t.waits) < 1.0
    assert isinstance(info.value.__cause__, OSError)
