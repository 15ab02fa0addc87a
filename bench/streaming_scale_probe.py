"""How many KV heads should stream? The damage model's optimum at several streaming damage scales, measured.

    python bench/streaming_scale_probe.py bench/results/search-2.5bpv.yaml   # -> bench/results/streaming_scale_probe.md

The search streams the KV heads that its additive damage model streams at the budget, once two real
evaluations have put the streaming damages on the quantized slots' scale
(``kvplan.search.streaming.calibrate_streaming``). The two parts' miss differs by quantizer setting
(``bench/damage_additivity.py``), so the calibrated scale is an estimate. This probe takes the search's own
profile (``<plan>.search.json``) and space (every quantizer choice of the default search, the plan's
constants: key basis, rotations, formats, error-feedback metric), and for each scale ``f`` on a grid
scores the damage model's optimum (``streaming_optimum(..., stream_scale=f)``: its streamed heads, its
quantizer setting and its knapsack levels, no trial of the search) on the calibration split (what a
search may choose by) and the validation split (what a default may be chosen by). The test split is not
read.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from _stamp import stamp  # noqa: E402
from bench.allocation_ceiling import plan_space, search_profile  # noqa: E402
from kvplan import Plan  # noqa: E402
from kvplan.plans import atomic_write_text  # noqa: E402
from kvplan.search.scorers import DEFAULT_SAMPLES, task_scorers  # noqa: E402
from kvplan.search.space import (DEFAULT_GROUP_SIZES, DEFAULT_RECENT_LENGTHS, DEFAULT_RESIDUAL_LENGTHS,  # noqa: E402
                                 DEFAULT_SINK_LENGTHS)
from kvplan.search.streaming import STREAM_SCALE_KEY, streaming_optimum  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--model", default="smollm2-135m", help="the model the plan was searched on")
    ap.add_argument("--scales", default="1,1.43,2,2.6,3.5,5", help="streaming damage scales, comma-separated")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "streaming_scale_probe.md"))
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("KVPLAN_THREADS", "1")))
    t0 = time.time()
    plan = Plan.from_yaml(args.plan)
    profile = search_profile(args.plan)
    window = plan.quantizer.stream_window
    space = plan_space(plan, group_sizes=DEFAULT_GROUP_SIZES, residual_lengths=DEFAULT_RESIDUAL_LENGTHS,
                       sink_lengths=DEFAULT_SINK_LENGTHS, recent_lengths=DEFAULT_RECENT_LENGTHS)
    budget = plan.target_bpv or plan.bpv().total
    scorers = task_scorers(args.model, n_test=0, progress=False)
    rows = []
    for f in [float(x) for x in args.scales.split(",")]:
        opt = streaming_optimum(space, plan.reference, profile, window, budget, f)
        q = replace(opt.quantizer, stream_window=window)
        p = space.plan_of_table(opt.table, q, plan.reference)
        cal, val = scorers.calibration(p), scorers.validation(p)
        rows.append((f, len(opt.heads), q, p.bpv().total, opt.predicted, cal["kl"], val["kl"]))
        print(rows[-1][:2], q.group_size, q.recent_length, q.sink_length, q.residual_length, cal["kl"], val["kl"],
              flush=True)
    lines = [f"# Streaming damage scale: the damage model's optimum at each scale ({plan.name}'s profile)", "",
             f"Command: {stamp()} "
             f"(method in the script's docstring; the search calibrated {profile.get(STREAM_SCALE_KEY)}). "
             f"Calibration {DEFAULT_SAMPLES['calibration']} samples, validation {DEFAULT_SAMPLES['validation']}; "
             "no trial of the search, only the knapsack optimum.", "",
             "| scale | streamed heads | quantizer (group, residual, sink, recent) | honest bpv | predicted | "
             "calibration KL | validation KL |", "|---:|---:|---|---:|---:|---:|---:|"]
    for f, n, q, bpv, pred, cal, val in rows:
        lines.append(f"| {f:g} | {n} | {q.group_size}, {q.residual_length}, {q.sink_length}, {q.recent_length} | "
                     f"{bpv:.4f} | {pred:.4f} | {cal:.4f} | {val:.4f} |")
    lines += ["", f"Wall time {time.time() - t0:.0f} s."]
    atomic_write_text(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
