"""Recent copies (``quantizer.recent_length``) on a fixed plan: validation KL and honest bpv.

    python bench/recent_tokens.py bench/results/search-2.5bpv.yaml   # -> bench/results/recent_tokens.md (~3 min)

The plan's bits, formats and rotations are kept; only ``quantizer.recent_length`` (the newest
committed tokens that keep their residual form, read instead of their slot codes) and
``quantizer.residual_bits`` (how those copies are held) change. Scored by the **validation**
scorer of ``kvplan search`` (16 samples, 512-token history, the deployed route): this table chooses
the search's default choices (``DEFAULT_RECENT_LENGTHS``, ``DEFAULT_RESIDUAL_BITS``), so it never
looks at the test split. The bpv column is at the plan's 512-token reference, where every history
token is committed (group 128, residual 0), so the copies are all that changes.

Also a probe that is not a kvplan feature, to say where the KL comes from: the plan with every key
(or every value) slot at full precision.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kvplan import Plan  # noqa: E402
from kvplan.plans import atomic_write_text  # noqa: E402
from kvplan.search.scorers import task_scorers  # noqa: E402

ROWS = [(0, 16), (4, 8), (8, 8), (16, 8), (32, 8), (16, 4), (16, 16)]  # (recent_length, residual_bits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "recent_tokens.md"))
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("KVPLAN_THREADS", "1")))
    t0 = time.time()
    plan = Plan.from_yaml(args.plan)
    val = task_scorers(n_calibration=1, n_validation=16, n_test=0, progress=False).validation
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = ["# Recent copies on a fixed plan: validation KL", "",
             f"Command: `python bench/recent_tokens.py {args.plan}` at commit {commit} (method in the script's "
             "docstring).", "",
             "| recent_length | copies held as | honest bpv at 512 | residual bpv | validation KL [95% CI] |",
             "|---:|---|---:|---:|---|"]

    def row(label, held, p):
        m, b = val(p), p.bpv()
        lines.append(f"| {label} | {held} | {b.total:.4f} | {b.residual:.4f} | "
                     f"{m['kl']:.4f} [{m['kl_ci95_lo']:.4f}, {m['kl_ci95_hi']:.4f}] |")
        print(lines[-1], flush=True)

    for recent, bits in ROWS:
        q = dataclasses.replace(plan.quantizer, recent_length=recent, residual_bits=bits)
        held = "-" if recent == 0 else ("as written (fp32)" if bits == 16 else f"{bits}-bit per-token codes")
        row(str(recent), held, plan.replace(quantizer=q))
    table = plan.code_table()
    for kind, name in ((0, "keys"), (1, "values")):
        t = table.copy()
        t[:, :, kind] = 16
        row(f"0, every {name[:-1]} slot at full precision (probe)", "-", plan.with_table(t))
    lines += ["", f"Wall time {time.time() - t0:.0f} s."]
    atomic_write_text(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
