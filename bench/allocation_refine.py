"""How far does bit allocation go with many more real evaluations? A local search from the searched plan.

    python bench/allocation_refine.py bench/results/search-2.5bpv.yaml   # -> bench/results/allocation_refine.md

Issue 14 asks the searched plan for at most half the KL of the best codec-only baseline. The baselines
share every format (``bench/codec_baselines.py``), so what is left to the search is allocation: which
slot gets which bits, which heads stream. ``bench/allocation_ceiling.py`` bounds that under the search's
additive damage model; this probe asks the real model instead. Starting from the searched plan, with its
quantizer and its streamed heads fixed (the slot space of ``kvplan search`` around the plan), it climbs
on the **calibration** split (the split a search may choose by):

* each round proposes every budget-neutral one-step move: one slot raised one level, the search's own
  repair lowering other slots (least predicted damage per bpv first) until the plan fits again; and as
  many moves that raise one slot and lower one *random* other slot (exploration the damage model would
  not propose), kept when they fit;
* the ``--per-round`` moves of least predicted damage among the first kind, and the random ones, are
  evaluated for real (duplicates skipped); the best is taken when it lowers the calibration KL,
  otherwise the round's evaluations are spent and the next round proposes from the same plan without them;
* it stops after ``--evals`` real evaluations.

The start and the end plan are then scored on the **validation** split (does the calibration gain
hold?) and the **test** split (reported, nothing chosen on it). The search itself spent its 120 trials
finding the start; this spends ``--evals`` more on its neighbourhood.
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
from bench.allocation_ceiling import plan_space, search_profile  # noqa: E402
from kvplan import Plan  # noqa: E402
from kvplan.plans import atomic_write_text  # noqa: E402
from kvplan.search import BpvModel  # noqa: E402
from kvplan.search.budget import EPS, group_damage, repair  # noqa: E402
from kvplan.search.scorers import DEFAULT_SAMPLES, task_scorers  # noqa: E402
from kvplan.search.sensitivity import correction_factor, slot_sensitivity  # noqa: E402


def neighbours(model: BpvModel, levels: np.ndarray, q, budget: float, damage: np.ndarray,
               rng: np.random.Generator, n_random: int) -> tuple[list, list]:
    """Budget-neutral one-step moves from ``levels``, each ``(how, levels)``: every one-level raise repaired by
    the damage model, and up to ``n_random`` raise-one / lower-a-random-other swaps that fit the budget."""
    tops = np.array([g.n_levels - 1 for g in model.space.groups])
    raisable, lowerable = np.nonzero(levels < tops)[0], np.nonzero(levels > 0)[0]
    raises, swaps = [], []
    for gi in raisable:
        lv = levels.copy()
        lv[gi] += 1
        fixed, _, _ = repair(model, lv, q, budget, damage)
        if fixed[gi] > levels[gi]:  # the repair did not undo the raise
            raises.append((f"raise {gi}, repair", fixed))
    for _ in range(n_random * 20):
        if len(swaps) >= n_random or not len(raisable) or not len(lowerable):
            break
        a, b = int(rng.choice(raisable)), int(rng.choice(lowerable))
        if a == b:
            continue
        lv = levels.copy()
        lv[a] += 1
        lv[b] -= 1
        if model.bpv(lv, q) <= budget + EPS:
            swaps.append((f"swap +{a} -{b}", lv))
    return raises, swaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--model", default="smollm2-135m", help="the model the plan was searched on")
    ap.add_argument("--evals", type=int, default=120, help="real calibration evaluations to spend (default 120)")
    ap.add_argument("--per-round", type=int, default=6, help="moves of least predicted damage evaluated per round")
    ap.add_argument("--random", type=int, default=2, help="random swaps evaluated per round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "allocation_refine.md"))
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("KVPLAN_THREADS", "1")))
    t0 = time.time()
    plan = Plan.from_yaml(args.plan)
    profile = search_profile(args.plan)
    streamed = plan.streamed_heads()
    extra = dict(streamed_heads=streamed, stream_window=plan.quantizer.stream_window) if streamed else {}
    space = plan_space(plan, **extra)
    model = BpvModel(space, plan.reference)
    damage = group_damage(space, slot_sensitivity(space, profile), correction_factor(profile))
    q = plan.quantizer
    budget = plan.target_bpv or plan.bpv().total
    levels = space.levels_of_table(plan.code_table())
    if levels is None:
        raise SystemExit(f"{args.plan}: its bit table is not in the slot space around it")
    rng = np.random.default_rng(args.seed)
    scorers = task_scorers(args.model, n_test=16, progress=False)

    def plan_of(lv: np.ndarray) -> Plan:
        return space.plan_of_table(space.table_of_levels(lv), q, plan.reference).replace(name=plan.name)

    seen: dict[bytes, float] = {}
    current = levels.copy()
    current_kl = scorers.calibration(plan_of(current))["kl"]
    seen[current.tobytes()] = current_kl
    start_kl, n_evals, steps, rounds = current_kl, 0, [], 0
    print(f"start: calibration KL {current_kl:.5f}", flush=True)
    while n_evals < args.evals:
        rounds += 1
        raises, swaps = ([m for m in moves if m[1].tobytes() not in seen]
                         for moves in neighbours(model, current, q, budget, damage, rng, args.random))
        if not raises and not swaps:
            break
        ranked = sorted(raises, key=lambda m: float(damage[np.arange(len(m[1])), m[1]].sum()))
        chosen = ranked[: args.per_round] + swaps
        best = None
        for how, lv in chosen[: args.evals - n_evals]:
            kl = scorers.calibration(plan_of(lv))["kl"]
            seen[lv.tobytes()] = kl
            n_evals += 1
            if best is None or kl < best[0]:
                best = (kl, how, lv)
        if best is not None and best[0] < current_kl:
            steps.append((n_evals, best[1], current_kl, best[0]))
            current, current_kl = best[2], best[0]
            print(f"round {rounds} ({n_evals} evals): {best[1]} -> calibration KL {current_kl:.5f}", flush=True)
    start_plan, end_plan = plan_of(levels), plan_of(current)
    scored = {name: (scorers.validation(p), scorers.test(p)) for name, p in (("start", start_plan), ("end", end_plan))}
    lines = [f"# Allocation with more real evaluations: a local search from {plan.name}", "",
             f"Command: {stamp()} (method in "
             f"the script's docstring). Calibration {DEFAULT_SAMPLES['calibration']} samples, validation and test "
             f"16; {n_evals} calibration evaluations in {rounds} rounds, {len(steps)} moves taken.", "",
             "| plan | honest bpv | calibration KL | validation KL [95% CI] | test KL [95% CI] |",
             "|---|---:|---:|---|---|"]
    for name, p, cal in (("start (the searched plan)", start_plan, start_kl), ("end of the local search", end_plan,
                                                                               current_kl)):
        val, test = scored[name.split()[0]]
        lines.append(f"| {name} | {p.bpv().total:.4f} | {cal:.5f} | {val['kl']:.5f} [{val['kl_ci95_lo']:.4f}, "
                     f"{val['kl_ci95_hi']:.4f}] | {test['kl']:.5f} [{test['kl_ci95_lo']:.4f}, "
                     f"{test['kl_ci95_hi']:.4f}] |")
    lines += ["", "Moves taken (evaluations so far, move, calibration KL before -> after):", ""]
    lines += [f"- {n}: {how}: {a:.5f} -> {b:.5f}" for n, how, a, b in steps] or ["- none"]
    lines += ["", f"Wall time {time.time() - t0:.0f} s."]
    atomic_write_text(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
