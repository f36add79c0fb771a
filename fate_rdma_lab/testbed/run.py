"""Running processes in the WAN testbed's sites: measurement (RTT, TCP stream) and verified transfers.

Every process is `ip netns exec <site> python -m fate_rdma_lab.testbed.probe ...` (this interpreter, this
checkout), read one JSON line at a time under a deadline, and stopped by closing its stdin, then by
signal. Results carry `testbed_note`, the line that says the rate is scaled.
"""
from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any, Dict, List, Optional, cast

from fate_rdma_lab.testbed.bed import SITE_NAMES, Testbed, WanError, fmt_rate, in_ns, state_dir, testbed_note


class SiteProcess:
    """A wan_probe command (or another module's, `module`) running inside a site namespace."""

    def __init__(self, tb: Testbed, site: int, args: List[str], module: str = "fate_rdma_lab.testbed.probe") -> None:
        self.what = f"{module.rsplit('.', 1)[-1]} {args[0]} in {tb.site_ns(site)}"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # the checkout on the path, so a source tree without `pip install -e` works too
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        # stderr to a file, not a pipe: a chatty process must never block on a pipe nobody reads
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(in_ns(tb.site_ns(site), [sys.executable, "-m", module, *args]),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, env=env)
        # its pipes (PIPE: Popen sets both), typed as such
        self.stdin: IO[bytes] = cast(IO[bytes], self.proc.stdin)
        self.stdout: IO[bytes] = cast(IO[bytes], self.proc.stdout)
        self._buf = b""

    def line(self, timeout_s: float) -> Dict[str, Any]:
        """The next JSON line; WanError with the process's stderr if it fails, exits or is late."""
        deadline = time.monotonic() + timeout_s
        fd = self.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WanError(f"{self.what}: no answer within {timeout_s:.0f} s{self._stderr()}")
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 65536)
                if not chunk:
                    self.proc.wait(5)
                    raise WanError(f"{self.what} exited ({self.proc.returncode}) without an answer{self._stderr()}")
                self._buf += chunk
        raw, self._buf = self._buf.split(b"\n", 1)
        obj = json.loads(raw)
        if "error" in obj:
            raise WanError(f"{self.what}: {obj['error']}")
        return obj

    def _stderr(self) -> str:
        self._err.seek(0)
        err = self._err.read().decode(errors="replace").strip()
        return f"; stderr: {err[-1500:]}" if err else ""

    def close(self, timeout_s: float = 10.0) -> int:
        """Close stdin (servers stop on it), wait, then terminate/kill; the exit status."""
        try:
            self.stdin.close()
        except OSError:
            pass
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                return self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait()
        finally:
            self.stdout.close()
            self._err.close()

    def __enter__(self) -> "SiteProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def measure(tb: Testbed, src: int = 0, dst: int = 1, seconds: float = 2.0, pings: int = 10) -> Dict[str, Any]:
    """RTT (UDP echo, one probe in flight, as ping) and one TCP stream of `seconds`, site src -> dst."""
    with SiteProcess(tb, dst, ["serve", "--host", tb.site_addr(dst), "--deadline-s", "120"]) as server:
        addr = server.line(30)["address"]
        with SiteProcess(tb, src, ["measure", "--to", addr, "--pings", str(pings), "--seconds", str(seconds),
                                   "--timeout-s", "60"]) as client:
            out = client.line(60 + seconds + pings * 2.1)
    out["ping"] = _ping(tb, src, dst, pings)
    # a new namespace starts with the host's default, and may switch only among the host's allowed
    # ones (net.ipv4.tcp_allowed_congestion_control, a host-wide setting the testbed leaves alone)
    cc = subprocess.run(in_ns(tb.site_ns(src), ["cat", "/proc/sys/net/ipv4/tcp_congestion_control"]),
                        capture_output=True, text=True, timeout=10)
    out["tcp_cc"] = cc.stdout.strip() or None
    out.update(src=SITE_NAMES[src], dst=SITE_NAMES[dst], note=testbed_note(tb, (src, dst)))
    return out


def _ping(tb: Testbed, src: int, dst: int, count: int) -> Optional[Dict[str, float]]:
    """ICMP RTT by the system's ping (iputils), where installed: min/avg/max ms, or None."""
    if not shutil.which("ping") or count <= 0:
        return None
    try:
        p = subprocess.run(in_ns(tb.site_ns(src), ["ping", "-n", "-q", "-c", str(count), "-i", "0.2", "-W", "2",
                                                   tb.site_addr(dst)]),
                           capture_output=True, text=True, timeout=count * 0.2 + 10)
    except subprocess.TimeoutExpired:
        return None
    m = re.search(r"= ([\d.]+)/([\d.]+)/([\d.]+)/", p.stdout)
    return {"min_ms": float(m.group(1)), "avg_ms": float(m.group(2)), "max_ms": float(m.group(3))} if m else None


def format_measurement(m: Dict[str, Any]) -> str:
    rtt = m.get("rtt", {})
    parts = [f"measured {m['src']} -> {m['dst']}:"]
    if "median_ms" in rtt:
        parts.append(f"rtt {rtt['min_ms']:.2f}/{rtt['median_ms']:.2f}/{rtt['max_ms']:.2f} ms min/median/max "
                     f"(UDP echo, {rtt['probes'] - rtt['lost']}/{rtt['probes']} answered)")
    else:
        parts.append(f"rtt: no echo answered ({rtt.get('probes', 0)} probes)")
    if m.get("ping"):
        p = m["ping"]
        parts.append(f"ping {p['min_ms']:.2f}/{p['avg_ms']:.2f}/{p['max_ms']:.2f} ms min/avg/max")
    tcp = m.get("tcp")
    if tcp:
        parts.append(f"tcp stream {fmt_rate(tcp['bps'])} ({tcp['bytes'] / 1e6:.1f} MB in {tcp['seconds']:.2f} s, "
                     f"{m.get('tcp_cc') or '?'}, {'verified' if tcp['ok'] else 'MISMATCH'})")
    return "  ".join(parts) + f"\n{m['note']}"


def link_rx_bytes(tb: Testbed, site: int) -> int:
    """Bytes the router has received from `site`'s link: what crossed that shaped link upstream."""
    out = subprocess.run(["ip", "-n", tb.router, "-j", "-s", "link", "show", "dev", f"s-{SITE_NAMES[site]}"],
                         capture_output=True, text=True, timeout=10)
    if out.returncode != 0:
        raise WanError(f"cannot read the counters of link s-{SITE_NAMES[site]}: {out.stderr.strip()}")
    return int(json.loads(out.stdout)[0]["stats64"]["rx"]["bytes"])


def _crossed(tb: Testbed, src: int, before: int, nbytes: int, what: str) -> int:
    crossed = link_rx_bytes(tb, src) - before
    if crossed < nbytes:  # e.g. a same-host shortcut that copies between the namespaces' processes
        raise WanError(f"{what}: only {crossed} B crossed site {SITE_NAMES[src]}'s link for a {nbytes} B payload; "
                       f"the transfer did not go through the testbed")
    return crossed


def check_transfer(tb: Testbed, nbytes: int, src: int = 0, dst: int = 1, mode: str = "fedrdma-e",
                   chunk_bytes: int = 1 << 20, timeout_s: float = 90.0, seed: int = 14) -> Dict[str, Any]:
    """`nbytes` seeded bytes site src -> dst through a fate-rdma channel (soft provider, authenticated)
    and through one plain TCP stream; both verified by crc32c at the receiver. WanError on any failure."""
    sd = state_dir()
    sd.mkdir(parents=True, exist_ok=True)
    result: Dict[str, Any] = {"bytes": nbytes, "src": SITE_NAMES[src], "dst": SITE_NAMES[dst], "note": testbed_note(tb, (src, dst))}
    with tempfile.TemporaryDirectory(dir=sd, prefix=f"{tb.prefix}-check-") as tmp:
        from fate_rdma.channel.auth import write_secret

        secret = str(Path(tmp) / "secret")
        write_secret(secret)
        common = ["--secret", secret, "--mode", mode, "--chunk-bytes", str(chunk_bytes),
                  "--slot-bytes", str(max(nbytes, chunk_bytes)), "--timeout-s", str(timeout_s)]
        with SiteProcess(tb, dst, ["channel-recv", "--host", tb.site_addr(dst), "--count", "2", *common]) as rx:
            addr = rx.line(60)["address"]
            before = link_rx_bytes(tb, src)
            with SiteProcess(tb, src, ["channel-send", "--host", tb.site_addr(src), "--to", addr,
                                       "--bytes", str(nbytes), "--seed", str(seed), "--warmup", *common]) as tx:
                sent = tx.line(timeout_s + 30)  # after an untimed warm-up chunk: connect and RTT probe
            rx.line(30)  # the warm-up
            got = rx.line(30)
        ok = got["nbytes"] == sent["bytes"] == nbytes and got["crc32c"] == sent["crc32c"]
        result["channel"] = {"mode": mode, "seconds": sent["seconds"], "bps": sent["bps"], "label": sent["label"],
                             "crc32c": sent["crc32c"], "received_crc32c": got["crc32c"], "ok": ok,
                             "link_bytes": _crossed(tb, src, before, nbytes, "fate-rdma channel")}
        if not ok:
            raise WanError(f"fate-rdma channel transfer {SITE_NAMES[src]} -> {SITE_NAMES[dst]} corrupted: sent "
                           f"{nbytes} B crc32c {sent['crc32c']:#x}, received {got['nbytes']} B crc32c {got['crc32c']:#x}")
    with SiteProcess(tb, dst, ["serve", "--host", tb.site_addr(dst), "--deadline-s", str(timeout_s + 30)]) as server:
        addr = server.line(30)["address"]
        before = link_rx_bytes(tb, src)
        with SiteProcess(tb, src, ["tcp-send", "--to", addr, "--bytes", str(nbytes), "--seed", str(seed),
                                   "--timeout-s", str(timeout_s)]) as tx:
            tcp = tx.line(timeout_s + 30)
    result["tcp"] = {"seconds": tcp["seconds"], "bps": tcp["bps"], "crc32c": tcp["crc32c"],
                     "received_crc32c": tcp["sink"]["crc32c"], "ok": tcp["ok"],
                     "link_bytes": _crossed(tb, src, before, nbytes, "TCP stream")}
    if not tcp["ok"]:
        raise WanError(f"TCP stream {SITE_NAMES[src]} -> {SITE_NAMES[dst]} corrupted: {tcp}")
    return result


def format_check(c: Dict[str, Any]) -> str:
    ch, tcp = c["channel"], c["tcp"]
    return (f"check {c['src']} -> {c['dst']}, {c['bytes'] / 1e6:.1f} MB, crc32c verified at the receiver:\n"
            f"  fate-rdma {ch['mode']} ({ch['label']}): {ch['seconds']:.2f} s, {fmt_rate(ch['bps'])}, "
            f"{ch['link_bytes'] / 1e6:.1f} MB crossed the link\n"
            f"  plain TCP stream: {tcp['seconds']:.2f} s, {fmt_rate(tcp['bps'])}, "
            f"{tcp['link_bytes'] / 1e6:.1f} MB crossed the link\n{c['note']}")
