"""How a plan holds its attention-sink tokens (``quantizer.sink_bits``): validation KL and honest bpv.

    python bench/sink_bits.py bench/results/search-2.5bpv.yaml   # -> bench/results/sink_bits.md (~1 min)
    git show 7ae02ac:bench/results/search-2.5bpv.yaml > before.yaml   # the plan the default was chosen on
    python bench/sink_bits.py before.yaml --origin "git show 7ae02ac:bench/results/search-2.5bpv.yaml"

The plan's bits, formats, rotations and copies are kept; only the sink changes: as written (the
model's dtype, fp32 on CPU: ``sink_bits`` 16), as 8-bit per-token codes in the slots' rotated frame
(``sink_bits`` 8), or none (``sink_length`` 0). Scored by the **validation** scorer of ``kvplan
search`` (16 samples, 512-token history, the deployed route), so the table can choose defaults; it
never looks at the test split. bpv at the plan's 512-token reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from _stamp import stamp  # noqa: E402
from kvplan import Plan  # noqa: E402
from kvplan.plans import atomic_write_text  # noqa: E402
from kvplan.search.scorers import task_scorers  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--origin", default=None, help="where the plan file came from (written in the table's head)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "sink_bits.md"))
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("KVPLAN_THREADS", "1")))
    t0 = time.time()
    plan = Plan.from_yaml(args.plan)
    q = plan.quantizer
    sink = max(q.sink_length, 1)
    val = task_scorers(n_calibration=1, n_validation=16, n_test=0, progress=False).validation
    lines = ["# Attention-sink tokens as written vs 8-bit codes: validation KL", "",
             f"Command: {stamp()} (method in the script's "
             f"docstring).{f' The plan: `{args.origin}`.' if args.origin else ''} Its own sink: {q.sink_length} "
             f"token(s), sink_bits {q.sink_bits}.", "",
             "| sink_length | held as | honest bpv at 512 | validation KL [95% CI] |", "|---:|---|---:|---|"]
    for length, bits, held in ((sink, 16, f"as written (fp{plan.reference.full_precision_bits})"),
                               (sink, 8, "8-bit per-token codes, rotated frame"), (0, 16, "-")):
        p = plan.replace(quantizer=dataclasses.replace(q, sink_length=length, sink_bits=bits))
        m = val(p)
        lines.append(f"| {length} | {held} | {p.bpv().total:.4f} | {m['kl']:.5f} [{m['kl_ci95_lo']:.4f}, "
                     f"{m['kl_ci95_hi']:.4f}] |")
        print(lines[-1], flush=True)
    lines += ["", f"Wall time {time.time() - t0:.0f} s."]
    atomic_write_text(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
