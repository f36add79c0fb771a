"""Huge pages for the arrays FATE's party processes allocate (glibc's malloc tunable).

The payloads fate-rdma moves are arrays FATE makes: its secure aggregation's mixed weights and averages
come from Rust code that allocates with malloc, so they sit in 4 KiB pages (numpy's own arrays of 4 MiB
and more get transparent huge pages already: numpy asks for them). Reading 4 KiB pages of another process
costs the kernel a page pin each: the soft provider's same-host path (process_vm_readv) moved them at
5.4 GB/s a thread here against 13.7 GB/s from huge pages, and a verbs NIC pins (registers) every page of
what it sends too. With `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` in a process's environment when it starts,
glibc's malloc asks for transparent huge pages on its memory as numpy does (glibc 2.35 and later; the
kernel's THP mode must be `madvise` or `always`). It is read once, at process start, so it must be in the
environment the party processes are started with: `fate-rdma launch` puts it there (`--huge-pages off`
leaves the environment alone); under fate-flow, export it where the fate-flow server starts (its task
processes inherit its environment). Nothing else changes: no memory is reserved, and where the kernel has
no huge page to give, malloc gets 4 KiB pages as before. `check()` measures what a process really gets (a
fresh malloc's page comes as a huge page), so a party that asked and gets none says so in a warning.
"""
from __future__ import annotations

import os
from typing import Dict, List, Mapping, Optional, Tuple

TUNABLE = "glibc.malloc.hugetlb"
SETTING = f"{TUNABLE}=1"
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_ENABLED) -> Optional[str]:
    """The kernel's transparent huge page mode (always, madvise, never), or None where it has none."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    chosen = [w[1:-1] for w in text.split() if w.startswith("[") and w.endswith("]")]
    return chosen[0] if chosen else None


def _glibc() -> Optional[Tuple[int, int]]:
    try:
        found = os.confstr("CS_GNU_LIBC_VERSION")
        if found is None:
            return None
        name, version = found.split()
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, ValueError, OSError):
        return None


def possible() -> Tuple[bool, str]:
    """Can malloc's huge pages be had here, and why not."""
    mode = thp_mode()
    if mode not in ("always", "madvise"):
        return False, f"the kernel's transparent huge pages are {mode or 'absent'}"
    libc = _glibc()
    if libc is None or libc < (2, 35):
        return False, f"glibc {'.'.join(map(str, libc)) if libc else 'not found'} has no {TUNABLE} (2.35 and later)"
    return True, f"transparent huge pages: {mode}; glibc {libc[0]}.{libc[1]}"


def _tunables(env: Mapping[str, str]) -> List[str]:
    return [p.strip() for p in env.get("GLIBC_TUNABLES", "").split(":") if p.strip()]


def _names_it(part: str) -> bool:
    return part.split("=", 1)[0] == TUNABLE


def requested(env: Mapping[str, str] = os.environ) -> bool:
    """Does `env` ask glibc's malloc for huge pages (a process started with it has them)?"""
    return any(_names_it(p) and p != f"{TUNABLE}=0" for p in _tunables(env))


def with_huge_pages(env: Mapping[str, str]) -> Tuple[Dict[str, str], str]:
    """`env` with malloc's huge pages asked for where they can be had, and what was done (for a log line).
    A GLIBC_TUNABLES that names the tunable already is left as it is (the user's choice)."""
    out = dict(env)
    if any(_names_it(p) for p in _tunables(env)):
        return out, f"GLIBC_TUNABLES already sets {TUNABLE}: left as it is"
    ok, why = possible()
    if not ok:
        return out, f"not asked for: {why}"
    out["GLIBC_TUNABLES"] = ":".join(_tunables(env) + [SETTING])
    return out, f"asked for ({SETTING}; {why})"


def without_huge_pages(env: Mapping[str, str]) -> Dict[str, str]:
    """`env` with the tunable taken out of GLIBC_TUNABLES (benchmarks' `--huge-pages off`)."""
    out = dict(env)
    rest = [p for p in _tunables(env) if not _names_it(p)]
    if rest:
        out["GLIBC_TUNABLES"] = ":".join(rest)
    else:
        out.pop("GLIBC_TUNABLES", None)
    return out


#: the probe's malloc: above glibc's largest dynamic mmap threshold (32 MiB on 64-bit), so freeing it moves no
#: threshold and it is a fresh mapping unless the heap already has that much free (then its pages may be in
#: memory already, and the probe cannot tell: mincore); only one 2 MiB page of it is touched
PROBE_BYTES = 40 << 20
HUGE_PAGE = 2 << 20


def _huge_kib_over(lo: int, hi: int) -> int:
    """Huge-page kB (transparent or hugetlbfs) of the mappings of this process that overlap [lo, hi)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                a, _, b = head.partition("-")
                inside = int(a, 16) < hi and int(b, 16) > lo
            elif inside and head in ("AnonHugePages:", "Private_Hugetlb:", "Shared_Hugetlb:"):
                total += int(line.split()[1])
    return total


def measured() -> Optional[float]:
    """Does malloc's memory come in huge pages in this process: 1.0 if one 2 MiB-aligned page of a fresh
    PROBE_BYTES malloc, once touched, is a huge page, 0.0 if not (the huge-page kB of the mappings around it
    before and after the touch, /proc/self/smaps), None where that cannot be told (the page was in memory
    already, or /proc cannot be read). With the tunable (and THP for this process) 1.0, without it 0.0 under
    THP `madvise`; 0.0 also where the kernel had no free huge page at that moment."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    buf = libc.malloc(PROBE_BYTES)
    if not buf:
        return None
    try:
        page = -(-buf // HUGE_PAGE) * HUGE_PAGE  # the first whole huge page inside the allocation
        vec = (ctypes.c_ubyte * (HUGE_PAGE // 4096))()
        if libc.mincore(ctypes.c_void_p(page), ctypes.c_size_t(HUGE_PAGE), vec) != 0 or any(b & 1 for b in vec):
            return None  # (heap memory touched before, or mincore refused: nothing to learn from a touch)
        before = _huge_kib_over(page, page + HUGE_PAGE)
        ctypes.memset(page, 1, 1)
        got = _huge_kib_over(page, page + HUGE_PAGE) - before
    except (OSError, ValueError):
        return None
    finally:
        libc.free(buf)
    return 1.0 if got * 1024 >= HUGE_PAGE else 0.0


def _share(got: Optional[float]) -> str:
    return "" if got is None else f"; a fresh malloc here {'gets' if got else 'does not get'} huge pages (measured)"


def check() -> Tuple[bool, str]:
    """For a party's log: (whether all is as asked, one line). Not as asked: the tunable is set but two fresh
    mallocs' pages did not come as huge pages (THP off for this process's cgroup, say), so FATE's arrays stay in
    4 KiB pages."""
    if not requested():
        return True, describe()
    got = measured()
    if got == 0.0:
        got = measured()  # (once more: the kernel may have had no free huge page at that moment)
    if got == 0.0:
        return False, (f"malloc huge pages were asked for (GLIBC_TUNABLES) but a fresh malloc's page did not come "
                       f"as a huge page, twice (measured; {possible()[1]}): FATE's arrays likely stay in 4 KiB "
                       f"pages, which the soft provider's same-host path read 1.2-2.5 x slower in scratch runs")
    return True, describe(got)


def describe(got: Optional[float] = None) -> str:
    """One line: whether this process has them (`got`: what `measured` said, where it was asked), and how FATE's
    processes get them. `check` measures and says this, or the warning."""
    ok, why = possible()
    if requested():
        return f"malloc huge pages: asked for in this process (GLIBC_TUNABLES; {why}){_share(got)}"
    if not ok:
        return f"malloc huge pages: not available ({why})"
    return (f"malloc huge pages: available ({why}), not asked for in this process; `fate-rdma launch` asks for "
            f"them in FATE's party processes; under fate-flow export GLIBC_TUNABLES={SETTING} where its server starts")
