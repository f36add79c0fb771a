"""Huge pages for the arrays FATE's party processes allocate with malloc (fate_rdma/hugepages.py): the
environment `fate-rdma launch` gives the parties, and that a party started with it gets huge pages."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fate_rdma import hugepages as H

CHILD = '''
import ctypes, json, multiprocessing as mp, os, sys

def huge_kib():
    return sum(int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages"))

def child(path):  # a party process as FATE's launcher starts one (spawned), allocating as Rust code does
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    n = 64 << 20
    before = huge_kib()
    buf = libc.malloc(n)
    ctypes.memset(buf, 1, n)
    malloc_kib = huge_kib() - before
    import numpy as np  # numpy asks for huge pages itself: shows whether the kernel had any to give
    arr = np.ones(n, dtype=np.uint8)
    json.dump({"tunables": os.environ.get("GLIBC_TUNABLES"), "malloc_kib": malloc_kib,
               "numpy_kib": huge_kib() - before - malloc_kib}, open(path, "w"))

if __name__ == "__main__":
    mp.set_start_method("spawn")
    p = mp.Process(target=child, args=(sys.argv[1],))
    p.start()
    p.join()
'''


def test_the_kernel_mode_is_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert H.thp_mode(str(f)) == "madvise"
    f.write_text("always madvise never\n")
    assert H.thp_mode(str(f)) is None
    assert H.thp_mode(str(tmp_path / "absent")) is None


def test_the_environment_asks_for_them_once_and_keeps_other_tunables(monkeypatch):
    monkeypatch.setattr(H, "possible", lambda: (True, "test"))
    env, said = H.with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "X": "1"})
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "X": "1"} and "asked" in said
    assert H.requested(env) and not H.requested({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) and not H.requested({})
    mine = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert H.with_huge_pages(mine)[0] == mine  # the user's own setting stays
    assert H.without_huge_pages(env) == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "X": "1"}
    assert H.without_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}) == {}
    spaced = {"GLIBC_TUNABLES": " glibc.malloc.hugetlb=1"}  # one reading of the variable everywhere
    assert H.requested(spaced) and H.with_huge_pages(spaced)[0] == spaced and H.without_huge_pages(spaced) == {}


def test_nothing_is_asked_for_where_the_kernel_has_no_huge_pages(monkeypatch):
    monkeypatch.setattr(H, "thp_mode", lambda: "never")
    env, said = H.with_huge_pages({})
    assert env == {} and "transparent huge pages are never" in said
    assert "not available" in H.describe() or H.requested()


def _launch(tmp_path, *extra):
    conf = tmp_path / "conf.json"
    conf.write_text(json.dumps({"fate_rdma": {"endpoints": {"guest:9999": "127.0.0.1:1"}}}))
    script, out = tmp_path / "job.py", tmp_path / f"out{len(extra)}.json"
    script.write_text(CHILD)
    env = H.without_huge_pages(os.environ)
    p = subprocess.run([sys.executable, "-m", "fate_rdma.cli", "launch", "--conf", str(conf), *extra, str(script),
                        str(out)], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.load(open(out))


def test_launch_starts_the_parties_with_huge_pages_for_malloc(tmp_path):
    from fate_rdma.federation.hook import pth_path

    if not os.path.exists(pth_path()):
        pytest.skip("the start-up hook is not installed (make test runs `fate-rdma hook install`)")
    ok, why = H.possible()
    if not ok:
        pytest.skip(f"malloc's huge pages cannot be had here: {why}")
    on, off = _launch(tmp_path), _launch(tmp_path, "--huge-pages", "off")
    assert H.SETTING in on["tunables"] and off["tunables"] is None
    if on["malloc_kib"] == 0 and on["numpy_kib"] == 0:
        pytest.skip("the kernel gave no process a huge page just now (memory fragmented): nothing to compare")
    assert on["malloc_kib"] > 0, on
    if H.thp_mode() == "madvise":  # (under "always" the kernel gives malloc's memory huge pages unasked)
        assert off["malloc_kib"] == 0, off


PROBE = '''
import ctypes, json, os, sys
if sys.argv[1] == "disable":  # PR_SET_THP_DISABLE: as a container or cgroup without THP would leave a process
    if ctypes.CDLL(None, use_errno=True).prctl(41, 1, 0, 0, 0) != 0:
        print(json.dumps("prctl refused")); sys.exit(0)
    os.execv(sys.executable, [sys.executable, sys.argv[0], "probe"])
import numpy as np
from fate_rdma import hugepages
got = [hugepages.measured() for _ in range(3)]
first = hugepages.check()
for n in (24 << 20, 18 << 20):  # freed mmapped chunks raise glibc's mmap threshold: the probe stays fresh
    a = np.ones(n, dtype=np.uint8)
    del a
a = np.ones(30 << 20, dtype=np.uint8)  # and a heap with 50 MiB free, touched: the probe cannot tell, says nothing
del a
b, c = np.ones(25 << 20, dtype=np.uint8), np.ones(25 << 20, dtype=np.uint8)
del b, c
print(json.dumps([got, *first, hugepages.check()[0]]))
'''


@pytest.mark.parametrize("thp", ["probe", "disable"])
def test_a_party_that_asks_for_huge_pages_and_gets_none_is_told(tmp_path, thp):
    """No silent off: with the tunable set, a process whose malloc still gets no huge pages (THP disabled for it)
    says so in its party log as a warning; one that gets them says how much of a fresh malloc it got."""
    if not H.possible()[0]:
        pytest.skip(H.possible()[1])
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = dict(os.environ, GLIBC_TUNABLES=H.SETTING, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, str(script), thp], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    if got == "prctl refused":
        pytest.skip("prctl(PR_SET_THP_DISABLE) refused here")
    shares, ok, said, ok_after_frees = got
    if thp == "disable":
        assert shares == [0.0] * 3 and not ok and "did not come as a huge page" in said and "4 KiB" in said, said
    else:  # every time; and after the process freed large arrays, no false warning
        assert shares == [1.0] * 3 and ok and ok_after_frees and "gets huge pages (measured)" in said, said
