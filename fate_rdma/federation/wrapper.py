"""Wraps the Federation object FATE built: large pickles go party to party over the channel, while a
small descriptor travels through FATE's own federation under the same name and tag. FATE's
ordering, blocking `get`, duplicate-name checks and errors therefore stay FATE's own.

Descriptor (through FATE): DESC_MAGIC + JSON {"id", "length", "crc32c", "src", "endpoint", "session", "frame"}.
"crc32c" is null when the channel's own end-to-end checksum already covers the bytes (checksum: xxh3,
crc32c, blake3 or blake2b: the default is one of them), so the payload is not checksummed twice; with
checksum: none the descriptor carries it.
FATE's own payloads begin with a mode byte 0x00 or 0x01, so the 0xFE magic cannot be mistaken.

With `descriptors: channel` the descriptor's fields ride in the transfer's own metadata instead, every
object (small ones too) goes over the channel, and a get waits for (session, name, tag, source party)
in the store: FATE's federation carries no bytes, and an object costs one transfer instead of a transfer
and a message through FATE. The source is the party the connection proved (secret or TLS), not only
the one the metadata names.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import crc32c
from easypyverbs.bootstrap import loads_object

from .. import hugepages, trace
from ..channel import Endpoint
from ..channel.buffers import RecvBuffers
from ..channel.checksum import block_digest
from ..channel.transfer import Fill
from ..errors import ConfigError, FateRdmaError, IntegrityError, PeerUnreachable
from ..protocol.integrity import BLOCK_BYTES, KEYED
from . import fate_path, frames
from .config import RdmaFederationConfig, party_key
from .receiving import Receiving
from .shared_puts import SharedCopies
from .store import Store

log = logging.getLogger("fate_rdma.federation")

DESC_MAGIC = b"\xfeFATE-RDMA-DESC\x01"
#: reported to FATE as the max message size, so pickles arrive here whole instead of sliced
UNSLICED = 1 << 62
#: a get that has waited this long for its object says so in the log, and again each time as long
WAIT_REMIND_S = 300.0


class RdmaFederation(Receiving):
    """Installed on a FATE Federation instance by `wrap()`; replaces its byte push/pull."""

    def __init__(self, fed: Any, computing: Any, cfg: RdmaFederationConfig) -> None:
        self.fed, self.computing, self.cfg = fed, computing, cfg
        self.local = tuple(fed.local_party)
        trace.set_party(party_key(self.local))  # (before its endpoint can see a transfer)
        me = cfg.address_of(self.local)
        host, _, port = me.rpartition(":")
        # only the job's parties may connect, each proving its own endpoint address (with a secret)
        self.announce = cfg.descriptors_in_use == "channel"
        # a peer that resolved descriptors otherwise cannot connect: its puts fail at once, naming both
        self.endpoint = Endpoint(cfg.channel, cfg.listen_host or host, int(port), name=me,
                                 allowed_peers=set(cfg.endpoints.values()) - {me},
                                 party_names={addr: party for party, addr in cfg.endpoints.items()},  # tls: true
                                 terms={"descriptors": cfg.descriptors_in_use})
        if self.announce and not cfg.proven_senders:
            self.endpoint.close()
            raise ConfigError("fate_rdma.descriptors: channel needs proven senders: set secret_file (or tls) at every "
                              "party (`fate-rdma launch` makes one for single-machine jobs), or descriptors: fate")
        self._party_at = {addr: party for party, addr in cfg.endpoints.items()}
        self._orig_push: Callable[..., Any] = fed._push_bytes
        self._orig_pull: Callable[..., Any] = fed._pull_bytes
        self._orig_destroy: Callable[..., Any] = fed._destroy
        self._orig_max = fed.get_default_max_message_size()
        self.threshold = min(cfg.threshold_bytes, self._orig_max)
        self._store = Store(keep_s=max(cfg.get_timeout_s, cfg.pull_timeout_s))
        self._warned_fallback: set = set()
        self._fallback_tables: List[Any] = []
        # rdma_*: payloads at or above threshold_bytes (or array frames); small_*: smaller objects that went over
        # the channel too (descriptors: channel), which FATE's path carries otherwise; together: what crossed it
        self.stats = {"rdma_bytes": 0, "rdma_transfers": 0, "small_transfers": 0, "small_bytes": 0,
                      "below_threshold": 0,  # objects under threshold_bytes that took FATE's path (descriptors: fate)
                      "fate_fallbacks": 0,
                      "rdma_seconds": 0.0,
                      # where a put/get spends its time (seconds, summed): see `fate-rdma bench fate`
                      "frame_seconds": 0.0, "send_seconds": 0.0, "descriptor_push_seconds": 0.0,
                      "descriptor_wait_seconds": 0.0, "payload_wait_seconds": 0.0, "unframe_seconds": 0.0,
                      "buffered_puts": 0, "shared_puts": 0, "put_copy_seconds": 0.0, "lent_bytes": 0}
        # recycled as reassembly buffers are; in shared memory where a same-host peer's NIC can map them
        self.put_copies = RecvBuffers(cfg.put_buffer_bytes, shared=self.endpoint.same_host_capable)
        self._inflight: set = set()
        self._inflight_bytes = 0
        self._inflight_lock = threading.Condition()  # notified when a buffered put's sends are all over
        self._shared = SharedCopies(self._give_room)  # copies a put of the same arrays again may share
        self._deferred: Optional[BaseException] = None
        self._stop = False
        huge_ok, huge_said = hugepages.check()
        log.log(logging.INFO if huge_ok else logging.WARNING, "fate-rdma: %s: %s", party_key(self.local), huge_said)
        self._rx = threading.Thread(target=self._receive, name="fate-rdma-federation-rx", daemon=True)
        self._rx.start()
        self.endpoint.on_message(self._take_inline)
        fed._push_bytes = self._push_bytes
        fed._pull_bytes = self._pull_bytes
        fed._destroy = self._destroy
        fed.get_default_max_message_size = lambda: UNSLICED
        fed.fate_rdma = self
        if self.announce:
            log.info("fate-rdma: federation of %s (%s) moves every object over %s at %s (descriptors: channel)",
                     party_key(self.local), type(fed).__name__, self.endpoint.label, me)
        else:
            why = {"fate": "as configured", "auto": "no secret_file or tls" if not cfg.proven_senders
                   else "fallback: fate"}[cfg.descriptors]
            log.info("fate-rdma: federation of %s (%s) moves payloads >= %d bytes over %s at %s; descriptors through "
                     "FATE's federation (%s)", party_key(self.local), type(fed).__name__, self.threshold,
                     self.endpoint.label, me, why)

    # -- push -----------------------------------------------------------------------------------
    def frame(self, value: Any) -> Optional[frames.OutFrame]:
        """`value` as an array frame if it carries at least `threshold` bytes of arrays, else None."""
        t0 = time.perf_counter()
        try:
            return frames.encode(value, self.threshold)
        finally:
            self.stats["frame_seconds"] += time.perf_counter() - t0

    def _push_bytes(self, v: Any, name: str, tag: str, parties: List[Tuple[str, str]]) -> None:
        self._raise_deferred()
        framed = isinstance(v, frames.OutFrame)
        if not framed and len(v) < self.threshold and not self.announce:
            self.stats["below_threshold"] += len(parties)
            return self._orig_push(v=v, name=name, tag=tag, parties=parties)
        t0 = time.perf_counter()
        trace.event("put", name=name, tag=tag, bytes=len(v))
        bufs = v.buffers if framed else [v]
        crc: Optional[int] = None
        if self.cfg.channel.checksum == "none":  # else the channel checks every byte end to end already
            crc = 0
            for b in bufs:
                crc = crc32c.crc32c(b, crc)
        held, fill = self._buffered(bufs, len(v), framed, parties)
        sends = self._send_all(v, bufs, held, fill, crc, framed, name, tag, parties)
        for p, key, fut in sends:
            err: Optional[BaseException] = fut if isinstance(fut, BaseException) else None
            if err is None and held is None:
                t1 = time.perf_counter()
                try:
                    fut.result(self.cfg.channel.transfer_timeout_s)
                except FateRdmaError as exc:
                    err = exc
                self.stats["send_seconds"] += time.perf_counter() - t1
            if err is None and self.announce:
                if framed or len(v) >= self.threshold:
                    self.stats["rdma_bytes"] += len(v)
                    self.stats["rdma_transfers"] += 1
                else:  # FATE's path would have carried it under descriptors: fate
                    self.stats["small_transfers"] += 1
                    self.stats["small_bytes"] += len(v)
            elif err is None:  # delivered, or (buffered) under way: the receiver's get waits for it
                desc = {"id": key, "length": len(v), "crc32c": crc, "src": party_key(self.local),
                        "endpoint": self.endpoint.name, "session": self.fed.session_id, "frame": framed}
                t1 = time.perf_counter()
                self._orig_push(v=DESC_MAGIC + json.dumps(desc).encode(), name=name, tag=tag, parties=[p])
                self.stats["descriptor_push_seconds"] += time.perf_counter() - t1
                self.stats["rdma_bytes"] += len(v)
                self.stats["rdma_transfers"] += 1
            elif self.cfg.fallback == "fate" and not isinstance(err, ConfigError):
                if p not in self._warned_fallback:
                    self._warned_fallback.add(p)
                    log.warning("fate-rdma: party %s unreachable (%s); sending through FATE's own federation",
                                party_key(p), err)
                self.stats["fate_fallbacks"] += 1
                raw = fate_path.serialize(self.fed, v.value, name, tag, [p]) if framed else v
                fate_path.push(self.fed, self.computing, self._orig_push, self._orig_max, self._fallback_tables,
                               raw, name, tag, [p])
            else:
                raise PeerUnreachable(f"fate-rdma: cannot send {name!r} to party {party_key(p)} at "
                                      f"{self.cfg.endpoints.get(party_key(p), '?')}: {err}") from err
        self.stats["rdma_seconds"] += time.perf_counter() - t0

    def _send_all(self, v: Any, bufs: List[Any], held: Optional[List[Any]], fill: Optional[Fill], crc: Optional[int],
                  framed: bool, name: str, tag: str,
                  parties: List[Tuple[str, str]]) -> List[Tuple[Tuple[str, ...], str, Any]]:
        """Queue the transfer of `v` to every party, each connected first (so that a buffered put's copy waits for
        no dial), then run a buffered put's copy (`fill`) while its first chunks go. (party, payload id, future
        or the error that kept it from starting) per party. Whatever raises on the way fails the copy's queued
        transfers at once (none waits for a copy that will not come) and gives the put's room back."""
        sends: List[Tuple[Tuple[str, ...], str, Any]] = []
        tracked = False
        try:
            addrs: Dict[Tuple[str, ...], Any] = {}
            failed: Dict[Tuple[str, ...], PeerUnreachable] = {}
            for p in parties:
                try:
                    addrs[tuple(p)] = self.cfg.address_of(tuple(p))
                    self.endpoint.connect(addrs[tuple(p)])
                except PeerUnreachable as exc:  # (its connection broke a moment ago: the send may wait for it)
                    failed[tuple(p)] = exc
                except ConfigError as exc:
                    addrs[tuple(p)] = exc
            for p in parties:
                key = uuid.uuid4().hex
                md = {"id": key, "session": self.fed.session_id, "name": name, "tag": tag,
                      "src": party_key(self.local), "dst": party_key(p)}
                if self.announce:  # the descriptor's fields travel with the bytes
                    md.update(announce=True, length=len(v), crc32c=crc, frame=framed)
                addr = addrs[tuple(p)]
                fut: Any
                try:
                    if tuple(p) in failed:
                        fut = self.endpoint.wait_for(addr, held or bufs, md, fill, failed[tuple(p)]) or failed[tuple(p)]
                    else:
                        fut = addr if isinstance(addr, BaseException) else self.endpoint.send(addr, held or bufs, md,
                                                                                              fill)
                except (PeerUnreachable, ConfigError) as exc:
                    fut = exc
                sends.append((tuple(p), key, fut))
                trace.event("put_sent", tid=getattr(fut, "transfer_id", None), dst=party_key(p), name=name, tag=tag)
            if held is not None:
                live = [f for _, _, f in sends if not isinstance(f, BaseException)]
                copy, fresh_copy = held[0], fill is not None and not fill.done  # (else shared, or bytes)
                if fresh_copy and live:
                    self._shared.hold(bufs, copy, fill)  # before any of its transfers can finish
                self._track(held, live, len(v), name, fill)
                tracked = True
                # the copy, while its first chunks go (each once its bytes are final)
                if fill is not None and fresh_copy and live:
                    t1 = time.perf_counter()
                    fill.run(copy, bufs, BLOCK_BYTES)
                    self.stats["put_copy_seconds"] += time.perf_counter() - t1
                    self._shared.ready(copy)
        except BaseException as exc:
            if fill is not None and fill.done and fill.error is None:  # a finished (shared) copy: cancel its sends
                for f in [f for _, _, f in sends if not isinstance(f, BaseException)]:
                    f.cancel()
            elif fill is not None:
                fill.fail(exc)  # (its transfers fail with it)
            if held is not None and not tracked:
                self._track(held, [f for _, _, f in sends if not isinstance(f, BaseException)], len(v), name, fill)
            raise
        return sends

    # -- buffered puts --------------------------------------------------------------------------
    def _buffered(self, bufs: List[Any], nbytes: int, framed: bool,
                  parties: List[Tuple[str, str]]) -> Tuple[Optional[List[Any]], Optional[Fill]]:
        """What a buffered put sends: `bufs` themselves when they cannot change (bytes), else one copy of
        them (a frame's arrays belong to the caller, who may change them once put returns, as FATE's own
        pickling allows), with the Fill that copies them in (run by the put once its sends are under way).
        None: not buffered (buffer_puts, or no room under put_buffer_bytes), this put waits for its bytes."""
        limit = self.cfg.put_buffer_bytes
        t0 = time.perf_counter()
        got = self._shared.share(bufs) if framed and limit else None  # the same arrays, unchanged, still held
        self.stats["put_copy_seconds"] += time.perf_counter() - t0
        if got is not None:
            self.stats["shared_puts"] += 1
            return [got[0]], got[1]
        copied = framed or not isinstance(bufs[0], bytes)  # (bytes cannot change: buffered as they are)
        if copied and not self.cfg.buffers_put(nbytes, self._rtt_s(parties)):
            return None, None
        with self._inflight_lock:
            if not limit or self._inflight_bytes + nbytes > limit:
                return None, None
            self._inflight_bytes += nbytes
        if not copied:
            return list(bufs), None
        try:
            copy = self.put_copies.get(nbytes)
        except BaseException:
            with self._inflight_lock:
                self._inflight_bytes -= nbytes
            raise
        self.stats["buffered_puts"] += 1
        # the copy's block digests: the channel's own where one copy serves every peer (xxh3, crc32c); under a MAC
        # (keyed per connection) XXH3 all the same, which later puts of the same arrays compare to share the copy
        # (shared_puts.py); the channel then takes its MAC as usual
        checksum = self.cfg.channel.checksum
        return [copy], Fill(nbytes, block_digest("xxh3" if checksum in KEYED else checksum))

    def _rtt_s(self, parties: List[Tuple[str, str]]) -> float:
        """The slowest round trip measured to any of `parties` (Endpoint.round_trip_s: nothing is dialed, a party
        without a measured connection counts 0); an unknown party is left to the send to report."""
        worst = 0.0
        for p in parties:
            try:
                worst = max(worst, self.endpoint.round_trip_s(self.cfg.address_of(tuple(p))))
            except ConfigError:
                pass
        return worst

    def _track(self, held: List[Any], futs: List[Any], nbytes: int, name: str, fill: Optional[Fill]) -> None:
        """Keep `held` until every send of one buffered put is over; then its room is free again. A send
        that failed is logged at once and raised by this party's next put or get (and reported at close),
        unless it failed because the put's own copy did (the put raised that)."""
        left = [len(futs)]  # (the copy itself is not captured here: a failed future keeps its callbacks)

        def done(fut: Any) -> None:
            exc = fut.exception() if not fut.cancelled() else FateRdmaError("cancelled")
            if exc is not None and not (fill is not None and fill.error is not None):
                err = PeerUnreachable(f"fate-rdma: a buffered put of {name!r} (transfer {fut.transfer_id}) failed "
                                      f"after it returned: {exc}")
                log.error("%s; this party's next put or get raises it, the receiver's get fails after its "
                          "pull_timeout_s", err)
                self._deferred = self._deferred or err
            with self._inflight_lock:
                self._inflight.discard(fut)
                left[0] -= 1
                if left[0] <= 0:
                    if self._shared.release(held[0] if held else None):  # (else by the copy's last user)
                        self._inflight_bytes -= nbytes
                    held.clear()  # the copy goes back to the recycled buffers once nothing else holds it
                self._inflight_lock.notify_all()

        with self._inflight_lock:
            self._inflight.update(futs)
            if not futs:
                if self._shared.release(held[0] if held else None):
                    self._inflight_bytes -= nbytes
                held.clear()
        for f in futs:
            f.add_done_callback(done)

    def _give_room(self, nbytes: int) -> None:
        with self._inflight_lock:  # (re-entrant: also called from under it, by _track)
            self._inflight_bytes -= nbytes
            self._inflight_lock.notify_all()

    def _raise_deferred(self) -> None:
        if self._deferred is not None:
            raise self._deferred

    def flush(self, timeout_s: Optional[float] = None) -> bool:
        """Wait until every buffered put has arrived (or failed) and its outcome is recorded (room given
        back, a failure ready to raise); False if some are still under way. Waits on the futures' own
        callbacks, not on the futures: a future wakes its waiters before it runs its callbacks."""
        timeout = self.cfg.channel.transfer_timeout_s if timeout_s is None else timeout_s
        with self._inflight_lock:
            return self._inflight_lock.wait_for(lambda: not self._inflight, timeout)

    # -- pull -----------------------------------------------------------------------------------
    def _pull_bytes(self, name: str, tag: str, parties: List[Tuple[str, str]]) -> List[bytes]:
        self._raise_deferred()
        trace.event("get", name=name, tag=tag, src=[party_key(p) for p in parties])
        if self.announce:
            return [self._take_announced(name, tag, tuple(p)) for p in parties]
        t0 = time.perf_counter()
        got = self._orig_pull(name=name, tag=tag, parties=parties)
        self.stats["descriptor_wait_seconds"] += time.perf_counter() - t0
        out = []
        for p, b in zip(parties, got):
            if isinstance(b, (bytes, bytearray)) and bytes(b[:len(DESC_MAGIC)]) == DESC_MAGIC:
                out.append(self._resolve(bytes(b[len(DESC_MAGIC):]), p, name))
            else:
                out.append(b)
        return out

    def _resolve(self, raw: bytes, party: Tuple[str, str], name: str) -> bytes:
        try:
            desc = loads_object(raw)  # (a peer's bytes: ValueError too when nested too deep or not an object)
            key, length, crc = desc["id"], int(desc["length"]), desc.get("crc32c")
            crc = None if crc is None else int(crc)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise IntegrityError(f"fate-rdma: malformed descriptor for {name!r} from {party_key(party)}: "
                                 f"{exc}") from exc
        t0 = time.perf_counter()
        data = self._store.take(key, self.cfg.pull_timeout_s)
        self.stats["payload_wait_seconds"] += time.perf_counter() - t0
        return frames.checked(data, length, crc, bool(desc.get("frame")), f"{name!r} from {party_key(party)}")

    def _take_announced(self, name: str, tag: str, party: Sequence[str]) -> Any:
        """descriptors: channel: the object `party` put under (name, tag), with its announced fields checked."""
        t0 = time.perf_counter()
        # the wait includes the sender's own work before its put (a round of local training), as FATE's
        # get does: get_timeout_s, not pull_timeout_s (a payload already under way)
        md, data = self._store.take(("obj", self.fed.session_id, name, tag, party_key(party)), self.cfg.get_timeout_s,
                                    f"fate-rdma: {name!r} (tag {tag!r}) from party {party_key(party)}",
                                    remind_s=WAIT_REMIND_S)
        self.stats["payload_wait_seconds"] += time.perf_counter() - t0
        try:
            length, crc = int(md["length"]), md.get("crc32c")
            crc = None if crc is None else int(crc)
        except (ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(f"fate-rdma: malformed announcement of {name!r} from {party_key(party)}: "
                                 f"{exc!r}") from exc
        return frames.checked(data, length, crc, bool(md.get("frame")), f"{name!r} from {party_key(party)}")

    # -- teardown -------------------------------------------------------------------------------
    def _destroy(self) -> None:
        try:
            self._orig_destroy()
        finally:
            self.close()

    def close(self) -> None:
        if not self._stop:
            if not self.flush():
                log.error("fate-rdma: %s closes with buffered puts still under way after %g s; their receivers' "
                          "gets will fail", party_key(self.local), self.cfg.channel.transfer_timeout_s)
            if self._deferred is not None:
                log.error("fate-rdma: %s: %s", party_key(self.local), self._deferred)
            if self._store.dropped:
                log.warning("fate-rdma: %s dropped %d object(s) no get took (see the warnings above)",
                            party_key(self.local), self._store.dropped)
            self._stop = True
            self._fallback_tables.clear()
            self.endpoint.on_message(None)
            self.endpoint.close()
            self._rx.join(timeout=2)
