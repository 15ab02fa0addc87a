"""Held-out KL of a searched plan next to uniform KIVI-style plans near its budget.

Usage (repo root, venv active; after ``kvplan search --budget 2.5bpv --out plan.yaml``)::

    python bench/search_vs_uniform.py plan.yaml --out bench/results/search_vs_uniform.md

Every plan is scored by the same held-out scorer the search uses for its final
measurement (built-in task, held-out split, same history length), through the same
runtime cache. Uniform plans: keys per channel, values per token, bits {2, 3, 4} (and
k4v2), group {32, 64, 128}, residual {0, 32, 128}, at the searched plan's reference layout.
"""

from __future__ import annotations

import argparse
import itertools
import time

from _stamp import stamp
from kvplan import Plan, uniform_plan
from kvplan.plans import atomic_write_text
from kvplan.search.scorers import harness_scorers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--history-tokens", type=int, default=512)
    ap.add_argument("--max-bpv-over", type=float, default=1.0, help="uniform plans up to budget + this")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    t0 = time.perf_counter()
    searched = Plan.from_yaml(args.plan)
    _, held = harness_scorers(n_calibration=1, n_heldout=args.samples, history_tokens=args.history_tokens,
                              progress=False)
    budget = searched.target_bpv or searched.bpv().total
    rows = [("searched", searched.bpv().total, held(searched))]
    for (kb, vb), g, r in itertools.product([(2, 2), (3, 3), (4, 2), (4, 4)], (32, 64, 128), (0, 32, 128)):
        plan = uniform_plan(searched.geometry, kb, vb, group_size=g, residual_length=r,
                            modalities=searched.modalities, reference=searched.reference,
                            name=f"K{kb}V{vb}-g{g}-r{r}")
        bpv = plan.bpv().total
        if bpv <= budget + args.max_bpv_over:
            rows.append((plan.name, bpv, held(plan)))
    rows.sort(key=lambda x: x[1])
    uniform = [(name, b, m["kl"]) for name, b, m in rows if name != "searched"]
    fitting = [u for u in uniform if u[1] <= budget + 1e-9]
    above = [u for u in uniform if u[1] > budget + 1e-9]
    lines = [f"# Searched plan vs uniform plans (held-out, {args.samples} samples, {args.history_tokens}-token history)",
             "", f"Command: {stamp()}", "",
             "| plan | honest bpv | held-out KL [95% CI] | top-1 |", "|---|---|---|---|"]
    for name, bpv, m in rows:
        lines.append(f"| {name} | {bpv:.3f} | {m['kl']:.4f} [{m.get('kl_ci95_lo', float('nan')):.4f}, "
                     f"{m.get('kl_ci95_hi', float('nan')):.4f}] | {m.get('top1', float('nan')):.3f} |")
    kl = rows[[r[0] for r in rows].index("searched")][2]["kl"]
    lines += ["", f"Searched plan: KL {kl:.4f} at {searched.bpv().total:.3f} bpv."]
    if fitting:
        name, b, best = min(fitting, key=lambda u: u[2])
        lines.append(f"Best uniform plan within the {budget:g} bpv budget: {name} ({b:.3f} bpv) KL {best:.4f}; "
                     f"ratio searched/uniform {kl / best:.3f} (the quality bar asks for <= 0.5).")
    if above:
        name, b, k = min(above, key=lambda u: u[1])
        lines.append(f"Cheapest uniform plan above the budget: {name} ({b:.3f} bpv) KL {k:.4f}; ratio {kl / k:.3f}.")
        beaten = [u for u in above if u[2] >= kl]
        if beaten:
            name, b, k = max(beaten, key=lambda u: u[1])
            lines.append(f"Most expensive uniform plan the searched plan still beats: {name} ({b:.3f} bpv, KL {k:.4f}).")
    lines += ["", f"Wall time {time.perf_counter() - t0:.0f} s."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        atomic_write_text(args.out, text)


if __name__ == "__main__":
    main()
