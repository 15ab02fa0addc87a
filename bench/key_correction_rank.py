"""Choose the default key-correction rank on the VALIDATION split (never on test).

Runs the README's default search (``kvplan search --budget 2.5bpv``: built-in task, 12
calibration / 16 validation / 16 test samples, 512-token history, 60 trials) once per rank,
on one set of scorers (the full-precision prefills are shared), and writes one plan per
rank plus a table. The rank with the lowest validation KL is the one to make
``kvplan.search.DEFAULT_KEY_CORRECTION_RANK``; test KL is printed beside it for the report
only. With the winning rank equal to the default, that rank's plan is byte-identical to what
the README's main command writes (same code path, same seed).

Usage (repo root, venv active)::

    python bench/key_correction_rank.py --ranks 0 2 4 --out-dir bench/results/key_correction_rank
"""

from __future__ import annotations

import argparse
import os
import time

from _stamp import stamp
from kvplan.plans import atomic_write_text
from kvplan.search import search
from kvplan.search.scorers import task_scorers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[0, 2, 4])
    ap.add_argument("--budget", default="2.5bpv")
    ap.add_argument("--out-dir", default="bench/results/key_correction_rank")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a busy 2-core box)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    os.makedirs(args.out_dir, exist_ok=True)
    run = stamp()  # the commit the run starts from
    t0 = time.perf_counter()
    scorers = task_scorers(progress=False)  # the CLI's defaults
    rows = []
    for r in args.ranks:
        t = time.perf_counter()
        res = search(budget=args.budget, scorer=scorers.calibration, validation_scorer=scorers.validation,
                     test_scorer=scorers.test, key_correction_rank=r, progress=False,
                     out=os.path.join(args.out_dir, f"rank{r}.yaml"))
        m = res.plan.metrics
        rows.append((r, m["calibration"]["kl"], m["validation"]["kl"], m["test"]["kl"],
                     m["test"].get("kl_ci95_lo"), m["test"].get("kl_ci95_hi"), res.plan.bpv().total,
                     res.plan.bpv().correction, time.perf_counter() - t))
        print(rows[-1], flush=True)
    best = min(rows, key=lambda row: row[2])
    lines = [
        "# Key-correction rank, chosen on the validation split",
        "",
        f"Command: {run}, "
        f"{time.perf_counter() - t0:.0f} s in all. Default search per rank (`kvplan search --budget {args.budget}` "
        "settings), same scorers. **Chosen by validation KL; test KL only reported.**",
        "",
        "| rank | calibration KL | validation KL | test KL [95% CI] | honest bpv (correction part) | search s |",
        "|---:|---:|---:|---|---|---:|",
    ]
    for r, cal, val, test, lo, hi, bpv, corr, sec in rows:
        mark = "**" if r == best[0] else ""
        lines.append(f"| {r} | {cal:.4f} | {mark}{val:.4f}{mark} | {test:.4f} [{lo:.4f}, {hi:.4f}] | "
                     f"{bpv:.4f} ({corr:.3f}) | {sec:.0f} |")
    lines += ["", f"Lowest validation KL: rank {best[0]}."]
    atomic_write_text(os.path.join(args.out_dir, "README.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
