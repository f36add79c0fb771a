"""WAN testbed: two or three sites as network namespaces behind a router namespace, links shaped on real packets.

    P-a [wan0 198.18.1.2/24] ==veth== [s-a 198.18.1.1/24] \
    P-b [wan0 198.18.2.2/24] ==veth== [s-b 198.18.2.1/24]  P-r (router: ip_forward, tun wdl0, nft)
    P-c [wan0 198.18.3.2/24] ==veth== [s-c 198.18.3.1/24] /

P is the prefix (default "frwan"). Addresses come from 198.18.0.0/15 (RFC 2544 benchmarking), never
routed elsewhere; nothing is created in the host namespace, so the testbed cannot reach the outside.
Site x's link (a `LinkSpec`) is shaped as an access link; everything is a kernel object or a process
inside the namespaces:

- rate: tbf on wan0 in P-x (upload) and on s-x in P-r (download); a path A->B runs at min(rate_a, rate_b);
- loss: nftables table `inet fate_rdma_wan` in P-r, `iifname "wdl0" ip saddr <site x> numgen random mod
  1000000 < ppm drop`, on packets leaving site x, matched after the TUN so that each drop is one MTU
  frame (a TSO packet crosses a veth whole, 64 KB, and is segmented on its way into the TUN);
- delay, reordering: netem is not in this kernel (DESIGN.md). P-r routes every packet arriving from a
  site into the TUN wdl0 (`ip rule iif s-x lookup 100`, table 100: `default dev wdl0`); a C helper
  (deploy/wan/delay_helper.c, compiled with the system cc at `up`) holds it for delay_ms of the link it
  came from (reorder_gap_ms longer with probability reorder_pct, so later packets overtake it) and
  writes it back; arriving on wdl0 it is forwarded by the main table. One-way A->B = delay_a,
  RTT(A,B) = delay_a + delay_b.

Why on the host and not in the Soft-RoCE VM (which has sch_netem): the evaluation must run FATE,
gRPC, Mooncake and fate-rdma as the same host processes on the same link; the VM shares the host's
2 cores with its own emulation and with other VMs, boots per command, and its rxe would cross the
link only inside one guest. A C TUN forwarder costs one read and one write per packet: one TCP
stream reached ~620 Mbit/s through it at 20 ms RTT on this 2-core host while other jobs ran (Python
helpers top out near 250 Mbit/s); use 50-200 Mbit/s where the shaped rate must hold.

State (spec, helper pid, last measurement) lives in `state_dir()/P.json`; `down` works without it.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

from fate_rdma_lab.testbed.delay_helper import (HELPERS, build_helper, helper_pids, helper_source,  # noqa: F401
                                                pid_is_helper, stop_pid)
from fate_rdma_lab.testbed.spec import (PAPER_NOTE, SITE_NAMES, LinkSpec, Testbed, WanError, WanUnavailable,  # noqa: F401
                                        check_prefix, fmt_rate, testbed_note)


TUN = "wdl0"
ROUTE_TABLE = 100
RULE_PREF = 1000             # ip rule priorities RULE_PREF + site index
NFT_TABLE = "fate_rdma_wan"
SITE_DEV = "wan0"
MTU = 1500                   # helper slots are 2048 bytes; every link keeps Ethernet's MTU
CMD_TIMEOUT_S = 20.0         # any single ip/tc/nft command; they take milliseconds when healthy
HELPER_START_TIMEOUT_S = 5.0


# -- running commands -------------------------------------------------------------------------------
def sh(argv: List[str], check: bool = True, timeout_s: float = CMD_TIMEOUT_S, stdin: Optional[str] = None) -> str:
    try:
        p = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise WanError(f"`{' '.join(argv)}` did not finish within {timeout_s:.0f} s") from exc
    except OSError as exc:
        raise WanError(f"`{argv[0]}` could not run: {exc}") from exc
    if check and p.returncode != 0:
        raise WanError(f"`{' '.join(argv)}` failed ({p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


def in_ns(ns: str, argv: List[str]) -> List[str]:
    return ["ip", "netns", "exec", ns, *argv]


def call_in_ns(ns: Optional[str], fn: Callable[..., Any], *args: Any, timeout_s: float = 300.0, **kw: Any) -> Any:
    """`fn(*args, **kw)` run with its sockets in namespace `ns` (None: here): on a thread of its own that enters the
    namespace first (setns applies to the calling thread), so this process can talk to a site's loopback-only
    services (a site's FATE-Flow HTTP) without a shell in between. Its exception is raised here."""
    if ns is None:
        return fn(*args, **kw)
    import ctypes
    import threading

    out: Dict[str, Any] = {}

    def run() -> None:
        try:
            fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(fd, 0x40000000) != 0:  # (CLONE_NEWNET)
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
            finally:
                os.close(fd)
            out["value"] = fn(*args, **kw)
        except BaseException as exc:  # (handed to the caller)
            out["error"] = exc

    t = threading.Thread(target=run, name=f"in-{ns}", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise WanError(f"{getattr(fn, '__name__', fn)} in {ns} did not return within {timeout_s:g} s")
    if "error" in out:
        raise out["error"]
    return out.get("value")


@contextlib.contextmanager
def open_sites(sites: int, prefix: str, state: str) -> Iterator[Testbed]:
    """`sites` namespaces behind the router, unshaped (no helper: namespaces, veths and routes only), for the
    block; their state file under `state` (FATE_RDMA_WAN_STATE meanwhile); everything of `prefix` removed after."""
    old = os.environ.get("FATE_RDMA_WAN_STATE")
    os.environ["FATE_RDMA_WAN_STATE"] = state
    tb = Testbed(links=(LinkSpec(rate_bps=None, delay_ms=0.0),) * sites, prefix=prefix)
    try:
        up(tb)
        yield tb
    finally:
        down(tb.prefix)
        if old is None:
            os.environ.pop("FATE_RDMA_WAN_STATE", None)
        else:
            os.environ["FATE_RDMA_WAN_STATE"] = old


def host_problem() -> Optional[str]:
    """Why this host cannot build a testbed at all, or None (cheap: creates nothing)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return f"`{tool}` not found (Debian: apt-get install iproute2)"
    return None


def namespace_problem() -> Optional[str]:
    """Why this host cannot create a network namespace (host_problem first), or None: one is made and removed."""
    problem = host_problem()
    if problem:
        return problem
    probe = f"frprobe{os.getpid() % 10_000_000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=CMD_TIMEOUT_S)
    return None


def spec_problem(tb: Testbed) -> Optional[str]:
    """What this testbed's shaping needs that the host lacks (nft for loss, cc and /dev/net/tun for delay)."""
    if any(l.loss_pct > 0 for l in tb.links) and not shutil.which("nft"):
        return "loss needs nftables: apt-get install nftables (or run deploy/wan/install-deps.sh)"
    if any(l.needs_helper for l in tb.links):
        if not os.path.exists("/dev/net/tun"):
            return "delay and reordering need /dev/net/tun (CONFIG_TUN)"
        if not (shutil.which("cc") or shutil.which("gcc")):
            return "delay and reordering need a C compiler for the helper: apt-get install gcc"
    return None


def state_dir() -> Path:
    d = os.environ.get("FATE_RDMA_WAN_STATE")
    if d:
        return Path(d)
    # /run is a tmpfs: like the namespaces themselves, the state does not survive a reboot
    return Path("/run/fate-rdma-wan") if os.geteuid() == 0 else Path(os.environ.get("XDG_RUNTIME_DIR", "/tmp")) / "fate-rdma-wan"


def _state_path(prefix: str) -> Path:
    return state_dir() / f"{prefix}.json"


def load_state(prefix: str) -> Optional[Dict[str, Any]]:
    try:
        return json.loads(_state_path(prefix).read_text())
    except (OSError, ValueError):
        return None


def _save_state(prefix: str, state: Dict[str, Any]) -> None:
    path = _state_path(prefix)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(path)


# -- the delay helper -------------------------------------------------------------------------------
def _start_helper(tb: Testbed, binary: Path) -> int:
    sd = state_dir()
    stats = sd / f"{tb.prefix}-delay.json"
    stats.unlink(missing_ok=True)
    argv = [str(binary), "--tun", TUN, "--limit", str(tb.helper_limit_pkts), "--stats", str(stats)]
    for i, l in enumerate(tb.links):
        argv += ["--rule", f"198.18.{i + 1}.0/24,{int(l.delay_ms * 1000)},{int(l.reorder_pct * 10_000)},"
                           f"{int(l.reorder_gap_ms * 1000)}"]
    with open(sd / f"{tb.prefix}-delay.log", "ab") as log:
        proc = subprocess.Popen(in_ns(tb.router, argv), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True)  # not in our process group: Ctrl-C of `up` leaves it
    deadline = time.monotonic() + HELPER_START_TIMEOUT_S
    while not stats.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            tail = (sd / f"{tb.prefix}-delay.log").read_text(errors="replace")[-500:]
            raise WanError(f"the delay helper did not start: {tail.strip() or 'no output'}")
        time.sleep(0.02)
    HELPERS[proc.pid] = proc
    return proc.pid


# -- up / down / status -----------------------------------------------------------------------------
def existing_namespaces(prefix: str) -> List[str]:
    out = sh(["ip", "netns", "list"], check=False)
    names = {line.split()[0] for line in out.splitlines() if line.strip()}
    # router first, then the sites in order
    return [n for n in (f"{prefix}-{x}" for x in "r" + SITE_NAMES) if n in names]


def _tbf(ns: str, dev: str, link: LinkSpec, queue_ms: float) -> None:
    if link.rate_bps is None:
        sh(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
        return
    rate_Bps = link.rate_bps / 8
    burst = max(16 * 1024, int(rate_Bps / 1000))          # >= 1 ms of the rate, and > a few MTUs
    limit = burst + max(64 * 1024, int(rate_Bps * queue_ms / 1000))
    sh(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{link.rate_bps}bit",
        "burst", str(burst), "limit", str(limit)])


def _nft_script(tb: Testbed) -> Optional[str]:
    # on packets leaving the TUN: a sender's 64 KB TSO packet crosses the veth whole, and is cut into
    # MTU frames only on its way into the TUN; matched at the veth, one loss would drop ~44 segments
    rules = [f'    iifname "{TUN}" ip saddr 198.18.{i + 1}.0/24 numgen random mod 1000000 < '
             f'{int(round(l.loss_pct * 10_000))} counter drop' for i, l in enumerate(tb.links) if l.loss_pct > 0]
    if not rules:
        return None
    return "\n".join([f"table inet {NFT_TABLE} {{", "  chain forward {",
                      "    type filter hook forward priority filter; policy accept;", *rules, "  }", "}", ""])


def _set_tcp_cc(ns: str, cc: Optional[str]) -> None:
    """The site's TCP congestion control: `cc`, or the host's default (None). A namespace may pick only
    among the host's allowed ones (net.ipv4.tcp_allowed_congestion_control)."""
    cc = cc or Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split()
    if cc not in allowed:
        available = Path("/proc/sys/net/ipv4/tcp_available_congestion_control").read_text().split()
        how = (f"allow it on the host: sysctl -w net.ipv4.tcp_allowed_congestion_control=\"{' '.join(allowed + [cc])}\""
               if cc in available else f"load its module (modprobe tcp_{cc}) and add it there")
        raise WanError(f"TCP congestion control {cc!r} is not allowed here (net.ipv4.tcp_allowed_congestion_control: "
                       f"{' '.join(allowed)}; {how})")
    sh(in_ns(ns, ["sysctl", "-q", "-w", f"net.ipv4.tcp_congestion_control={cc}"]))


def _ensure_topology(tb: Testbed, log: Callable[[str], None]) -> None:
    have = set(existing_namespaces(tb.prefix))
    wanted = {tb.router} | {tb.site_ns(i) for i in range(len(tb.links))}
    for ns in sorted(have - wanted):  # fewer sites than last time
        _remove_namespace(ns)
    r = tb.router
    if r not in have:
        sh(["ip", "netns", "add", r])
        sh(["ip", "-n", r, "link", "set", "lo", "up"])
        log(f"created namespace {r} (router)")
    sh(in_ns(r, ["sysctl", "-q", "-w", "net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0",
                 "net.ipv4.conf.default.rp_filter=0"]))
    links = sh(["ip", "-n", r, "-o", "link", "show"])
    for i in range(len(tb.links)):
        ns, x = tb.site_ns(i), SITE_NAMES[i]
        if ns not in have:
            sh(["ip", "netns", "add", ns])
            sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            log(f"created namespace {ns} (site {x}, {tb.site_addr(i)})")
        if f" s-{x}@" not in links:
            # made inside the namespaces: no interface ever appears in the host namespace
            sh(["ip", "-n", r, "link", "add", f"s-{x}", "mtu", str(MTU), "type", "veth", "peer", "name", SITE_DEV,
                "netns", ns, "mtu", str(MTU)])
        sh(["ip", "-n", r, "addr", "replace", f"198.18.{i + 1}.1/24", "dev", f"s-{x}"])
        sh(["ip", "-n", ns, "addr", "replace", f"{tb.site_addr(i)}/24", "dev", SITE_DEV])
        _set_tcp_cc(ns, tb.tcp_cc)
        sh(["ip", "-n", r, "link", "set", f"s-{x}", "up"])
        sh(["ip", "-n", ns, "link", "set", SITE_DEV, "up"])
        sh(["ip", "-n", ns, "route", "replace", "198.18.0.0/15", "via", f"198.18.{i + 1}.1"])


def _apply_shaping(tb: Testbed, log: Callable[[str], None]) -> Optional[int]:
    r = tb.router
    for old in helper_pids(tb.prefix):  # the tun takes one reader: the last shape's helper goes first
        stop_pid(old)
    for i, link in enumerate(tb.links):
        _tbf(tb.site_ns(i), SITE_DEV, link, tb.queue_ms)
        _tbf(r, f"s-{SITE_NAMES[i]}", link, tb.queue_ms)
    script = _nft_script(tb)
    if shutil.which("nft"):  # the last shape's loss rules go, whatever the new one wants
        sh(in_ns(r, ["nft", "delete", "table", "inet", NFT_TABLE]), check=False)
    if script:
        sh(in_ns(r, ["nft", "-f", "-"]), stdin=script)
    for pref in range(RULE_PREF, RULE_PREF + len(SITE_NAMES)):
        sh(["ip", "-n", r, "rule", "del", "pref", str(pref)], check=False)
    if not any(l.needs_helper for l in tb.links):
        sh(["ip", "-n", r, "link", "del", TUN], check=False)
        return None
    binary = build_helper()
    if f" {TUN}:" not in sh(["ip", "-n", r, "-o", "link", "show"]):
        sh(["ip", "-n", r, "tuntap", "add", "dev", TUN, "mode", "tun"])
    sh(["ip", "-n", r, "link", "set", TUN, "mtu", str(MTU), "txqueuelen", "10000", "up"])
    sh(in_ns(r, ["sysctl", "-q", "-w", f"net.ipv4.conf.{TUN}.rp_filter=0"]))
    sh(["ip", "-n", r, "route", "replace", "default", "dev", TUN, "table", str(ROUTE_TABLE)])
    pid = _start_helper(tb, binary)
    for i in range(len(tb.links)):
        sh(["ip", "-n", r, "rule", "add", "iif", f"s-{SITE_NAMES[i]}", "lookup", str(ROUTE_TABLE),
            "pref", str(RULE_PREF + i)])
    log(f"delay helper pid {pid} in {r} (tun {TUN})")
    return pid


def up(tb: Testbed, measure_seconds: float = 2.0, log: Callable[[str], None] = lambda s: None,
       measure: Optional[Callable[..., Dict[str, Any]]] = None) -> Dict[str, Any]:
    """Build the testbed or reshape the existing one (safe to run twice); measure site a -> b with
    `measure(tb, seconds=...)` (testbed.run.measure) when it is given and measure_seconds >= 0.

    Any failure removes everything of this prefix before the error propagates."""
    problem = host_problem() or spec_problem(tb)
    if problem:
        raise WanUnavailable(problem)
    state_dir().mkdir(parents=True, exist_ok=True)
    try:
        _ensure_topology(tb, log)
        pid = _apply_shaping(tb, log)
        state: Dict[str, Any] = {"spec": tb.to_dict(), "helper_pid": pid, "up_at": time.time()}
        _save_state(tb.prefix, state)
        if measure is not None and measure_seconds >= 0:
            state["measured"] = measure(tb, seconds=measure_seconds)
            _save_state(tb.prefix, state)
        return state
    except BaseException as exc:
        try:
            down(tb.prefix)
        except Exception as cleanup:  # keep the first cause; say that cleanup failed too
            raise WanError(f"{exc!r}; then removing the testbed failed: {cleanup} (run `fate-rdma wan down "
                           f"--prefix {tb.prefix}`)") from exc
        raise


def _remove_namespace(ns: str) -> None:
    # a namespace with a process still inside outlives `ip netns del`: stop them first
    pids = [int(p) for p in sh(["ip", "netns", "pids", ns], check=False).split()]
    for pid in pids:
        stop_pid(pid)
    sh(["ip", "netns", "del", ns], check=False)


def down(prefix: str) -> List[str]:
    """Remove everything of this prefix; returns what was removed. Works without the state file."""
    done: List[str] = []
    for pid in helper_pids(prefix):
        stop_pid(pid)
        done.append(f"stopped delay helper pid {pid}")
    for ns in existing_namespaces(prefix):
        # veths, tun, qdiscs, nft tables and routes all live inside and go with the namespace
        _remove_namespace(ns)
        done.append(f"removed namespace {ns}")
    for name in (f"{prefix}.json", f"{prefix}-delay.json", f"{prefix}-delay.log", f"{prefix}.tmp"):
        try:
            (state_dir() / name).unlink()
        except FileNotFoundError:
            pass
    return done


def leftovers(prefix: str) -> List[str]:
    """Anything of this prefix still on the host: namespaces, helper processes, state files."""
    left = [f"namespace {ns}" for ns in existing_namespaces(prefix)]
    left += [f"delay helper process {pid}" for pid in helper_pids(prefix)]
    left += [f"state file {f}" for f in state_dir().glob(f"{prefix}[.-]*")] if state_dir().is_dir() else []
    return left


def status(prefix: str) -> Dict[str, Any]:
    """What exists of this prefix: namespaces, addresses, qdiscs, nft table, helper, processes inside."""
    state = load_state(prefix)
    out: Dict[str, Any] = {"prefix": prefix, "state": state, "namespaces": {}}
    for ns in existing_namespaces(prefix):
        info: Dict[str, Any] = {
            "addresses": sh(["ip", "-n", ns, "-o", "-4", "addr", "show"], check=False).splitlines(),
            "qdiscs": [q for q in sh(["tc", "-n", ns, "qdisc", "show"], check=False).splitlines() if " tbf " in q],
            "pids": sh(["ip", "netns", "pids", ns], check=False).split(),
        }
        info["addresses"] = [" ".join(a.split()[1:4]) for a in info["addresses"] if a.strip() and " lo " not in a]
        if ns.endswith("-r") and shutil.which("nft"):
            info["nft"] = sh(in_ns(ns, ["nft", "list", "table", "inet", NFT_TABLE]), check=False).strip()
        out["namespaces"][ns] = info
    pid = (state or {}).get("helper_pid")
    if pid:
        out["helper"] = {"pid": pid, "alive": pid_is_helper(int(pid), prefix)}
        try:
            out["helper"]["stats"] = json.loads((state_dir() / f"{prefix}-delay.json").read_text())
        except (OSError, ValueError):
            pass
    return out
