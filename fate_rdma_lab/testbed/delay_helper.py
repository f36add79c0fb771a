"""The testbed's delay helper (deploy/wan/delay_helper.c, in the router's namespace: delay and reordering per
link): built once per source version into the user's cache, found in /proc by its prefix, stopped (bed.py starts
it with a testbed's links)."""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List

from fate_rdma_lab.testbed.spec import WanError

#: helpers this process started, reaped when stopped
HELPERS: Dict[int, "subprocess.Popen[bytes]"] = {}


def helper_source() -> Path:
    src = Path(__file__).resolve().parents[2] / "deploy" / "wan" / "delay_helper.c"
    if not src.is_file():
        raise WanError(f"deploy/wan/delay_helper.c not found next to the package ({src}); run from a source checkout")
    return src


def build_helper() -> Path:
    """Compile the helper once per source version into the user's cache (atomic rename: safe in parallel)."""
    src = helper_source()
    digest = hashlib.sha256(src.read_bytes()).hexdigest()[:12]
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    out = Path(xdg) / "fate-rdma" / "wan" / f"wan-delay-{digest}"
    if out.is_file() and os.access(out, os.X_OK):
        return out
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise WanError("no C compiler for the delay helper: apt-get install gcc")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    try:
        made = subprocess.run([cc, "-O2", "-std=gnu99", "-Wall", "-o", str(tmp), str(src)], capture_output=True,
                              text=True, timeout=120)
    except subprocess.TimeoutExpired as exc:
        raise WanError("compiling the delay helper took more than 120 s") from exc
    if made.returncode != 0:
        raise WanError(f"compiling the delay helper failed ({made.returncode}): {made.stderr.strip()[-500:]}")
    tmp.replace(out)
    return out


def pid_is_helper(pid: int, prefix: str) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(b"wan-delay-" in c for c in cmd[:1]) and f"{prefix}-delay.json".encode() in b" ".join(cmd)


def helper_pids(prefix: str) -> List[int]:
    """Running delay helpers of this prefix, found in /proc (the state file may be gone or stale)."""
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and pid_is_helper(int(p.name), prefix)]


def stop_pid(pid: int, timeout_s: float = 5.0) -> None:
    proc = HELPERS.pop(pid, None)
    if proc is not None:  # our own child: terminate and reap it through its Popen
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:  # not our child: poll for its disappearance
            if not Path(f"/proc/{pid}").exists():
                return
        time.sleep(0.02)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
