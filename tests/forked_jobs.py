"""Run FATE launcher jobs one after another from one Python that imports torch, transformers, peft and
FATE-LLM once: each job in a forked child, and FATE's multiprocess launcher forking its party
processes instead of spawning them.

    python -m tests.forked_jobs JOBS.json

JOBS.json is a list of {"argv": [...], "cwd": DIR}; argv is what would follow `python` on a command
line (a script and its arguments, or `-m fate_rdma.cli launch --conf FILE SCRIPT ...`). Prints one
line per job, `job N: exit S after T s`, and exits with the first non-zero status.

Why: inside the Soft-RoCE VM (qemu TCG, 2 vCPUs) every party process that FATE's launcher spawns
spends 3-4 minutes importing torch, transformers, datasets, peft and FATE-LLM before it trains. The
jobs themselves are unchanged: the same scripts, the same launcher code, the same federation; only the
start method of the launcher's processes differs (fork after the imports, before any thread, device
or socket exists). On the host the tests run the jobs as users do (spawned processes).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time

HEAVY = ("torch", "transformers", "datasets", "peft", "fate.arch", "fate.ml.nn.homo.fedavg",
         "fate_llm.algo.fedavg.fedavg", "fate_llm.trainer.seq2seq_trainer", "fate_rdma_lab.llm.gpt2_fedavg")


def _fork_start_method() -> None:
    """FATE's launcher calls set_start_method("spawn"): make every start method request mean fork."""
    multiprocessing.set_start_method("fork", force=True)
    real = multiprocessing.set_start_method

    def fork_only(method, force=False):
        real("fork", force=True)

    multiprocessing.set_start_method = fork_only


def _run_job(argv: list, cwd: str) -> int:
    import runpy

    os.chdir(cwd)
    _fork_start_method()
    try:
        if argv[:2] == ["-m", "fate_rdma.cli"]:
            from fate_rdma.cli import main as cli_main

            sys.argv = ["fate-rdma"] + argv[2:]
            return int(cli_main(argv[2:]) or 0)
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)


def main(path: str) -> int:
    import importlib

    t0 = time.monotonic()
    for name in HEAVY:
        importlib.import_module(name)
    print(f"forked_jobs: imports took {time.monotonic() - t0:.0f} s (once for every job)", flush=True)
    jobs = json.load(open(path))
    first_bad = 0
    for i, job in enumerate(jobs):
        t1 = time.monotonic()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _run_job(job["argv"], job["cwd"])
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        print(f"forked_jobs: job {i}: exit {code} after {time.monotonic() - t1:.0f} s", flush=True)
        first_bad = first_bad or code
    return 1 if first_bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
