"""`fate-rdma eval fate`: runs every method of a plan on one testbed and writes rows, table and plot
(eval.fate builds the plan and the rows, eval.fate_train the training-round view)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, List

from fate_rdma_lab.eval.common import Rows, measured_link, print_md, results_dir, secret_file, testbed
from fate_rdma_lab.eval.fate import (FULL, QUICK, MiB, Plan, make_row, make_testbed, markdown, ratios,  # noqa: F401
                                     run_method, write_plot)
from fate_rdma_lab.eval.fate_train import (TRAIN_PNG, _loss, _sec, fate_weights, train_markdown, train_rows,
                                           write_train_plot)
from fate_rdma_lab.testbed import bed as wan


def run_fate(plan: Plan, out_root: Path, prefix: str = "freval", timeout_s: float = 600.0,
             log: Callable[[str], None] = print, command: str = "") -> Path:
    """Every method of the plan on one testbed; returns the results folder. WanError (after writing
    it) if a method failed or was not verified."""
    train = plan.job == "train"
    out = results_dir(out_root, "fate-train" if train else "fate")
    rows = Rows(out)
    failed: List[str] = []
    try:
        # measured guest (b) -> arbiter (a): a client's upload path
        with secret_file() as secret, testbed(make_testbed(plan, prefix), plan.measure_s, log, src=1, dst=0) as bed:
            measured = measured_link(bed.measured)
            for n, method in enumerate(plan.methods):
                log(f"  {method}: {plan.payload}, {plan.rounds} round(s) ...")
                t0 = time.monotonic()
                try:
                    got = run_method(bed.tb, method, plan, secret, out, timeout_s, n)
                except (wan.WanError, OSError, ValueError, KeyError) as exc:
                    failed.append(f"{method}: {exc}")
                    log(f"  {method}: FAILED: {exc}")
                    continue
                if train:
                    made = [rows.add(x) for x in train_rows(method, got, plan, measured, bed.tb, fate_weights(rows))]
                    r = made[-1]
                    log(f"  {method}: per round (median of {plan.rounds}) compute {_sec(r['compute_seconds'])} s, "
                        f"comm {_sec(r['comm_seconds'])} s; loss at round {plan.rounds} {_loss(r)} (guest / host), "
                        f"{r['link_bytes_total'] / MiB:.1f} MiB crossed the links, "
                        f"{'verified' if r['verified'] else 'NOT verified: ' + '; '.join(r['failures'])} "
                        f"({time.monotonic() - t0:.0f} s)")
                    continue
                r = rows.add(make_row(method, got, plan, measured, bed.tb))
                log(f"  {method}: {r['round_comm_seconds']:.3f} s per round (median of {plan.rounds}), "
                    f"{r['link_bytes_total'] / MiB:.1f} MiB crossed the links, "
                    f"{'verified' if r['verified'] else 'NOT verified: ' + '; '.join(r['failures'])} "
                    f"({time.monotonic() - t0:.0f} s)")
            if not train:
                ratios(rows)
    finally:
        if train:
            lines = rows.save(out, train_markdown(rows.rows, plan, command, failed),
                              lambda: write_train_plot(rows.rows, plan, out / TRAIN_PNG))
        else:
            lines = rows.save(out, markdown(rows.rows, plan, command, failed),
                              lambda: write_plot(rows.rows, out / "fate_path.png"))
    print_md(lines, log, out)
    # a payload job's rows, a training job's median rows: one a method, with its verification
    bad = failed + [f"{r['method']}: {'; '.join(r['failures'])}" for r in rows.rows
                    if r.get("row") in (None, "median") and not r["verified"]]
    if bad:
        raise wan.WanError("; ".join(bad) + f" (results in {out})")
    return out
