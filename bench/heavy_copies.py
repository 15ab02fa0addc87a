"""Heavy-hitter copies (``quantizer.heavy_length``) on the recorded plan and the best codec-only baseline,
paid with slot bits: the built feature, bytes counted, on the deployed route.

    python bench/heavy_copies.py bench/results/no-stream/plan.yaml
        # -> bench/results/heavy_copies.md (~10 min; recorded as bench/results/search-2.5bpv.yaml at c0b9dd1,
        #    the same file as no-stream/plan.yaml: the default plan before the search streamed heads)
    python bench/heavy_copies.py bench/results/gemma3/plan.yaml --model gemma3-270m \
        --out bench/results/gemma3/heavy_copies.md                        # the second real model
    python bench/heavy_copies.py bench/results/no-stream/plan.yaml --write-plan 2 /tmp/heavy2.yaml
        # only write the plan with 2 copies per KV head, slots lowered to pay for them (no scoring)

For each number of copies ``n`` per KV head, the searched plan's slots are lowered by the search's own
repair (least predicted damage per bpv first, the calibration profile's damage model) until the plan
**with** ``heavy_length = n`` fits the budget (``plan.bpv()`` counts the copies, their positions and
scores); ``n`` is chosen on the **validation** split. The test split then reports the searched plan
and the codec-only baselines of ``bench/codec_baselines.py``, without copies at 2.5 bpv and with the
chosen copies (the baselines rebuilt at the budget the copies leave). Every plan is scored by the search's
scorers: ``kvplan.make_cache`` writes the history and the copies are those kvplan's attention
function keeps at a deployed prompt (the prefill's last 32 queries; ``tests/runtime/test_heavy_copies.py``
checks that both keep the same).

A plan that streams KV heads (e.g. today's recorded ``bench/results/search-2.5bpv.yaml``) is refused: kvplan
refuses heavy-hitter copies beside streamed heads, so the copies cannot be added to it.
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
from bench.allocation_ceiling import lowered_to, search_profile  # noqa: E402
from bench.codec_baselines import baseline_plans  # noqa: E402
from kvplan import Plan  # noqa: E402
from kvplan.plans import atomic_write_text  # noqa: E402
from kvplan.search.scorers import task_scorers  # noqa: E402

COUNTS = (2, 4, 6, 8)


def with_copies(plan: Plan, n: int) -> Plan:
    return plan.replace(quantizer=dataclasses.replace(plan.quantizer, heavy_length=n))


def paid(searched: Plan, profile: dict, n: int) -> tuple[Plan, list[tuple[str, Plan]], float]:
    """``(searched plan lowered to pay for n copies, the codec-only baselines likewise, slot budget)``,
    every plan with ``heavy_length = n`` and within ``searched``'s budget."""
    budget = searched.target_bpv
    cost = with_copies(searched, n).bpv().total - searched.bpv().total  # the copies' bytes at the reference
    lowered = with_copies(lowered_to(searched, profile, budget - cost), n)
    baselines = [(label, with_copies(p, n)) for label, p in baseline_plans(searched, profile, budget - cost)]
    for _, p in [("searched", lowered), *baselines]:
        assert p.bpv().total <= budget + 1e-9, (p.name, p.bpv().total)
    return lowered, baselines, budget - cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--model", default="smollm2-135m", help="the model the plan was searched on (a kvplan.load_model "
                    "name, .gguf file or directory; default: the embedded default model)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "heavy_copies.md"))
    ap.add_argument("--write-plan", nargs=2, metavar=("N", "OUT"),
                    help="write the plan with N copies per KV head (slots lowered to pay) to OUT and stop")
    ap.add_argument("--samples", type=int, default=16, help="validation and test samples each (default 16, the "
                    "recorded table's; fewer for a quick check)")
    args = ap.parse_args()
    if Plan.from_yaml(args.plan).streamed_heads():
        sys.exit(f"{args.plan} streams KV heads, which heavy-hitter copies cannot go with; the recorded table was "
                 "measured on a plan that streams none: bench/results/no-stream/plan.yaml")
    if args.write_plan:
        n, out = int(args.write_plan[0]), args.write_plan[1]
        lowered, _, _ = paid(Plan.from_yaml(args.plan), search_profile(args.plan), n)
        lowered.to_yaml(out)
        print(f"{out}: heavy_length {n}, {lowered.bpv().total:.4f} honest bpv")
        return
    torch.set_num_threads(int(os.environ.get("KVPLAN_THREADS", "1")))
    t0 = time.time()
    searched = Plan.from_yaml(args.plan)
    profile = search_profile(args.plan)
    scorers = task_scorers(args.model, n_calibration=1, n_validation=args.samples, n_test=args.samples,
                           progress=False)
    lines = ["# Heavy-hitter copies paid with slot bits: the searched plan and the best codec-only baseline", "",
             f"Command: {stamp()} (method in the script's "
             "docstring).", "", "Choosing the number of copies per KV head (validation split):", "",
             "| heavy_length | slot bits lowered to | honest bpv | validation KL [95% CI] |", "|---:|---:|---:|---|"]

    def row(m):
        return f"{m['kl']:.4f} [{m['kl_ci95_lo']:.4f}, {m['kl_ci95_hi']:.4f}]"

    base = scorers.validation(searched)
    lines.append(f"| 0 (the recorded plan) | - | {searched.bpv().total:.4f} | {row(base)} |")
    print(lines[-1], flush=True)
    chosen, best = 0, base["kl"]
    for n in COUNTS:
        lowered, _, slot_budget = paid(searched, profile, n)
        m = scorers.validation(lowered)
        lines.append(f"| {n} | {slot_budget:.4f} | {lowered.bpv().total:.4f} | {row(m)} |")
        print(lines[-1], flush=True)
        if m["kl"] < best:
            chosen, best = n, m["kl"]
    lines += ["", f"Chosen on validation: heavy_length {chosen}.", "", "Reported on the test split:", "",
              "| plan | honest bpv | test KL [95% CI] |", "|---|---:|---|"]
    groups = [("", searched, baseline_plans(searched, profile, searched.target_bpv))]
    if chosen:
        lowered, baselines, _ = paid(searched, profile, chosen)
        groups.append((f", {chosen} heavy-hitter copies", lowered, baselines))
    ratios = []
    for suffix, plan, baselines in groups:
        kls = []
        for label, p in [("searched" + (" (the recorded plan)" if not suffix else ", slots lowered"), plan),
                         *baselines]:
            m = scorers.test(p)
            kls.append(m["kl"])
            lines.append(f"| {label}{suffix} | {p.bpv().total:.4f} | {row(m)} |")
            print(lines[-1], flush=True)
        ratios.append((kls[0], min(kls[1:])))
    lines += [""] + [f"Searched / best codec-only baseline{' with copies' if i else ''}: {s / b:.2f}x "
                     f"({s:.4f} / {b:.4f})." for i, (s, b) in enumerate(ratios)]
    lines += ["", f"Wall time {time.time() - t0:.0f} s."]
    atomic_write_text(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
