"""Who may start a handshake now: a listener's bound on handshakes in progress, so that strangers cannot keep
the parties out.

Every accepted connection runs a handshake that holds a thread and a deadline until it proves something (a
bootstrap's auth exchange, a soft data connection's attach token). `Admission` bounds them:

- strangers (any source not `known`) share `strangers` slots, at most `per_source` of them from one address,
  so a flood from one host leaves the others room, and a flood from many hosts fills the strangers' slots
  only;
- known sources (the addresses of the job's own parties, of the peers a QP waits for) have `known_slots` slots
  of their own, which strangers never take, so a flood from any number of addresses does not hold up a
  party's connection (a flood from a party's own address competes with that party only).

A connection that is not admitted is closed at once by the listener (the dialer retries within its connect
timeout). Thread-safe.
"""
from __future__ import annotations

import ipaddress
import socket
import threading
from typing import Callable, Dict, Iterable, List, Optional, Set


def is_loopback(host: str) -> bool:
    """Is `host` (a name or address as written in a configuration) this machine's loopback? "localhost" or a
    loopback address (127.0.0.0/8, ::1, [::1]); any other name is not, whatever it starts with."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Admission:
    def __init__(self, strangers: int, per_source: int, known: Optional[Callable[[str], bool]] = None,
                 known_slots: int = 0) -> None:
        if strangers < 1 or per_source < 1 or known_slots < 0:
            raise ValueError("Admission needs strangers >= 1, per_source >= 1 and known_slots >= 0")
        self.strangers, self.per_source, self.known_slots = strangers, min(per_source, strangers), known_slots
        self._known = known or (lambda source: False)
        self._lock = threading.Lock()
        self._by_source: Dict[str, int] = {}
        self._strangers_in = 0
        self._known_in = 0
        #: connections closed unadmitted: (strangers' slots full, one source at its cap)
        self.refused_full = self.refused_crowded = 0

    def is_known(self, source: str) -> bool:
        try:
            return bool(self._known(source))
        except Exception:  # (a caller's lookup that fails counts the source as a stranger)
            return False

    def admit(self, source: str) -> Optional[Callable[[], None]]:
        """Whether a handshake from `source` may start now: None if not, else the call that says it has ended
        (either way; once)."""
        known = self.known_slots > 0 and self.is_known(source)
        with self._lock:
            held = self._by_source.get(source, 0)
            if known:
                if self._known_in >= self.known_slots:
                    self.refused_full += 1
                    return None
                self._known_in += 1
            else:
                if held >= self.per_source:
                    self.refused_crowded += 1
                    return None
                if self._strangers_in >= self.strangers:
                    self.refused_full += 1
                    return None
                self._strangers_in += 1
            self._by_source[source] = held + 1
        ended = threading.Event()

        def done() -> None:
            if ended.is_set():
                return
            ended.set()
            with self._lock:
                left = self._by_source.get(source, 0) - 1
                if left > 0:
                    self._by_source[source] = left
                else:
                    self._by_source.pop(source, None)
                if known:
                    self._known_in -= 1
                else:
                    self._strangers_in -= 1
        return done

    @property
    def pending(self) -> int:
        with self._lock:
            return self._strangers_in + self._known_in


class HostSet:
    """The IP addresses of `names` ("host:port", "[v6]:port" or a host), for a listener to ask about each
    connection's source: IP literals at once, host names resolved in a background thread, so that a slow
    resolver never holds up accept (until resolved, such a host counts as a stranger)."""

    def __init__(self, names: Optional[Iterable[str]]) -> None:
        self._ips: Set[str] = set()
        unresolved = []
        for name in names or ():
            host = name.rpartition(":")[0] if name.count(":") == 1 or name.startswith("[") else name
            host = host.strip("[]")
            try:
                self._ips.add(str(ipaddress.ip_address(host)))
            except ValueError:
                unresolved.append(host)
        if unresolved:
            threading.Thread(target=self._resolve, args=(unresolved,), name="admission-resolve", daemon=True).start()

    def _resolve(self, hosts: List[str]) -> None:
        for host in hosts:
            try:
                infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
            except OSError:
                continue
            self._ips.update(str(info[4][0]) for info in infos)

    def __contains__(self, source: object) -> bool:
        return source in self._ips
