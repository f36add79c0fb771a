"""Turns of a connection taken in borrowed threads (connection.py holds the protocol; this, where its turns
run). A user's send, release or cancel that finds no turn running is taken in the user's thread at once, and
on the soft provider the emulated NIC's thread that queued completions handles them itself
(SoftCQ.on_arrival): each saves a wake-up of the connection's engine thread, a few hundred microseconds a
message on a busy 2-core machine. Both take `_turn_lock` without blocking (else the engine takes the work on
its next turn), so no lock order arises; a failure in a borrowed turn is left in `_failed` for the engine's
thread, which ends the connection with it as it would with its own."""
from __future__ import annotations

from typing import Any

from .completions import on_wc
from .outgoing import Request


class Turns:
    """Connection's borrowed turns (a mixin: the state is Connection's)."""

    def _request(self, kind: Request, arg: Any) -> None:
        self._requests.append((kind, arg))
        # a send or a release is taken in the caller's thread when no turn is running (no hand-off to the
        # engine's thread, a few hundred us a message here); else the engine takes it on its next turn
        if kind is Request.STOP or not self._turn_lock.acquire(blocking=False):
            self.cq.wake()
            self._if_dead()
            return
        try:
            if self.dead is None and self._failed is None:
                self._turn()
        except BaseException as exc:  # the engine's thread fails the connection with it (as its own turn would)
            self._failed = exc
            self.cq.wake()
            if not isinstance(exc, Exception):
                raise  # (KeyboardInterrupt: the caller's too)
        finally:
            self._turn_lock.release()
        self._if_dead()

    def _if_dead(self) -> None:
        if self._dead_err is not None:  # (died before the request was taken: fail it as _die failed the rest)
            self._fail_requests(self._dead_err)

    def _on_arrival(self) -> bool:
        """SoftCQ.on_arrival: the NIC's thread that queued completions handles them, unless a turn is running
        (whose thread takes them next); False wakes the engine."""
        if not self._turn_lock.acquire(blocking=False):
            return False
        try:
            if self.dead is not None or self._failed is not None:
                return False
            wcs = self.cq.poll(64)
            while wcs:
                for wc in wcs:
                    on_wc(self, wc)
                wcs = self.cq.poll(64)
            self._turn()
            return True
        except BaseException as exc:  # (the engine's thread dies of it: woken, the queue may be empty now)
            self._failed = exc
            self.cq.wake()
            return False
        finally:
            self._turn_lock.release()

    def _fail_requests(self, err: BaseException) -> None:
        while True:  # (a user's thread may drain beside _die: each request is taken once)
            try:
                kind, arg = self._requests.popleft()
            except IndexError:
                return
            if kind is Request.SEND:
                arg.payload.close()
                if not arg.fut.done():
                    arg.fut.set_exception(err)
