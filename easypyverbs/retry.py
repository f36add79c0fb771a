"""Retry policy: exponential back-off between attempts, bounded by a deadline, with the clock and the wait
passed in so that tests can drive it without sleeping.

    retry = Retry(timeout_s=10.0)
    for attempt in retry:          # yields 0, 1, 2, ... while time is left, waiting between attempts
        try:
            return dial()
        except OSError as exc:
            retry.failed(exc)      # remembers the last error; the loop ends when the next wait would pass the deadline
    raise ...(retry.last_error)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional


@dataclass
class Retry:
    """Attempts until `timeout_s` has passed on `clock`; between two, `sleep(pause)` with the pause doubling
    from `first_pause_s` up to `max_pause_s`. The first attempt is always made."""
    timeout_s: float
    first_pause_s: float = 0.02
    max_pause_s: float = 0.5
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    last_error: Optional[BaseException] = field(default=None, init=False)
    attempts: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.timeout_s < 0 or self.first_pause_s <= 0 or self.max_pause_s < self.first_pause_s:
            raise ValueError(f"bad retry policy: timeout_s={self.timeout_s}, first_pause_s={self.first_pause_s}, "
                             f"max_pause_s={self.max_pause_s}")
        self.deadline = self.clock() + self.timeout_s

    def left_s(self) -> float:
        """Seconds left before the deadline (0 when it has passed)."""
        return max(0.0, self.deadline - self.clock())

    def failed(self, exc: BaseException) -> None:
        self.last_error = exc

    def __iter__(self) -> Iterator[int]:
        pause = self.first_pause_s
        while True:
            self.attempts += 1
            yield self.attempts - 1
            if self.clock() + pause >= self.deadline:
                return
            self.sleep(pause)
            pause = min(pause * 2, self.max_pause_s)
