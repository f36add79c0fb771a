"""What a receiver keeps of transfers whose connection broke under them, for resume_window_s (resume.py is the
sender's side, and says when a connection counts as broken).

    FedRDMA    each transfer whose first bytes had arrived and been verified (`Held`: its reassembly buffer
               and that prefix)
    FedRDMA-E  each receive slot that may hold the last bytes of a transfer (`Kept`: grown for a large one, or
               named by PLACED notes, and not holding a transfer that arrived): its payload area as it was,
               written by no one from the break on. A sender that resumes the transfer claims (RESUME) the bytes
               it knows placed in that slot, from an offset to the end, with their digest; the slot is held
               (`Held`: that suffix) if this side's digest of those bytes is the same
    both       for twice the window, the ids of the transfers delivered (a verdict lost with its connection)

All of it counts against the memory budget, under the peer's name, and is let go of when the window passes,
when the endpoint closes, and (slots nobody claimed) when the peer sends a new transfer. The rest of a held
transfer arrives as a transfer of its own whose metadata says where it goes (`_resume`: [from, to, of]); it is
put beside what was held and the transfer delivered once, under its id.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

from numpy.typing import NDArray

from ..config import ChannelConfig
from ..errors import PeerUnreachable
from ..protocol.frames import ResumeState
from ..protocol.packing import SuffixClaim, suffix_digest
from .buffers import Budget, copy_into
from .transfer import Message

log = logging.getLogger("fate_rdma.channel")

#: the metadata key of a transfer that carries part of an earlier one: [its first byte, the byte after its last,
#: the whole's bytes] (the rest of a FedRDMA transfer: [held, whole, whole]; of a FedRDMA-E one: [0, held from,
#: whole]; one sent whole again: [0, whole, whole])
RESUME_KEY = "_resume"


class PeerEngine(Protocol):
    """What the holdings need of a connection's engine (engine.Engine)."""

    @property
    def dead(self) -> Optional[BaseException]: ...

    @property
    def thread(self) -> threading.Thread: ...

    def break_off(self, why: PeerUnreachable) -> None: ...

    def answer_resume(self, tid: int, state: ResumeState, held: int) -> None: ...


class Keeper(Protocol):
    """What the holdings need of their endpoint (endpoint.Endpoint)."""

    @property
    def name(self) -> str: ...

    @property
    def config(self) -> ChannelConfig: ...

    @property
    def budget(self) -> Budget: ...

    def recv_alloc(self, n: int) -> Any: ...

    def engines_of(self, peer: str) -> Sequence[PeerEngine]: ...


@dataclasses.dataclass
class Held:
    """What a receiver holds of a transfer of `total` bytes into `dest`: bytes [lo, hi), verified."""

    total: int
    dest: NDArray[Any]
    lo: int
    hi: int
    deadline: float
    reserved: int
    mode: str


@dataclasses.dataclass(eq=False)
class Kept:
    """A FedRDMA-E receive slot of a connection that broke: its payload area (`payload`), as it was."""

    slot: int
    payload: NDArray[Any]
    deadline: float
    reserved: int


class Holdings:
    """A receiving endpoint's transfers kept across connections (see the module's docstring)."""

    def __init__(self, endpoint: Keeper, window_s: float) -> None:
        self.endpoint, self.window_s = endpoint, window_s
        self._lock = threading.Lock()
        self._held: Dict[Tuple[str, int], Held] = {}
        self._kept: Dict[str, List[Kept]] = {}
        self._delivered: Dict[Tuple[str, int], float] = {}
        self._closed = False

    def keep(self, peer: str, tid: int, total: int, meta: Optional[bytes], dest: NDArray[Any], prefix: int) -> None:
        """A FedRDMA transfer from `peer` whose connection broke after its first `prefix` bytes arrived and were
        verified (the engine's thread): hold them for the window, within the memory budget."""
        from easypyverbs.bootstrap import loads_object

        try:
            md = loads_object(meta or b"{}")
        except ValueError:
            md = {}
        part = resume_field(md.get(RESUME_KEY), total) if isinstance(md, dict) else None
        with self._lock:
            if part is not None:  # part of an earlier transfer: what arrived of it goes behind what was held
                lo, _hi, whole = part
                held = self._held.get((peer, tid))
                if held is not None and held.total == whole and held.lo == 0 and lo <= held.hi:
                    copy_into(held.dest, lo, dest.data.cast("B")[:prefix])
                    held.hi = max(held.hi, lo + prefix)
                    held.deadline = time.monotonic() + self.window_s
                return
            if prefix <= 0 or self._closed or not self.endpoint.budget.reserve(total, peer):
                return
            self._held[(peer, tid)] = Held(total, dest, 0, prefix, time.monotonic() + self.window_s, total, "fedrdma")
        log.info("fate-rdma endpoint %s: holding %d of %d bytes of transfer %d from %s for resume_window_s (%g s)",
                 self.endpoint.name, prefix, total, tid, peer, self.window_s)

    def keep_slot(self, peer: str, slot: int, payload: NDArray[Any], nbytes: int) -> None:
        """A FedRDMA-E receive slot of `peer` whose connection broke (the engine's thread; `payload`: its payload
        area, which no one writes any more; `nbytes`: what it held of the budget): keep it for the window,
        within the memory budget, for a sender that claims the last bytes of a transfer in it."""
        with self._lock:
            if self._closed or not self.endpoint.budget.reserve(nbytes, peer):
                return
            self._kept.setdefault(peer, []).append(Kept(slot, payload, time.monotonic() + self.window_s, nbytes))
        log.info("fate-rdma endpoint %s: keeping receive slot %d of %s (%d bytes) for resume_window_s (%g s)",
                 self.endpoint.name, slot, peer, payload.nbytes, self.window_s)

    def answer(self, engine: PeerEngine, peer: str, tid: int, total: int, claim: Optional[SuffixClaim]) -> None:
        """`peer` asks on `engine`'s connection what this side holds of its transfer `tid` (RESUME; in the
        engine's turn). Where another connection from it is still up here (this side has not seen it break
        yet), that one is ended first, its transfers kept, so that nothing arrives on it after the answer; a
        claim's bytes are digested beside the engine (a large suffix takes a while)."""
        # (one that broke and is still ending keeps what it held meanwhile: the answer waits for it too)
        others = [e for e in self.endpoint.engines_of(peer) if e is not engine
                  and (e.dead is None or e.thread.is_alive())]
        if not others and claim is None:
            engine.answer_resume(tid, *self.query(peer, tid, total))
            return

        def later() -> None:
            for e in others:
                if e.dead is None:
                    e.break_off(PeerUnreachable(f"{peer} resumed its transfers on a new connection"))
            for e in others:
                e.thread.join(timeout=self.endpoint.config.connect_timeout_s / 2)  # (the asker waits connect_timeout_s)
            engine.answer_resume(tid, *self.query(peer, tid, total, claim))

        threading.Thread(target=later, name=f"fate-rdma-resume-answer-{peer}", daemon=True).start()

    def query(self, peer: str, tid: int, total: int, claim: Optional[SuffixClaim] = None) -> Tuple[ResumeState, int]:
        """What this side holds of `peer`'s transfer `tid` of `total` bytes (its RESUME, with the sender's claim
        if it made one); held bytes stay held for another window (the rest is on its way)."""
        key = (peer, tid)
        with self._lock:
            if key in self._delivered:
                return ResumeState.DELIVERED, 0
            held = self._held.get(key)
            if held is not None and held.total != total:
                log.warning("fate-rdma endpoint %s: %s resumes transfer %d as %d bytes, %d were arriving: sent whole "
                            "again", self.endpoint.name, peer, tid, total, held.total)
                self._drop(key)
                return ResumeState.UNKNOWN, 0
            if held is not None:
                held.deadline = time.monotonic() + self.window_s
                return (ResumeState.PARTIAL, held.hi) if held.lo == 0 else (ResumeState.SUFFIX, held.lo)
            if claim is None:
                return ResumeState.UNKNOWN, 0
            slots = [k for k in self._kept.get(peer, []) if k.slot == claim.slot and k.payload.nbytes >= total]
        for k in slots:  # (the digest outside the lock: other connections' frames go on meanwhile)
            if suffix_digest(tid, total, claim.start, [k.payload.data[claim.start:total]]) != claim.digest:
                continue
            with self._lock:
                mine = self._kept.get(peer, [])
                if k not in mine:
                    continue  # (let go of meanwhile)
                mine.remove(k)
                self._held[key] = Held(total, k.payload[:total], claim.start, total, time.monotonic() + self.window_s,
                                       k.reserved, "fedrdma-e")
            log.info("fate-rdma endpoint %s: holding %d of %d bytes of transfer %d from %s (receive slot %d)",
                     self.endpoint.name, total - claim.start, total, tid, peer, claim.slot)
            return ResumeState.SUFFIX, claim.start
        log.warning("fate-rdma endpoint %s: %s resumes transfer %d claiming its bytes from %d in receive slot %d: %s; "
                    "sent whole again", self.endpoint.name, peer, tid, claim.start, claim.slot,
                    "their digest differs" if slots else "that slot is not kept")
        return ResumeState.UNKNOWN, 0

    def arrived(self, msg: Message) -> Optional[Message]:
        """A complete message (the endpoint's deliver): the message to deliver, None if there is none (a
        duplicate, or the rest of a transfer whose held part is gone: logged)."""
        key = (msg.peer, msg.transfer_id)
        md = msg.metadata if isinstance(msg.metadata, dict) else {}
        raw = md.pop(RESUME_KEY, None) if RESUME_KEY in md else None
        with self._lock:
            if key in self._delivered:
                log.warning("fate-rdma endpoint %s: transfer %d from %s arrived again after its delivery: dropped",
                            self.endpoint.name, msg.transfer_id, msg.peer)
                msg.release()
                return None
            self._delivered[key] = time.monotonic() + 2 * self.window_s
            if raw is None:  # a new transfer: the peer has asked about everything it resumes
                self._let_go_slots(msg.peer)
                return msg
            part = resume_field(raw, msg.nbytes)
            if part is None:
                self._delivered.pop(key)
                log.error("fate-rdma endpoint %s: transfer %d from %s: its %s field %r does not describe its %d "
                          "bytes: dropped", self.endpoint.name, msg.transfer_id, msg.peer, RESUME_KEY, raw, msg.nbytes)
                msg.release()
                return None
            lo, hi, total = part
            if (lo, hi) == (0, total):
                return msg
            held = self._held.pop(key, None)
            if held is None or held.total != total or min(lo, held.lo) or max(hi, held.hi) != total \
                    or lo > held.hi or held.lo > hi:
                self._delivered.pop(key)
                log.error("fate-rdma endpoint %s: transfer %d from %s: bytes %d to %d of it arrived, but what was held "
                          "of it %s: dropped", self.endpoint.name, msg.transfer_id, msg.peer, lo, hi,
                          "is gone (resume_window_s passed)" if held is None else "does not fit")
                if held is not None:
                    self._release(msg.peer, held)
                msg.release()
                return None
        copy_into(held.dest, lo, msg.view)
        msg.release()
        self._release(msg.peer, held)  # (the application's memory from here on, as any delivered message's)
        return Message(msg.peer, msg.transfer_id, md, held.dest.data.cast("B"), held.mode, None,
                       self.endpoint.recv_alloc)

    def expire(self) -> None:
        """Let go of what the window no longer covers."""
        now = time.monotonic()
        with self._lock:
            for key in [k for k, t in self._delivered.items() if t < now]:
                del self._delivered[key]
            for key in [k for k, h in self._held.items() if h.deadline < now]:
                log.warning("fate-rdma endpoint %s: transfer %d from %s not resumed within resume_window_s (%g s): "
                            "the %d bytes held of it are let go of", self.endpoint.name, key[1], key[0],
                            self.window_s, self._held[key].hi - self._held[key].lo)
                self._drop(key)
            for peer, kept in list(self._kept.items()):
                for k in [k for k in kept if k.deadline < now]:
                    kept.remove(k)
                    self.endpoint.budget.release(k.reserved, peer)
                if not kept:
                    del self._kept[peer]

    def _let_go_slots(self, peer: str) -> None:
        for k in self._kept.pop(peer, []):  # (with the lock held)
            self.endpoint.budget.release(k.reserved, peer)

    def _drop(self, key: Tuple[str, int]) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self._release(key[0], held)

    def _release(self, peer: str, held: Held) -> None:
        if held.reserved:
            self.endpoint.budget.release(held.reserved, peer)
            held.reserved = 0

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(h.reserved for h in self._held.values()) + sum(k.reserved for ks in self._kept.values()
                                                                       for k in ks)

    def close(self) -> None:
        """The endpoint closes: what is held is let go of."""
        with self._lock:
            self._closed = True
            for key in list(self._held):
                self._drop(key)
            for peer in list(self._kept):
                self._let_go_slots(peer)


def resume_field(raw: Any, nbytes: Optional[int]) -> Optional[Tuple[int, int, int]]:
    """[from, to, whole] of a `_resume` field read from the wire, checked; None if it is not one (`nbytes`: the
    bytes of the transfer that carries it, where known: to - from)."""
    if not (isinstance(raw, list) and len(raw) == 3 and all(type(x) is int for x in raw)):
        return None
    lo, hi, whole = raw
    if not 0 <= lo < hi <= whole or (nbytes is not None and hi - lo != nbytes):
        return None
    return lo, hi, whole
