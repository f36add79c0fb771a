"""A deterministic link model for the soft provider: rate, one-way delay and packet loss.

Used to reproduce WAN behaviour (the FedRDMA paper's 10 Gbit/s, 20 ms RTT) on one machine without
root or netem. The model is applied by the sending side:

- **rate**: messages leave one after another; a message of n bytes occupies the link for
  `8 n / rate_bps` seconds (serialization). All QPs of one context share the link, as they would
  share a NIC port.
- **delay**: the receiver completes a message `delay_s` after its last bit left; its ACK takes
  another `delay_s` back, so a round trip costs `2 delay_s`.
- **loss**: every MTU-sized packet is lost with probability `loss` (seeded RNG, so runs repeat).
  RoCE NICs recover by go-back-N: a loss costs one round trip (NAK) plus resending the rest of the
  message, and the link stays busy meanwhile.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import random
import re
import threading
import time
from typing import Callable, Deque, Optional, Tuple

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """Parameters of the emulated link. `rate_bps=None` means unlimited (loopback speed)."""

    rate_bps: Optional[float] = None
    delay_s: float = 0.0
    loss: float = 0.0
    mtu: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rate_bps is not None and self.rate_bps <= 0:
            raise ValueError(f"rate_bps must be positive, got {self.rate_bps}")
        if not 0 <= self.delay_s <= 10:
            raise ValueError(f"delay_s must be within [0, 10] s, got {self.delay_s}")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss must be within [0, 1), got {self.loss}")
        if self.mtu < 256:
            raise ValueError(f"mtu must be >= 256, got {self.mtu}")

    @property
    def active(self) -> bool:
        return self.rate_bps is not None or self.delay_s > 0 or self.loss > 0

    @property
    def rtt_s(self) -> float:
        return 2 * self.delay_s

    def describe(self) -> str:
        rate = "unlimited" if self.rate_bps is None else f"{self.rate_bps / 1e9:g} Gbit/s"
        return f"rate {rate}, RTT {self.rtt_s * 1e3:g} ms, loss {self.loss:g}"

    @classmethod
    def parse(cls, text: str) -> "LinkModel":
        """Parse `rate=10gbit,rtt=20ms,loss=0.001` (also `delay=10ms` one way, `seed=1`, `mtu=4096`)."""
        kw: dict = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            if "=" not in part:
                raise ValueError(f"link model: expected key=value, got {part!r}")
            key, val = (s.strip().lower() for s in part.split("=", 1))
            if key == "rate":
                m = re.fullmatch(r"([0-9.]+)\s*([kmgt]?)(bit|bps|b)?(/s)?", val)
                if not m:
                    raise ValueError(f"link model: bad rate {val!r} (try 10gbit)")
                kw["rate_bps"] = float(m.group(1)) * _UNITS[m.group(2)]
            elif key in ("delay", "rtt"):
                m = re.fullmatch(r"([0-9.]+)\s*(ms|us|s)?", val)
                if not m:
                    raise ValueError(f"link model: bad time {val!r} (try 20ms)")
                secs = float(m.group(1)) * {"ms": 1e-3, "us": 1e-6, "s": 1.0, None: 1e-3}[m.group(2)]
                kw["delay_s"] = secs / 2 if key == "rtt" else secs
            elif key == "loss":
                kw["loss"] = float(val.rstrip("%")) / (100 if val.endswith("%") else 1)
            elif key in ("seed", "mtu"):
                kw[key] = int(val)
            else:
                raise ValueError(f"link model: unknown key {key!r} (rate, rtt, delay, loss, mtu, seed)")
        return cls(**kw)


class Link:
    """The sending side of one emulated link, shared by the QPs of a context."""

    def __init__(self, model: LinkModel) -> None:
        self.model = model
        self._lock = threading.Lock()
        self._free_at = 0.0
        self._rng = random.Random(model.seed)
        self.losses = 0

    def reserve(self, nbytes: int, now: float) -> float:
        """Occupy the link for `nbytes`; returns the time the last bit leaves."""
        m = self.model
        with self._lock:
            start = max(now, self._free_at)
            busy = 0.0 if m.rate_bps is None else nbytes * 8 / m.rate_bps
            if m.loss > 0:
                npkt = max(1, math.ceil(nbytes / m.mtu))
                for i in range(npkt):
                    if self._rng.random() < m.loss:
                        self.losses += 1
                        resend = nbytes - i * m.mtu
                        busy += m.rtt_s + (0.0 if m.rate_bps is None else resend * 8 / m.rate_bps)
            self._free_at = start + busy
            return self._free_at


class DelayLine:
    """Runs callables in FIFO order, each no earlier than its due time, on one thread.

    All items of a line have the same delay, so FIFO order is also due-time order.
    """

    def __init__(self, name: str) -> None:
        self._items: Deque[Tuple[float, Callable[[], None]]] = collections.deque()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, due: float, fn: Callable[[], None]) -> None:
        with self._cv:
            self._items.append((due, fn))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._items and not self._stop:
                    self._cv.wait()
                if not self._items:
                    return
                due, fn = self._items[0]
                wait = due - time.monotonic()
                if wait > 0 and not self._stop:
                    self._cv.wait(wait)
                    continue
                self._items.popleft()
            fn()

    def close(self, drain: bool = True) -> None:
        with self._cv:
            if not drain:
                self._items.clear()
            self._stop = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
