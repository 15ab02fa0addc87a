"""How far can bit allocation alone go below the codec-only baselines? The search's own damage model.

    python bench/allocation_ceiling.py bench/results/search-2.5bpv.yaml   # -> bench/results/allocation_ceiling.md

Issue 14 asks the searched plan for at most half the KL of the best codec-only baseline (uniform and
HeadGuard-style plans with kvplan's formats, ``bench/codec_baselines.py``). Every plan here has the
searched plan's quantizer (formats, rotations, group, sink, recent copies, error feedback); they differ
only in the bits of the 2 x L x H_kv slots, so the ratio measures what allocation buys.

The search's prior of a plan's damage (``kvplan.search.budget.group_damage``) is the sum over slots of
the slot's calibration-profile damage at 2 bits (``<plan>.search.json``: one unit at 2 bits, the rest
full precision) times the squared step-size ratio ``(3 / (2^b - 1))^2`` (x the profile's correction
factor for corrected keys). Under that additive model the **best** allocation at the plan's budget is
the multiple-choice knapsack over the slots' levels; the greedy by damage removed per bpv
(``knapsack_seed``, the search's own seed) reaches it up to the last item.

When the plan streams KV heads, a streamed head's predicted damage is its streaming profile entry
(``Lxx.stream.hy``) times the profile's streaming calibration (``stream.scale``, as the search uses it),
and the optimum is the search's own choice of streamed heads and levels at the budget
(``kvplan.search.streaming.streaming_optimum``: the knapsack over KV heads with streaming as one more
option); the baselines include the rank-based streaming ones of ``bench/codec_baselines.py``. Rows:

* predicted damage of the searched plan, the baselines and the model's optimum, each relative to the
  best baseline's; the optimum's ratio is the model's ceiling for allocation at this budget;
* the same optimum with a hypothetical **1-bit** level (not a kvplan format; its cost is the 2-bit cost
  minus one bit per value, its damage ``k`` times the 2-bit damage: ``k = 9`` by the prior's formula,
  ``k = 3.1`` for Lloyd-Max codes of a Gaussian, 0.363 / 0.1175), to say what that format could add;
* measured **validation** and **test** KL (the scorers of ``kvplan search``, 16 samples each, the
  deployed route) of the searched plan, the baselines and the model's optimum. The best baseline, the
  one every ratio divides by, is chosen on validation (predicted: the least predicted damage); test is
  reported only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

try:  # bench/ is sys.path[0] when run as python bench/x.py, not when imported as bench.x from elsewhere
    from _stamp import stamp  # noqa: E402
except ModuleNotFoundError:
    from bench._stamp import stamp  # noqa: E402
from bench.codec_baselines import baseline_plans  # noqa: E402
from kvplan import Plan  # noqa: E402
from kvplan.plans import STREAMED, atomic_write_text  # noqa: E402
from kvplan.search import BpvModel, SearchSpace  # noqa: E402
from kvplan.search.budget import greedy_knapsack, group_damage, knapsack_seed, repair  # noqa: E402
from kvplan.search.scorers import task_scorers  # noqa: E402
from kvplan.search.sensitivity import correction_factor, slot_sensitivity  # noqa: E402
from kvplan.search.streaming import STREAM_SCALE_KEY, stream_key, streaming_optimum  # noqa: E402

ONE_BIT_DAMAGE = {"prior's formula, k = 9": 9.0, "Gaussian Lloyd-Max, k = 3.1": 0.3634 / 0.1175}


def plan_space(plan: Plan, **choices) -> SearchSpace:
    """The slot search space of the search around ``plan``: its constants (key basis, rotations,
    formats, error-feedback metric) and every quantizer-level choice fixed to ``plan``'s, unless
    ``choices`` (``SearchSpace`` keywords, e.g. ``recent_lengths=(0, 8)``) say otherwise."""
    q = plan.quantizer
    fixed = dict(key_basis=plan.key_basis, rotation=q.rotation, rope_inv_freq=plan.rope_inv_freq,
                 key_scaling=q.key_scaling, value_scaling=q.value_scaling,
                 codebooks=tuple(sorted({k for k, _, _ in q.codebooks})), residual_bits=q.residual_bits,
                 sink_bits=q.sink_bits, recent_lengths=(q.recent_length,), sink_lengths=(q.sink_length,),
                 group_sizes=(q.group_size,), residual_lengths=(q.residual_length,),
                 feedback_metric=plan.feedback_metric)
    return SearchSpace(plan.geometry, plan.modalities, "slot", **{**fixed, **choices})


def streamed_damage(profile: dict, heads) -> float:
    """The streaming profile's damage of ``heads`` (each streamed alone, rest at full precision), summed."""
    return sum(max(profile[stream_key(l, h)], 0.0) for l, h in heads)


def search_profile(plan_path: str) -> dict:
    """The calibration sensitivity profile the search wrote beside ``plan_path`` (``<plan>.search.json``)."""
    with open(os.path.splitext(plan_path)[0] + ".search.json") as f:
        return json.load(f)["profile"]


def predicted_damage(space: SearchSpace, damage: np.ndarray, plan: Plan, profile: dict | None = None) -> float:
    """The search's additive damage model of ``plan``: its quantized slots' ``damage`` (``group_damage`` of
    ``space``, a space without streamed heads) at their levels, plus each streamed head's streaming damage in
    ``profile`` times the profile's streaming calibration; exits when the plan's bit table is not in ``space``."""
    codes = plan.code_table()  # [L, H_kv, 2, M]
    streamed = codes == STREAMED
    levels = space.levels_of_table(np.where(streamed, space.bits[0], codes))  # streamed slots: any level, dropped
    if levels is None:
        raise SystemExit(f"{plan.name}: its bit table is not in the slot search space")
    quantized = ~streamed.reshape(-1)[[g.slots[0] for g in space.groups]]  # slot granularity: one slot a group
    out = float(damage[np.arange(len(levels)), levels][quantized].sum())
    heads = plan.streamed_heads()
    if heads:
        if profile is None:
            raise SystemExit(f"{plan.name}: streams KV heads; their damage needs the profile")
        scale = float(profile.get(STREAM_SCALE_KEY, 1.0))
        out += scale * streamed_damage(profile, heads)
    return out


def lowered_to(plan: Plan, profile: dict, budget: float) -> Plan:
    """``plan`` with its slot bits lowered by the search's own repair (least predicted damage per bpv
    first, the damage model of ``profile``) until it fits ``budget``; its quantizer as it is."""
    space = plan_space(plan)
    model = BpvModel(space, plan.reference)
    damage = group_damage(space, slot_sensitivity(space, profile), correction_factor(profile))
    levels, q, _ = repair(model, space.levels_of_table(plan.code_table()), plan.quantizer, budget, damage)
    return space.plan_of_table(space.table_of_levels(levels), q, plan.reference)


def one_bit_optimum(costs: np.ndarray, damage: np.ndarray, bit_cost: np.ndarray, k: float, slack: float) -> float:
    """Damage of the search's greedy knapsack when every slot may also take a 1-bit level costing
    ``bit_cost`` less than its cheapest level and ``k`` times its damage there; ``costs`` / ``damage``
    are ``[n_slots, n_levels]`` (bpv contributions, inf padding), level 0 the 2-bit one; ``slack`` is
    the budget above the all-1-bit plan."""
    cost = np.concatenate([costs[:, :1] - bit_cost[:, None], costs], axis=1)
    dmg = np.concatenate([damage[:, :1] * k, damage], axis=1)
    levels = greedy_knapsack(cost, dmg, slack)
    return float(dmg[np.arange(len(levels)), levels].sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--model", default="smollm2-135m", help="the model the plan was searched on")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "allocation_ceiling.md"))
    ap.add_argument("--samples", type=int, default=16, help="validation and test samples each (default 16, the "
                    "recorded table's; fewer for a quick check)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("KVPLAN_THREADS", "1")))
    t0 = time.time()
    searched = Plan.from_yaml(args.plan)
    profile = search_profile(args.plan)
    budget = searched.target_bpv or searched.bpv().total
    q = searched.quantizer
    streams = bool(searched.streamed_heads())
    space = plan_space(searched)  # no streamed heads: every slot has its levels
    (space_q,) = space.quantizers()  # the plan's quantizer, but for streaming's window (not in this space)
    model = BpvModel(space, searched.reference)
    damage = group_damage(space, slot_sensitivity(space, profile), correction_factor(profile))

    def predicted(plan: Plan) -> float:
        return predicted_damage(space, damage, plan, profile)

    if streams:  # the search's own choice: streamed heads and levels together
        opt = streaming_optimum(space, searched.reference, profile, q.stream_window, budget,
                                float(profile.get(STREAM_SCALE_KEY, 1.0)))
        optimum = searched.with_table(opt.table)
        optimum_label = "the damage model's optimum (knapsack over the heads' levels and streaming)"
    else:
        optimum = searched.with_table(space.table_of_levels(knapsack_seed(model, space_q, budget, damage)))
        optimum_label = "the damage model's optimum (knapsack over the slots' levels)"
    optimum = optimum.replace(name="model-optimum", metrics={})
    baselines = baseline_plans(searched, profile, budget)
    rows = [("searched (kvplan search)", searched), *baselines, (optimum_label, optimum)]
    best_pred = min(predicted(p) for _, p in baselines)

    terms = model.terms(space_q)
    n_values = model.n_values(space_q)
    # one bit per value of a slot, in bpv of the whole cache: its 2-bit -> 3-bit step (same scales and
    # zero-points, no correction); every slot's cheapest level is its uncorrected 2-bit one
    def level_of(g, code: int) -> int:
        return int(np.nonzero((g.level_bits == code).all(axis=1))[0][0])

    one_bit = {}
    if not streams:  # (with streaming the knapsack is over heads; bench/one_bit_probe.py measured the level)
        assert all(level_of(g, 2) == 0 for g in space.groups), "every slot's cheapest level must be 2 bits"
        bit_cost = np.array([terms.group_cost[gi, level_of(g, 3)] - terms.group_cost[gi, 0]
                             for gi, g in enumerate(space.groups)])
        slack = budget - terms.const - float((terms.group_cost[:, 0] - bit_cost).sum())
        one_bit = {name: one_bit_optimum(terms.group_cost, damage, bit_cost, k, slack)
                   for name, k in ONE_BIT_DAMAGE.items()}

    scorers = task_scorers(args.model, n_calibration=1, n_validation=args.samples, n_test=args.samples,
                           progress=False)
    lines = [f"# Bit allocation's ceiling at {budget:g} bpv: the search's damage model", "",
             f"Command: {stamp()} (method "
             f"in the script's docstring; {n_values} values at the plan's reference).", "",
             "| plan | honest bpv | predicted damage / best baseline's | validation KL | validation KL / best "
             "baseline's | test KL [95% CI] | test KL / best baseline's |",
             "|---|---:|---:|---:|---:|---|---:|"]
    val, test = {}, {}  # label -> metrics
    for label, plan in rows:
        val[label], test[label] = scorers.validation(plan), scorers.test(plan)
        print(label, val[label]["kl"], test[label]["kl"], flush=True)
    best = min((label for label, _ in baselines), key=lambda label: val[label]["kl"])  # chosen on validation
    for label, plan in rows:
        v, m = val[label], test[label]
        lines.append(f"| {label} | {plan.bpv().total:.4f} | {predicted(plan) / best_pred:.2f} | {v['kl']:.4f} | "
                     f"{v['kl'] / val[best]['kl']:.2f} | {m['kl']:.4f} [{m['kl_ci95_lo']:.4f}, "
                     f"{m['kl_ci95_hi']:.4f}] | {m['kl'] / test[best]['kl']:.2f} |")
    lines += ["", f"Best baseline on validation: {best}."]
    if one_bit:
        lines += ["", "With a hypothetical 1-bit level (damage model only, not measured):", "",
                  "| 1-bit damage | predicted optimum / best baseline's |", "|---|---:|"]
        lines += [f"| {name} | {d / best_pred:.2f} |" for name, d in one_bit.items()]
    lines += ["", f"Wall time {time.time() - t0:.0f} s."]
    atomic_write_text(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
