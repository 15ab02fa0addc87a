"""Error-feedback encoding of slot codes (a plan's ``feedback_metric``): validation KL by damping.

    git show 8a2a36c:bench/results/search-2.5bpv.yaml > before.yaml   # the plan the default was chosen on
    python bench/error_feedback.py before.yaml --origin "git show 8a2a36c:bench/results/search-2.5bpv.yaml"
    # -> bench/results/error_feedback.md (~4 min on the 2-core box)

The plan's bits, formats, rotations, sink and copies are kept; only the encoder changes: codes
rounded to the nearest level (no metric), or chosen by error feedback under the metrics ``kvplan
search`` learns (:mod:`kvplan.search.feedback_metric`: keys' from the 12 calibration samples'
queries, values' from o_proj) at each damping. The bytes are the same in every row. Scored by the
**validation** scorer of ``kvplan search`` (16 samples, 512-token history, the deployed route), so
the table can choose the damping; it never looks at the test split. Which parts matter: the
metric of one kind replaced by the identity (its codes are then the nearest levels).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from _stamp import stamp  # noqa: E402
from kvplan import Plan  # noqa: E402
from kvplan.plans import atomic_write_text  # noqa: E402
from kvplan.runtime.cache import plan_rotations  # noqa: E402
from kvplan.search.feedback_metric import FEEDBACK_DAMPING, feedback_metric, output_projections  # noqa: E402
from kvplan.search.key_basis import query_second_moments  # noqa: E402
from kvplan.search.scorers import task_scorers  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--origin", default=None, help="where the plan file came from (written in the table's head)")
    ap.add_argument("--dampings", type=float, nargs="+", default=[0.01, 0.1, 0.3, 1.0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "error_feedback.md"))
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("KVPLAN_THREADS", "1")))
    t0 = time.time()
    plan = Plan.from_yaml(args.plan).replace(feedback_metric=None)
    scorers = task_scorers(n_calibration=12, n_validation=16, n_test=0, progress=False)
    cal, val = scorers.calibration, scorers.validation
    moments = query_second_moments(cal.model, cal.calibration_sequences(), processes=cal.processes.processes)
    projections = output_projections(cal.model, plan.geometry.num_layers)

    def metric(damping):
        return feedback_metric(moments, projections, lambda layer: plan_rotations(plan, "cpu", layer),
                               plan.reference.context_len, damping)

    lines = ["# Error-feedback encoding: validation KL by damping", "",
             f"Command: {stamp()} (method in the script's "
             f"docstring).{f' The plan: `{args.origin}`.' if args.origin else ''} Honest bpv {plan.bpv().total:.4f} "
             "in every row (the encoder changes no byte).", "",
             "| encoder | damping | validation KL [95% CI] |", "|---|---:|---|"]
    rows = [("nearest level (no metric)", None, None)]
    rows += [("error feedback, K and V", d, metric(d)) for d in args.dampings]
    chosen = metric(FEEDBACK_DAMPING)
    eye = np.broadcast_to(np.eye(plan.geometry.head_dim, dtype=np.float32) * (1 + FEEDBACK_DAMPING), chosen.shape[2:])
    for kind, name in ((1, "error feedback, keys only"), (0, "error feedback, values only")):
        m = chosen.copy()
        m[:, kind] = eye
        rows.append((name, FEEDBACK_DAMPING, m))
    for name, damping, m in rows:
        r = val(plan.replace(feedback_metric=m))
        lines.append(f"| {name} | {'-' if damping is None else damping} | {r['kl']:.5f} [{r['kl_ci95_lo']:.4f}, "
                     f"{r['kl_ci95_hi']:.4f}] |")
        print(lines[-1], flush=True)
    lines += ["", f"Wall time {time.time() - t0:.0f} s."]
    atomic_write_text(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
