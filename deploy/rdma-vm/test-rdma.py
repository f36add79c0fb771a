"""`make test-rdma`: the pyverbs legs of the test suite on Soft-RoCE (rxe0) in one qemu VM boot.

    .venv/bin/python deploy/rdma-vm/test-rdma.py [--timeout S] [PYTEST_ARGS...]

Boots the VM once (`fate-rdma vm run`), runs pytest inside on the tests selected below (every test
whose id names the pyverbs provider), then prints how many ran on rxe0 and how they ended, the boot
time and the VM leg's wall time. Exit status: 0 all passed (or skipped because qemu cannot run on
this host: the reason is printed), 1 a test failed or none ran on rxe0, 125 the VM failed.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the legs that run on a real verbs device; their pyverbs parametrizations are picked with -k
FILES = ["tests/test_verbs_conformance.py", "tests/test_verbs_processes.py", "tests/test_providers.py",
         "tests/test_adversary.py", "tests/test_channel_pool.py"]
# the tiny GPT-2 FedAvg (full fine-tune) through FATE's launcher, weights bitwise equal with and without
# fate-rdma on pyverbs over rxe0. Importing torch and FATE-LLM under TCG takes minutes, so both jobs run from
# one process that imported them once (tests/forked_jobs.py). The LoRA leg runs the same code on the
# channel: `test-rdma.py tests/test_llm_fedavg.py -k "lora and pyverbs"`
LLM = ["tests/test_llm_fedavg.py::test_fedavg_weights_bitwise_identical_with_and_without_fate_rdma[full-pyverbs]"]
# the channel on rxe0, both modes: each test starts a peer process (10-20 s under TCG), so the leg takes
# the boundary sizes, scatter-gather, integrity, cancel, several QPs, concurrent senders and 10 MiB
# payloads (under the default checksum, xxh3; corruption once more under crc32c); all of them: `test-rdma.py
# tests/test_channel.py -k pyverbs`
CHANNEL = [f"tests/test_channel.py::{t}[{m}pyverbs{p}]" for m in ("fedrdma-", "fedrdma-e-") for t, p in (
    ("test_sizes", "-1"), ("test_sizes", "-655367"), ("test_scatter_gather_and_reuse", ""),
    ("test_corrupted_transfer_is_detected", ""), ("test_several_queue_pairs", ""),
    ("test_three_concurrent_senders_progress_fairly", ""), ("test_large_payloads_at_once_several_to_one", ""))]
CHANNEL += [f"tests/test_channel.py::{t}[{m}-pyverbs]" for m in ("fedrdma", "fedrdma-e")
            for t in ("test_cancel_mid_transfer", "test_peer_death_mid_transfer_errors_without_leaks",
                      "test_corrupted_transfer_is_detected_under_crc32c")]
# a payload still being copied in (a buffered put's overlapped copy, transfer.Fill) on rxe0: chunks posted only
# once final, in both modes, and a copy that fails; all of them: `test-rdma.py tests/test_fill.py -k pyverbs`
CHANNEL += ["tests/test_fill.py::test_a_payload_copied_in_while_it_goes_arrives_whole[pyverbs-xxh3-fedrdma-e]",
            "tests/test_fill.py::test_a_payload_copied_in_while_it_goes_arrives_whole[pyverbs-none-fedrdma]",
            "tests/test_fill.py::test_the_copiers_block_digests_make_the_checksum[pyverbs-xxh3]",
            "tests/test_fill.py::test_a_copy_that_fails_fails_its_transfer_and_delivers_nothing[pyverbs-fedrdma-e]"]
# resume on rxe0: the sender's QP put in error mid-transfer, the connection made again with new QPs and keys
CHANNEL += [f"tests/test_resume.py::test_a_qp_in_error_is_resumed_on_new_queue_pairs[pyverbs-{m}]"
            for m in ("fedrdma", "fedrdma-e")]
# failing on rxe0, not in the leg until fixed (printed at every run, never silently left out). Peer death
# failed until the channel watched the bootstrap socket: an idle RC QP waiting for ACKs never notices a
# dead peer, so the sender ended in a TransferTimeout instead of PeerUnreachable.
OPEN: dict = {}


def main(argv: list) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--timeout", type=float, default=2700.0, help="limit on the VM leg, boot included (default 2700 s)")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (default: the pyverbs legs of FILES)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from fate_rdma_lab import vm as rdma_vm

    problem = rdma_vm.host_problem()
    if problem:
        print(f"test-rdma: SKIPPED, the pyverbs legs did not run: qemu cannot run here: {problem}")
        return 0
    with tempfile.TemporaryDirectory(prefix="fate-rdma-test-rdma-") as tmp:
        junit = "$FATE_RDMA_VM_OUT/junit.xml"
        select = args.pytest_args or [*FILES, *CHANNEL, *LLM, "-k", "pyverbs"]
        cmd = ["sh", "-c", f'exec "$0" -m pytest -q -p no:cacheprovider -rfEs --junitxml="{junit}" "$@"',
               sys.executable, *select]
        try:
            res = rdma_vm.run(cmd, timeout_s=args.timeout, cwd=str(ROOT), out_dir=Path(tmp), memory_mib=6144)
        except rdma_vm.VMUnavailable as exc:
            print(f"test-rdma: SKIPPED, the pyverbs legs did not run: {exc}")
            return 0
        except rdma_vm.VMError as exc:
            print(f"test-rdma: FAILED, the VM could not be prepared: {exc}")
            return rdma_vm.EXIT_VM_FAILED
        if res.error:
            print(f"test-rdma: FAILED: {res.error}")
            return res.status
        counts = {"passed": 0, "failed": 0, "skipped": 0, "xfailed": 0}
        report = Path(tmp) / "junit.xml"
        if report.exists():
            for case in ET.parse(report).getroot().iter("testcase"):
                kinds = {child.tag for child in case}
                if kinds & {"failure", "error"}:
                    counts["failed"] += 1
                elif "skipped" in kinds:
                    msg = next(c.get("type", "") + c.get("message", "") for c in case if c.tag == "skipped")
                    counts["xfailed" if "xfail" in msg else "skipped"] += 1
                else:
                    counts["passed"] += 1
        ran = counts["passed"] + counts["failed"] + counts["xfailed"]
        boot = f"{res.boot_s:.1f} s" if res.boot_s is not None else "?"
        print(f"test-rdma: {ran} tests ran on rxe0 ({res.label}): {counts['passed']} passed, {counts['failed']} failed, "
              f"{counts['xfailed']} xfailed (named device differences), {counts['skipped']} skipped; "
              f"boot to rxe0 ACTIVE {boot} (guest clock), VM leg {res.wall_s:.0f} s wall")
        if not args.pytest_args:
            for test, why in OPEN.items():
                print(f"test-rdma: NOT RUN on rxe0 (open): tests/test_channel.py::{test}: {why}")
        if res.status != 0 or counts["failed"]:
            return 1
        if ran == 0:
            print("test-rdma: FAILED: no test ran on rxe0")
            return 1
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
