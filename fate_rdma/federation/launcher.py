"""FATE's multiprocess launcher, watched: a party process that ends without reporting ends the job.

FATE's `MultiProcessLauncher.wait` blocks on its result queue with no timeout. A party reports there only
from inside its job's `try`; a party that dies before (its federation failed while FATE built its context,
say a fate-rdma endpoint whose port is taken) or that is killed (the OOM killer, a signal, a crash in native
code) never reports, so the launcher waits forever, and the other parties wait in their gets (up to
`get_timeout_s`, 24 h by default) for a party that is gone.

When fate-rdma is configured in the launcher's process (`fate-rdma launch`, FATE_RDMA_CONF), `wait` polls
the queue and the party processes: one that has exited without reporting (and whose last words, if any, did
not arrive within GRACE_S of its exit) fails the job, naming its rank, party and exit status, about
POLL_S + GRACE_S after the exit. FATE's own `block_run` then ends the other parties as it does for a party
that raised (it waits 10 s, then terminates those still running). Without a fate-rdma configuration
FATE's `wait` runs unchanged.
"""
from __future__ import annotations

import functools
import logging
import queue
import signal
import time
from typing import Any, Callable, Dict, Optional

log = logging.getLogger("fate_rdma.launcher")

#: how often the queue wait wakes up to look at the party processes: a dead party is seen within this
POLL_S = 0.5
#: a party that raised puts its report on the queue and then exits; its report may reach the launcher
#: after the exit is visible (a queue's feeder thread flushes at exit), so an exit is final only this long after
GRACE_S = 2.0


def _enabled() -> bool:
    """Is fate-rdma asked for in this process? A FATE_RDMA_CONF that cannot be read counts: every party
    fails on it while FATE builds its context, before it could report."""
    from .activate import current_section

    try:
        section = current_section()
    except Exception:
        return True
    return bool(section and section.get("enabled", True))


def exit_status(code: int) -> str:
    """`exit code 3`, or `killed by SIGKILL (signal 9)` for a process ended by a signal (a negative code)."""
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:  # a real-time signal has no name: its description ("Real-time signal 6")
        try:
            name = signal.strsignal(-code) or "an unknown signal"
        except ValueError:
            name = "an unknown signal"
    return f"killed by {name} (signal {-code})"


def _party_of(launcher: Any, rank: int) -> str:
    """`guest:9999 (rank 0)`, from the parties the launcher was made with (FATE's `launch` passes them), or
    `rank N` where it was made without them."""
    parties = getattr(launcher, "_fate_rdma_parties", None)
    if isinstance(parties, (list, tuple)) and 0 <= rank < len(parties):
        party = parties[rank]
        return f"{party if isinstance(party, str) else ':'.join(map(str, party))} (rank {rank})"
    return f"rank {rank}"


def watched_wait(launcher: Any, poll_s: float = POLL_S, grace_s: float = GRACE_S,
                 clock: Callable[[], float] = time.monotonic) -> int:
    """FATE's `wait` (0: every party reported success; 1: one reported an exception, whose traceback is
    kept for `show_exceptions`), plus: 1 as soon as a party has been gone for `grace_s` without reporting."""
    pending = set(range(launcher.world_size))
    gone_since: Dict[int, float] = {}
    while pending:
        try:
            rank, exc, tb = launcher.output_or_exception_q.get(timeout=poll_s)
        except queue.Empty:
            dead = _dead_without_report(launcher, pending, gone_since, grace_s, clock)
            if dead is not None:
                return dead
            continue
        pending.discard(rank)
        gone_since.pop(rank, None)
        if exc is not None:
            launcher._exception_tb[rank] = tb
            return 1
        log.info("rank %s finished its job; waiting for ranks %s", rank, sorted(pending))
    return 0


def _dead_without_report(launcher: Any, pending: set, gone_since: Dict[int, float], grace_s: float,
                         clock: Callable[[], float]) -> Optional[int]:
    now = clock()
    for rank in sorted(pending):
        code = launcher.processes[rank].exitcode
        if code is None:
            continue
        since = gone_since.setdefault(rank, now)
        if now - since < grace_s:
            continue
        who = _party_of(launcher, rank)
        why = (f"fate-rdma: party {who} ended ({exit_status(code)}) without reporting to FATE's launcher: it failed "
               "while FATE built its context and federation, left its job without raising an Exception (sys.exit, "
               "os._exit), or was killed" + (" (its log above says why)" if code > 0 else "") + ". The job stops now "
               "rather than leave the other parties waiting for it.")
        log.error(why)
        launcher._exception_tb[rank] = _plain(why)
        return 1
    return None


def _plain(text: str) -> Any:
    """`text` for FATE's `show_exceptions` panel as it is (rich, FATE's launcher's own dependency, would read
    `[...]` in it as markup)."""
    from rich.text import Text

    return Text(text)


def patch_launcher(launcher_cls: Any) -> None:
    """Make `launcher_cls.wait` watch its party processes when fate-rdma is configured, and its `__init__`
    keep the parties' names for the message (idempotent)."""
    orig_wait, orig_init = launcher_cls.wait, launcher_cls.__init__
    if getattr(orig_wait, "_fate_rdma", False):
        return

    @functools.wraps(orig_init)
    def __init__(self: Any, console: Any, parties: Any = None, *args: Any, **kwargs: Any) -> None:
        orig_init(self, console, parties, *args, **kwargs)
        self._fate_rdma_parties = parties

    @functools.wraps(orig_wait)
    def wait(self: Any) -> int:
        return watched_wait(self) if _enabled() else orig_wait(self)

    from .activate import mark

    mark(wait)
    launcher_cls.__init__, launcher_cls.wait = __init__, wait
