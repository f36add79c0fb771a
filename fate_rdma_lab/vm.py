"""Run a command inside a qemu VM that has a Soft-RoCE (rxe) RDMA device: real kernel verbs on any
x86-64 Linux host, no RDMA NIC needed.

The guest is a stock Debian kernel (unpacked into a cache folder by `deploy/rdma-vm/prepare.sh`,
never installed into /boot) with a busybox initramfs. Its root is the host's own root, shared
read-only over virtio-9p under a tmpfs overlay, so the guest runs the host's Python, venv and
rdma-core; writes stay in the guest's memory and vanish at power-off. `rxe0` sits on one end of a
veth pair (no NIC, no network to the outside). The command's stdout, stderr and exit status come
back through a second, writable 9p share: a per-run job folder under the host's temp directory,
mounted in the guest at the same path.

KVM is used when it works; these cloud VMs usually refuse it (nested virtualisation), so a quick
probe boot decides and its verdict is cached per host kernel and qemu version. Under TCG every
instruction is emulated: expect Python to run 3-10x slower, and never read a figure from there as
RDMA performance.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, IO, List, Mapping, Optional, Sequence, Tuple

from easypyverbs.providers.pyverbs_devices import SOFT_ROCE_KVM_VM as LABEL_KVM
from easypyverbs.providers.pyverbs_devices import SOFT_ROCE_TCG_VM as LABEL_TCG

#: exit statuses of `run` that are not the command's own (those of timeout(1) and docker run)
EXIT_TIMEOUT = 124
EXIT_VM_FAILED = 125

# variables passed into the guest by default, besides --env ones and these prefixes
_PASS_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "PYTHONPATH", "VIRTUAL_ENV", "PYTHONHASHSEED")
_PASS_PREFIXES = ("EASYPYVERBS_", "FATE_RDMA_", "PYTEST_")

# a KVM guest reaches stage 1 in about a second; the probe's limit only matters where KVM hangs
KVM_PROBE_TIMEOUT_S = 20.0


class VMError(Exception):
    """The VM could not be prepared, booted, or could not bring up rxe0 (not the command's failure)."""


class VMUnavailable(VMError):
    """qemu cannot run on this host at all (wrong architecture, no qemu and no way to install it)."""


@dataclasses.dataclass(frozen=True)
class VMImage:
    kver: str
    vmlinuz: str
    initrd: str
    modules: str


@dataclasses.dataclass
class VMResult:
    status: int  # the command's exit status, or EXIT_TIMEOUT / EXIT_VM_FAILED
    stdout: str
    stderr: str
    accel: str  # "kvm" or "tcg"
    boot_s: Optional[float]  # guest uptime when rxe0 was ACTIVE
    wall_s: float  # qemu start to exit
    timed_out: bool = False
    error: str = ""  # why the VM failed, when status == EXIT_VM_FAILED

    @property
    def label(self) -> str:
        return LABEL_KVM if self.accel == "kvm" else LABEL_TCG


def scripts_dir() -> Path:
    d = Path(__file__).resolve().parent.parent / "deploy" / "rdma-vm"
    if not (d / "prepare.sh").is_file():
        raise VMUnavailable(f"deploy/rdma-vm not found next to the package ({d}); run from a source checkout")
    return d


def cache_dir() -> Path:
    base = os.environ.get("FATE_RDMA_VM_CACHE")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "fate-rdma" / "vm"


def host_problem() -> Optional[str]:
    """Why this host cannot run the VM, or None. Cheap: no boot, no download."""
    if sys.platform != "linux":
        return f"the RDMA VM needs Linux (this is {sys.platform})"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the RDMA VM boots an amd64 Debian kernel; this host is {platform.machine()}"
    if not shutil.which("qemu-system-x86_64") and not (os.geteuid() == 0 and shutil.which("apt-get")):
        return "qemu-system-x86_64 is missing and cannot be installed here (needs root and apt-get: apt-get install qemu-system-x86)"
    if os.geteuid() != 0:
        return "the RDMA VM shares the host's root read-only with the guest and needs root to read all of it"
    return None


def prepare(cache: Optional[Path] = None, timeout_s: float = 900.0, log: Optional[IO[str]] = None) -> VMImage:
    """Download and unpack the kernel and build the initramfs (once; later calls return at once)."""
    problem = host_problem()
    if problem:
        raise VMUnavailable(problem)
    cache = Path(cache or cache_dir())
    try:
        out = subprocess.run(["bash", str(scripts_dir() / "prepare.sh"), str(cache)], capture_output=True, text=True,
                             timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise VMError(f"deploy/rdma-vm/prepare.sh did not finish within {timeout_s:.0f} s") from exc
    if log is not None and out.stderr:
        log.write(out.stderr)
    if out.returncode != 0:
        raise (VMUnavailable if out.returncode == 3 else VMError)(
            f"deploy/rdma-vm/prepare.sh failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    env: Dict[str, str] = {}
    for line in (cache / "vm.env").read_text().splitlines():
        k, _, v = line.partition("=")
        env[k] = v
    return VMImage(env["KVER"], env["VMLINUZ"], env["INITRD"], env["MODULES"])


def _qemu_cmd(image: VMImage, accel: str, job: Path, append: str, memory_mib: int, cpus: int, console: Path) -> List[str]:
    if accel == "kvm":
        machine = ["-accel", "kvm", "-cpu", "host"]
    else:
        machine = ["-accel", "tcg,thread=multi", "-cpu", "max"]
    return ["qemu-system-x86_64", *machine, "-smp", str(cpus), "-m", f"{memory_mib}M",
            "-nic", "none", "-display", "none", "-no-reboot", "-monitor", "none", "-serial", f"file:{console}",
            "-kernel", image.vmlinuz, "-initrd", image.initrd,
            "-append", f"console=ttyS0 quiet loglevel=3 panic=-1 {append}",
            # multidevs=remap: the host's root spans several file systems; without it inode numbers
            # collide in the guest and the overlay misbehaves
            "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
            "-virtfs", f"local,path={job},mount_tag=frvmjob,security_model=none"]


def _accel_cache_key() -> str:
    try:
        qv = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        qv = ""
    return hashlib.sha256(f"{platform.release()}|{qv}".encode()).hexdigest()[:12]


def choose_accel(image: VMImage, requested: str = "auto", cache: Optional[Path] = None) -> Tuple[str, str]:
    """("kvm"|"tcg", why). `auto` tries KVM once per host kernel and qemu version and remembers."""
    if requested in ("kvm", "tcg"):
        return requested, "requested"
    if requested != "auto":
        raise ValueError(f"accel must be auto, kvm or tcg, not {requested!r}")
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "tcg", "no usable /dev/kvm"
    cache = Path(cache or cache_dir())
    memo = cache / f"accel-{_accel_cache_key()}"
    if memo.is_file():
        accel, _, why = memo.read_text().partition(" ")
        return accel, f"{why.strip()} (cached in {memo.name})"
    with tempfile.TemporaryDirectory(prefix="fate-rdma-vm-probe-") as tmp:
        console = Path(tmp) / "console.log"
        cmd = _qemu_cmd(image, "kvm", Path(tmp), "frvm.probe=1", 512, 1, console)
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=KVM_PROBE_TIMEOUT_S)
            ok = "FRVM-PROBE-OK" in console.read_text(errors="replace") if console.exists() else False
            first = (p.stderr or "no output").strip().splitlines()[0][:160]
            why = "KVM probe boot worked" if ok else f"KVM probe failed: {first}"
        except subprocess.TimeoutExpired:
            ok, why = False, f"KVM probe boot did not finish within {KVM_PROBE_TIMEOUT_S:.0f} s"
    accel = "kvm" if ok else "tcg"
    memo.write_text(f"{accel} {why}\n")
    return accel, why


def _guest_env(extra: Mapping[str, str], accel: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in _PASS_ENV or k.startswith(_PASS_PREFIXES)}
    env.update(extra)
    env["FATE_RDMA_VM"] = accel  # tells code inside which label to print
    return env


def _write_job(job: Path, argv: Sequence[str], cwd: str, env: Mapping[str, str]) -> None:
    lines = ["# written by fate-rdma vm run; executed by deploy/rdma-vm/stage2.sh inside the guest",
             f"cd {shlex.quote(cwd)} || exit {EXIT_VM_FAILED}"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items()) if k.isidentifier()]
    lines.append(f"exec {shlex.join(argv)}")
    (job / "cmd.sh").write_text("\n".join(lines) + "\n")


class _Tail:
    """Copies what the guest appends to a job file to one of our streams, as it arrives."""

    def __init__(self, path: Path, out: Optional[IO[str]]) -> None:
        self.path, self.out, self.pos = path, out, 0
        self.chunks: List[bytes] = []

    def pump(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return
        if data:
            self.pos += len(data)
            self.chunks.append(data)
            if self.out is not None:
                self.out.write(data.decode(errors="replace"))
                self.out.flush()

    def text(self) -> str:
        return b"".join(self.chunks).decode(errors="replace")


def run(argv: Sequence[str], *, timeout_s: float = 1800.0, boot_timeout_s: float = 180.0, memory_mib: int = 4096,
        cpus: Optional[int] = None, accel: str = "auto", env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None, stream: bool = True, cache: Optional[Path] = None,
        out_dir: Optional[Path] = None, log: Optional[IO[str]] = sys.stderr) -> VMResult:
    """Boot the VM, bring up rxe0, run `argv` inside (in `cwd`, default ours), return its result.

    timeout_s bounds everything from qemu's start to its exit; boot_timeout_s bounds the time until
    rxe0 is ACTIVE. With `stream`, the command's output is copied to our stdout/stderr as it comes.
    The command finds a writable folder in $FATE_RDMA_VM_OUT; with `out_dir`, what it wrote there is
    copied to `out_dir` (everything else the guest writes vanishes with it).
    Raises VMUnavailable / VMError when the VM cannot be prepared at all; a boot or set-up failure
    inside the guest comes back as status EXIT_VM_FAILED with `error` saying why.
    """
    if not argv:
        raise ValueError("no command to run in the VM")
    cache = Path(cache or cache_dir())
    image = prepare(cache, log=log)
    accel, why = choose_accel(image, accel, cache)
    cpus = cpus or min(os.cpu_count() or 1, 4)
    say = (lambda msg: (log.write(f"fate-rdma vm: {msg}\n"), log.flush())) if log else (lambda msg: None)
    label = LABEL_KVM if accel == "kvm" else LABEL_TCG
    say(f"booting Debian {image.kver} ({accel.upper()}: {why}; {cpus} vCPU, {memory_mib} MiB): {label}")
    with tempfile.TemporaryDirectory(prefix="fate-rdma-vm-") as tmp:
        job = Path(tmp)
        (job / "out").mkdir()
        _write_job(job, argv, cwd or os.getcwd(), {**_guest_env(env or {}, accel), "FATE_RDMA_VM_OUT": str(job / "out")})
        console = job / "console.log"
        append = f"frvm.job={job} frvm.modules={image.modules} frvm.accel={accel}"
        cmd = _qemu_cmd(image, accel, job, append, memory_mib, cpus, console)
        tails = [_Tail(job / "stdout", sys.stdout if stream else None), _Tail(job / "stderr", sys.stderr if stream else None)]
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        boot_s: Optional[float] = None
        timed_out, error = False, ""
        try:
            while proc.poll() is None:
                time.sleep(0.2)
                for t in tails:
                    t.pump()
                elapsed = time.monotonic() - t0
                if boot_s is None and (job / "ready").exists():
                    boot_s = _read_float(job / "ready") or elapsed
                    say(f"rxe0 ACTIVE {boot_s:.1f} s after kernel start ({elapsed:.1f} s wall); running: {shlex.join(argv)}")
                if boot_s is None and elapsed > boot_timeout_s and not (job / "setup-error").exists():
                    error = f"rxe0 not ACTIVE within the boot limit of {boot_timeout_s:.0f} s"
                    break
                if elapsed > timeout_s:
                    timed_out, error = True, f"the VM run exceeded its limit of {timeout_s:.0f} s"
                    break
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        wall_s = time.monotonic() - t0
        for t in tails:
            t.pump()
        qemu_out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
        status_file = job / "status"
        if status_file.exists() and not error:
            status = int(status_file.read_text().strip() or EXIT_VM_FAILED)
        else:
            status = EXIT_TIMEOUT if timed_out else EXIT_VM_FAILED
            for name in ("setup-error", "init-error"):
                if (job / name).exists():
                    error = (job / name).read_text(errors="replace").strip()
                    break
            if not error:
                error = f"qemu exited ({proc.returncode}) before the command finished"
            tail = console.read_text(errors="replace")[-3000:] if console.exists() else ""
            error += "".join(f"\n{x}" for x in (qemu_out.strip(), "guest console (last lines):\n" + tail if tail else "") if x)
        if out_dir is not None:
            shutil.copytree(job / "out", out_dir, dirs_exist_ok=True)
        say(f"finished: status {status} after {wall_s:.1f} s ({accel.upper()})" + (f": {error.splitlines()[0]}" if error else ""))
        return VMResult(status, tails[0].text(), tails[1].text(), accel, boot_s, wall_s, timed_out, error)


def _read_float(path: Path) -> Optional[float]:
    try:
        return float(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
