"""FedRDMA-E receive slots that follow the traffic: a slot starts small, grows when a transfer needs
more room (up to the size the receiver offered in its hello), and shrinks when the receiver is idle.

A slot is the receiver's memory, granted to one peer under an rkey with room for `capacity` payload
bytes. Grants change by control frames on QP 0, which arrive in order in each direction, and a
transfer's WRITE_WITH_IMM (its header, on QP 0 too) arrives in order with the sender's frames:

    GROW     sender -> receiver: transfer_id, value = slot, aux = payload bytes the transfer needs. Sent
             before the transfer's first WRITE; answered by a CREDIT with room enough, or by an ERROR for
             the transfer (slot maximum or memory budget exceeded, or a field out of range): the old
             grant then stands.
    CREDIT   receiver -> sender: value = slot, aux = rkey, transfer_id = capacity. The slot is the
             sender's to write again, under that rkey, up to that many payload bytes.
    RECLAIM  receiver -> sender: value = slot, aux = rkey of the grant asked back. The receiver has been
             idle for pool_idle_s and wants to shrink a grown slot.
    RETURN   sender -> receiver: value = slot, aux = that rkey. The sender will not write the slot until
             its next CREDIT. Sent at once if no transfer uses the slot; else when the transfer using it
             ends before its header. A transfer that reaches the receiver, or a granted GROW, voids the
             RECLAIM (the receiver's CREDIT that follows tells the sender).

The receiver deregisters a slot's memory only while the sender holds no grant for it (HELD, between
RETURN and CREDIT, between GROW and CREDIT): a legitimate sender never WRITEs to memory that is not
registered (on a NIC, a remote access error that would end the connection).

Sender (`SlotRing`, one per peer; anything not in TRANSITIONS is a LocalProtocolError):
    FREE --acquire (best fit)--> BUSY --GROW sent--> GROWING --CREDIT (room) or ERROR (refused)--> BUSY
    BUSY --CREDIT (its transfer arrived, or was refused, and the slot was released)--> FREE
    BUSY --its transfer ended before the header (give_back)--> FREE
    FREE --RECLAIM--> RETURNED --CREDIT--> FREE
  a RECLAIM for a BUSY or GROWING slot is remembered and answered when the slot is given back; a
  give_back while GROWING waits for the GROW's answer (the slot may be changing under it).
Receiver (`ReceivePool`):
    GRANTED or RECLAIMING --header arrived--> HELD --released, granted again--> GRANTED
    GRANTED or RECLAIMING --GROW granted--> GRANTED (larger)
    GRANTED --idle for idle_s, larger than initial--> RECLAIMING --RETURN--> GRANTED (initial size)
    GRANTED or RECLAIMING --header refused (protocol error)--> GRANTED (granted again, new rkey)
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Dict, List, Optional, Sequence

from ..errors import LocalProtocolError, RemoteProtocolError
from .frames import Ctrl, CtrlKind
from .policy import slot_room

#: no limit on a slot's capacity (a SlotRing made without the peer's maximum, in tests)
UNBOUNDED = 1 << 62


class SlotState(enum.Enum):
    """The sender's view of one of the peer's slots."""

    FREE = "free"  # granted to us, no transfer of ours uses it
    BUSY = "busy"  # a transfer of ours writes it, or wrote it and waits for its CREDIT
    GROWING = "growing"  # a transfer of ours asked for room (GROW) and waits for the answer
    RETURNED = "returned"  # handed back on the receiver's RECLAIM; ours again at its next CREDIT


class SlotEvent(enum.Enum):
    ACQUIRE = "acquire"
    GROW = "grow"  # GROW sent
    GRANT = "grant"  # CREDIT answering a GROW
    REFUSE = "refuse"  # ERROR answering a GROW
    CREDIT = "credit"  # CREDIT: the slot granted again
    GIVE_BACK = "give_back"  # our transfer ended before its header
    RECLAIM = "reclaim"  # RECLAIM for a free slot: RETURN sent


@dataclasses.dataclass
class _Grow:
    transfer_id: int
    wanted: int
    orphaned: bool = False  # its transfer ended while waiting: the slot is free once the answer comes


class SlotRing:
    """The sender's view of the peer's receive slots: a pointer that advances and wraps, grants
    (rkey, capacity) and credits. `capacities`, `rkeys`: the grants of the hello; `max_payload_bytes`:
    the most a slot grows to (what the peer offered)."""

    TRANSITIONS = {
        (SlotState.FREE, SlotEvent.ACQUIRE): SlotState.BUSY,
        (SlotState.BUSY, SlotEvent.GROW): SlotState.GROWING,
        (SlotState.GROWING, SlotEvent.GRANT): SlotState.BUSY,
        (SlotState.GROWING, SlotEvent.REFUSE): SlotState.BUSY,
        (SlotState.BUSY, SlotEvent.CREDIT): SlotState.FREE,
        (SlotState.BUSY, SlotEvent.GIVE_BACK): SlotState.FREE,
        (SlotState.FREE, SlotEvent.RECLAIM): SlotState.RETURNED,
        (SlotState.RETURNED, SlotEvent.CREDIT): SlotState.FREE,
    }

    def __init__(self, nslots: int, capacities: Optional[Sequence[int]] = None,
                 max_payload_bytes: Optional[int] = None, rkeys: Optional[Sequence[int]] = None) -> None:
        if nslots < 1:
            raise LocalProtocolError("the peer advertised no receive slots")
        self.nslots = nslots
        self.max_payload_bytes = max_payload_bytes if max_payload_bytes is not None else \
            max(capacities) if capacities else UNBOUNDED
        self.capacity: List[int] = list(capacities) if capacities is not None else [self.max_payload_bytes] * nslots
        self.rkey: List[int] = list(rkeys) if rkeys is not None else [0] * nslots
        if len(self.capacity) != nslots or len(self.rkey) != nslots:
            raise LocalProtocolError(f"{nslots} slots, {len(self.capacity)} capacities, {len(self.rkey)} rkeys")
        self.state = [SlotState.FREE] * nslots
        self._next = 0
        self._grow: Dict[int, _Grow] = {}
        self._asked: Dict[int, int] = {}  # RECLAIMs received while the slot was in use: slot -> rkey

    def _move(self, slot: int, event: SlotEvent) -> None:
        nxt = self.TRANSITIONS.get((self.state[slot], event))
        if nxt is None:
            raise LocalProtocolError(f"slot {slot}: {event.value!r} not allowed in state {self.state[slot].value}")
        self.state[slot] = nxt

    def _slot(self, slot: int, kind: str) -> int:
        if not 0 <= slot < self.nslots:
            raise RemoteProtocolError(f"{kind} for slot {slot}, the peer has {self.nslots} (field 'value')")
        return slot

    def acquire(self, total: Optional[int] = None, wait_for_room: bool = False) -> Optional[int]:
        """A free slot for a `total`-byte payload, or None: wait for a CREDIT. Best fit: the smallest
        free slot with room, else the largest free one (it grows least); ties, and `total` None, go in
        ring order from the slot after the last one taken. So a slot grown for the last round's model
        takes the next one while the other slots stay small. `wait_for_room`: when no free slot has
        room but a slot in use does, None (wait for that one's CREDIT) instead of growing another: its
        memory is faulted in already, a grown slot's is not (the caller bounds the wait)."""
        order = [(self._next + i) % self.nslots for i in range(self.nslots)]
        free = [s for s in order if self.state[s] is SlotState.FREE]
        if not free:
            return None
        fits = [s for s in free if total is None or self.capacity[s] >= total]
        if not fits and wait_for_room and total is not None and any(
                self.capacity[s] >= total for s in range(self.nslots) if self.state[s] is not SlotState.FREE):
            return None
        s = min(fits, key=lambda k: self.capacity[k]) if total is not None and fits else \
            free[0] if total is None else max(free, key=lambda k: self.capacity[k])
        self._move(s, SlotEvent.ACQUIRE)
        self._next = (s + 1) % self.nslots
        return s

    def grow(self, slot: int, transfer_id: int, wanted: int) -> Ctrl:
        """Our transfer in `slot` needs room for `wanted` payload bytes: the GROW to send."""
        if not self.capacity[slot] < wanted <= self.max_payload_bytes:
            raise LocalProtocolError(f"slot {slot}: no GROW to {wanted} bytes (capacity {self.capacity[slot]}, "
                                     f"maximum {self.max_payload_bytes})")
        self._move(slot, SlotEvent.GROW)
        self._grow[slot] = _Grow(transfer_id, wanted)
        return Ctrl(CtrlKind.GROW, transfer_id, slot, wanted)

    def on_credit(self, c: Ctrl) -> Optional[int]:
        """The peer granted a slot again (every field checked). Returns the transfer whose GROW this
        answered, which may now write; None for any other CREDIT."""
        slot, rkey, capacity = self._slot(c.value, "CREDIT"), c.aux, c.transfer_id
        if not 0 <= rkey < 1 << 32:
            raise RemoteProtocolError(f"CREDIT for slot {slot}: field 'aux' (rkey) = {rkey} is not a 32-bit key")
        if capacity > self.max_payload_bytes:
            raise RemoteProtocolError(f"CREDIT for slot {slot}: field 'transfer_id' (capacity) = {capacity} exceeds "
                                      f"the slot's maximum of {self.max_payload_bytes} bytes")
        if self.state[slot] is SlotState.FREE:
            raise RemoteProtocolError(f"credit for slot {slot}, which is not in use")
        self._asked.pop(slot, None)  # whatever it asked back is void: the slot's grant moved on
        g = self._grow.pop(slot, None)
        if g is not None and capacity < g.wanted:
            raise RemoteProtocolError(f"CREDIT for slot {slot}: field 'transfer_id' (capacity) = {capacity}, "
                                      f"less than the {g.wanted} bytes its GROW asked for")
        self._move(slot, SlotEvent.CREDIT if g is None else SlotEvent.GRANT)
        self.rkey[slot], self.capacity[slot] = rkey, capacity
        if g is None:
            return None
        if g.orphaned:
            self._move(slot, SlotEvent.GIVE_BACK)
            return None
        return g.transfer_id

    def credit(self, slot: int) -> None:
        """A CREDIT that keeps the slot's rkey and capacity."""
        self._slot(slot, "credit")
        self.on_credit(Ctrl(CtrlKind.CREDIT, self.capacity[slot], slot, self.rkey[slot]))

    def on_refused(self, transfer_id: int) -> Optional[Ctrl]:
        """An ERROR for `transfer_id`: if it waited for room, its GROW was refused and the old grant
        stands. Returns a RETURN to send, if any."""
        slot = next((s for s, g in self._grow.items() if g.transfer_id == transfer_id), None)
        if slot is None:
            return None
        g = self._grow.pop(slot)
        self._move(slot, SlotEvent.REFUSE)
        return self.give_back(slot) if g.orphaned else None

    def give_back(self, slot: int) -> Optional[Ctrl]:
        """Our transfer in `slot` ended before its header: the grant is ours again. Returns the RETURN
        to send if the peer asked for the slot meanwhile."""
        if self.state[slot] is SlotState.GROWING:
            self._grow[slot].orphaned = True  # the receiver may be changing the slot: wait for its answer
            return None
        self._move(slot, SlotEvent.GIVE_BACK)
        asked = self._asked.pop(slot, None)
        if asked is None:
            return None
        self._move(slot, SlotEvent.RECLAIM)
        return Ctrl(CtrlKind.RETURN, 0, slot, asked)

    def on_reclaim(self, c: Ctrl) -> Optional[Ctrl]:
        """The peer asks a slot back to shrink it: the RETURN to send now, or None (in use: later)."""
        slot, rkey = self._slot(c.value, "RECLAIM"), c.aux
        if rkey != self.rkey[slot]:
            raise RemoteProtocolError(f"RECLAIM for slot {slot}: field 'aux' (rkey) = {rkey}, the slot is granted "
                                      f"under {self.rkey[slot]}")
        st = self.state[slot]
        if st is SlotState.FREE:
            self._move(slot, SlotEvent.RECLAIM)
            return Ctrl(CtrlKind.RETURN, 0, slot, rkey)
        if st is SlotState.RETURNED:
            raise RemoteProtocolError(f"RECLAIM for slot {slot}, which was returned already")
        self._asked[slot] = rkey
        return None

    def growing(self, transfer_id: int) -> bool:
        return any(g.transfer_id == transfer_id for g in self._grow.values())


class GrantState(enum.Enum):
    """The receiver's view of one of its slots."""

    GRANTED = "granted"  # the peer may write it, under its rkey, up to its capacity
    RECLAIMING = "reclaiming"  # granted and asked back (RECLAIM sent): writable until the peer returns it
    HELD = "held"  # its transfer arrived and the consumer holds it: writable by no one


class GrantEvent(enum.Enum):
    ARRIVE = "arrive"  # a transfer's header arrived
    RELEASE = "release"  # the consumer released it (or the checksum failed): granted again
    REFUSE = "refuse"  # its header was refused before delivery: granted again
    GROW = "grow"  # a GROW granted
    RECLAIM = "reclaim"  # RECLAIM sent
    RETURN = "return"  # the peer's RETURN


class ReceivePool:
    """The receiver's slots: who may write each, how large each is, and when to shrink them. Slots
    start with room for `initial_payload_bytes`, grow to at most `max_payload_bytes`, and are asked
    back after `idle_s` without traffic (0 = never); the clock is the caller's."""

    TRANSITIONS = {
        (GrantState.GRANTED, GrantEvent.ARRIVE): GrantState.HELD,
        (GrantState.RECLAIMING, GrantEvent.ARRIVE): GrantState.HELD,
        (GrantState.HELD, GrantEvent.RELEASE): GrantState.GRANTED,
        (GrantState.GRANTED, GrantEvent.REFUSE): GrantState.GRANTED,
        (GrantState.RECLAIMING, GrantEvent.REFUSE): GrantState.GRANTED,
        (GrantState.GRANTED, GrantEvent.GROW): GrantState.GRANTED,
        (GrantState.RECLAIMING, GrantEvent.GROW): GrantState.GRANTED,
        (GrantState.GRANTED, GrantEvent.RECLAIM): GrantState.RECLAIMING,
        (GrantState.RECLAIMING, GrantEvent.RETURN): GrantState.GRANTED,
    }

    def __init__(self, nslots: int, max_payload_bytes: int, initial_payload_bytes: Optional[int] = None,
                 idle_s: float = 0.0, now: float = 0.0, rkeys: Optional[Sequence[int]] = None) -> None:
        if nslots < 1 or max_payload_bytes < 0 or idle_s < 0:
            raise LocalProtocolError(f"bad pool: {nslots} slots of {max_payload_bytes} bytes, idle {idle_s} s")
        self.nslots, self.max_payload_bytes, self.idle_s = nslots, max_payload_bytes, idle_s
        self.initial_payload_bytes = min(max_payload_bytes, max_payload_bytes if initial_payload_bytes is None
                                         else initial_payload_bytes)
        self.capacity = [self.initial_payload_bytes] * nslots
        self.rkey: List[int] = list(rkeys) if rkeys is not None else [0] * nslots
        self.state = [GrantState.GRANTED] * nslots
        self.last_active = now

    def _move(self, slot: int, event: GrantEvent) -> None:
        nxt = self.TRANSITIONS.get((self.state[slot], event))
        if nxt is None:
            raise LocalProtocolError(f"slot {slot}: {event.value!r} not allowed in state {self.state[slot].value}")
        self.state[slot] = nxt

    @property
    def held(self) -> List[int]:
        return [s for s in range(self.nslots) if self.state[s] is GrantState.HELD]

    def arrive(self, slot: int, now: float) -> None:
        """A transfer's header arrived in `slot` (its range checked by the caller)."""
        if self.state[slot] is GrantState.HELD:
            raise RemoteProtocolError(f"peer wrote slot {slot} while it was still held by the consumer")
        self._move(slot, GrantEvent.ARRIVE)
        self.last_active = now

    def release(self, slot: int, now: float) -> None:
        if not 0 <= slot < self.nslots or self.state[slot] is not GrantState.HELD:
            raise LocalProtocolError(f"slot {slot} released twice or never held")
        self._move(slot, GrantEvent.RELEASE)
        self.last_active = now

    def refuse(self, slot: int) -> None:
        """The header in `slot` was refused before delivery: the slot is granted again as it is."""
        self._move(slot, GrantEvent.REFUSE)

    def room_for(self, c: Ctrl) -> int:
        """Validate a GROW (every field; RemoteProtocolError names the bad one) and return the capacity to
        grant. Nothing changes until `grown`: the caller may still refuse (memory budget)."""
        slot, wanted = c.value, c.aux
        if not 0 <= slot < self.nslots:
            raise RemoteProtocolError(f"GROW for transfer {c.transfer_id}: field 'value' (slot) = {slot}, this side "
                                      f"has {self.nslots} slots")
        if self.state[slot] is GrantState.HELD:
            raise RemoteProtocolError(f"GROW for transfer {c.transfer_id}: slot {slot} is held by the consumer, "
                                      f"not granted")
        if wanted > self.max_payload_bytes:
            raise RemoteProtocolError(f"GROW for transfer {c.transfer_id}: field 'aux' (payload bytes) = {wanted} "
                                      f"exceeds the slot's maximum of {self.max_payload_bytes} bytes")
        if wanted <= self.capacity[slot]:
            raise RemoteProtocolError(f"GROW for transfer {c.transfer_id}: field 'aux' (payload bytes) = {wanted}, "
                                      f"slot {slot} has room for {self.capacity[slot]} already")
        return slot_room(wanted, self.max_payload_bytes)

    def grown(self, slot: int, rkey: int, capacity: int, now: float) -> Ctrl:
        """The GROW was granted: the slot is registered anew. Returns the CREDIT to send."""
        self._move(slot, GrantEvent.GROW)
        self.last_active = now
        return self.granted(slot, rkey, capacity)

    def idle(self, now: float) -> List[Ctrl]:
        """RECLAIMs to send: every grown slot still granted, once nothing arrived, grew or was released
        for idle_s."""
        if not self.idle_s or now - self.last_active < self.idle_s:
            return []
        out = []
        for s in range(self.nslots):
            if self.state[s] is GrantState.GRANTED and self.capacity[s] > self.initial_payload_bytes:
                self._move(s, GrantEvent.RECLAIM)
                out.append(Ctrl(CtrlKind.RECLAIM, 0, s, self.rkey[s]))
        return out

    def on_return(self, c: Ctrl) -> int:
        """The peer's RETURN (every field checked): the capacity to shrink the slot to."""
        slot, rkey = c.value, c.aux
        if not 0 <= slot < self.nslots:
            raise RemoteProtocolError(f"RETURN for slot {slot} (field 'value'), this side has {self.nslots}")
        if self.state[slot] is not GrantState.RECLAIMING or rkey != self.rkey[slot]:
            raise RemoteProtocolError(f"RETURN for slot {slot} under rkey {rkey} (field 'aux'), which this side did "
                                      f"not ask back (slot {self.state[slot].value}, rkey {self.rkey[slot]})")
        self._move(slot, GrantEvent.RETURN)
        return self.initial_payload_bytes

    def granted(self, slot: int, rkey: int, capacity: int) -> Ctrl:
        """Record the slot's new grant (after release, refusal, GROW or RETURN): the CREDIT to send."""
        if self.state[slot] is not GrantState.GRANTED:
            raise LocalProtocolError(f"slot {slot} granted in state {self.state[slot].value}")
        self.rkey[slot], self.capacity[slot] = rkey, capacity
        return Ctrl(CtrlKind.CREDIT, capacity, slot, rkey)
