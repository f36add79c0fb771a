"""`fate-rdma vm run|prepare|status`: real kernel RDMA verbs (Soft-RoCE, rxe0) in a qemu VM, no RDMA NIC.

`fate-rdma vm run -- CMD ARGS...` boots a stock Debian kernel under qemu with this host's root shared
read-only (writes go to a tmpfs overlay and vanish), brings up `rxe0` on a veth pair, runs CMD in the
current directory with this environment's PATH/HOME/VIRTUAL_ENV/PYTHONPATH and EASYPYVERBS_*,
FATE_RDMA_*, PYTEST_* variables, streams its output and exits with its status.

Exit statuses of `vm run`: the command's own; 124 the run exceeded --timeout; 125 the VM could not
be prepared, booted, or could not bring up rxe0 (the reason is printed); 2 bad usage.
`vm status` exits 0 when the VM can run here, 1 when not (printing why).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = 'run a command in a qemu VM with a Soft-RoCE (rxe0) RDMA device: real verbs, no NIC'


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    sub = p.add_subparsers(dest="vm_action", metavar="ACTION", required=True)
    r = sub.add_parser("run", help="boot the VM, run a command inside with rxe0 up, return its status and output",
                       description="Run CMD inside the RDMA VM. Put '--' before CMD. Example:\n"
                                   "  fate-rdma vm run -- .venv/bin/python -m pytest -q tests/test_verbs_conformance.py",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--timeout", type=float, default=1800.0, metavar="S",
                   help="limit on the whole run, boot included, in seconds (default 1800); exit 124 after it")
    r.add_argument("--boot-timeout", type=float, default=180.0, metavar="S",
                   help="limit until rxe0 is ACTIVE (default 180; TCG boots take ~8 s of guest time, more on a busy host)")
    r.add_argument("--memory", type=int, default=4096, metavar="MIB", help="guest memory in MiB (default 4096); "
                   "the overlay's writes live in it too")
    r.add_argument("--cpus", type=int, default=None, help="vCPUs (default: host cores, at most 4)")
    r.add_argument("--accel", choices=["auto", "kvm", "tcg"], default="auto",
                   help="auto (default): KVM if a quick probe boot works (verdict cached), else TCG emulation")
    r.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment for CMD (repeatable)")
    r.add_argument("--out", default=None, metavar="DIR", help="copy what CMD wrote under $FATE_RDMA_VM_OUT to DIR "
                   "(the guest's other writes vanish at power-off)")
    r.add_argument("cmd", nargs=argparse.REMAINDER, help="the command and its arguments, after '--'")
    h = "download the kernel and build the initramfs now (deploy/rdma-vm/prepare.sh; `run` does it when needed)"
    sub.add_parser("prepare", help=h, description=h)
    h = "say whether the VM can run here (qemu and what it needs on this host), and where its files are cached"
    sub.add_parser("status", help=h, description=h + "; exit 0 when it can run, 1 when not")


def run(args: argparse.Namespace) -> int:
    from fate_rdma_lab import vm as rdma_vm

    if args.vm_action == "status":
        problem = rdma_vm.host_problem()
        print(f"cache: {rdma_vm.cache_dir()}")
        if problem:
            print(f"the RDMA VM cannot run here: {problem}")
            return 1
        print("the RDMA VM can run here (qemu-system-x86_64; kernel fetched on first use)")
        return 0
    if args.vm_action == "prepare":
        try:
            image = rdma_vm.prepare(log=sys.stderr)
        except rdma_vm.VMError as exc:
            print(f"fate-rdma vm prepare: {exc}", file=sys.stderr)
            return 1
        print(f"kernel {image.kver}: {image.vmlinuz}\ninitramfs: {image.initrd}")
        return 0
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("fate-rdma vm run: no command given; usage: fate-rdma vm run [OPTIONS] -- CMD [ARGS...]", file=sys.stderr)
        return 2
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            print(f"fate-rdma vm run: --env wants KEY=VALUE, got {item!r}", file=sys.stderr)
            return 2
        env[key] = value
    try:
        res = rdma_vm.run(cmd, timeout_s=args.timeout, boot_timeout_s=args.boot_timeout, memory_mib=args.memory,
                          cpus=args.cpus, accel=args.accel, env=env, out_dir=Path(args.out) if args.out else None)
    except rdma_vm.VMError as exc:
        print(f"fate-rdma vm run: {exc}", file=sys.stderr)
        return rdma_vm.EXIT_VM_FAILED
    if res.error:
        print(f"fate-rdma vm run: {res.error}", file=sys.stderr)
    return res.status
