"""Quality bar of kvplan search on the embedded SmolLM2-135M (2-core CPU).

Compares, at one honest-bpv budget, on the held-out split of the built-in task:
  - the searched plan (granularity slot, profile + knapsack seed + RF surrogate),
  - uniform KIVI int2 at every group size / residual that fits,
  - a KVTuner-style layer-wise search (granularity kvtuner, plain TPE, no profile, no seeds) with the
    same number of real evaluations as the searched plan (its profile evaluations included),
  - HeadGuard-style: 2-bit everywhere, the KV heads of the most key-sensitive layers (from the same
    profile) protected with 4-bit keys, as many as the budget allows;
and (``--curve``) the best-KL-vs-real-evaluations curve with and without the surrogate over 3 seeds.

    python bench/search_quality.py --budget 2.5 --n-trials 60 --n-cal 4 --n-held 8 --history 256 \
        --out bench/results/search_quality.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvplan.plans import headguard_plan, uniform_plan  # noqa: E402
from kvplan.search import BpvModel, SearchSpace, search, slot_sensitivity  # noqa: E402
from kvplan.search.scorers import harness_scorers  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=2.5)
    ap.add_argument("--n-trials", type=int, default=60)
    ap.add_argument("--n-cal", type=int, default=4)
    ap.add_argument("--n-held", type=int, default=8)
    ap.add_argument("--history", type=int, default=256)
    ap.add_argument("--eval-tokens", type=int, default=16)
    ap.add_argument("--curve", action="store_true")
    ap.add_argument("--curve-trials", type=int, default=40)
    ap.add_argument("--out", default="bench/results/search_quality.json")
    a = ap.parse_args()
    t0 = time.time()
    cal, held = harness_scorers(seed=0, n_calibration=a.n_cal, n_heldout=a.n_held, history_tokens=a.history,
                                eval_tokens=a.eval_tokens, progress=False)
    res = {"args": vars(a), "setup_s": time.time() - t0, "reference": {
        "context_len": cal.reference.context_len, "modality_mix": dict(cal.reference.modality_mix)}}
    print("setup", res["setup_s"], flush=True)

    t = time.time()
    r = search(budget=a.budget, n_trials=a.n_trials, seed=0, scorer=cal, heldout_scorer=held,
               out="bench/results/search_plan.yaml", progress=False)
    res["searched"] = {"heldout": r.plan.metrics["heldout"], "calibration": r.plan.metrics["calibration"],
                       "bpv": r.plan.bpv().total, "n_real": r.n_real_evals, "n_profile": r.n_profile_evals,
                       "seconds": time.time() - t, "curve": r.curve}
    print("searched", res["searched"]["heldout"]["kl"], res["searched"]["bpv"], res["searched"]["seconds"], flush=True)

    g, mods, ref = cal.geometry, cal.modalities, cal.reference
    base = {}
    for gs in (32, 64, 128):
        for rl in (0, 32, 128):
            p = uniform_plan(g, 2, 2, group_size=gs, residual_length=rl, modalities=mods, reference=ref)
            if p.bpv().total <= a.budget + 1e-9:
                m = held(p)
                base[f"int2-g{gs}-r{rl}"] = {"kl": m["kl"], "bpv": p.bpv().total, "heldout": m}
    # HeadGuard-style: protect keys (4-bit) of the heads in the most key-sensitive layers while the budget allows
    sens = slot_sensitivity(SearchSpace(g, mods), r.profile).reshape(g.num_layers, g.num_kv_heads, 2, len(mods))
    order = np.argsort(-sens[:, :, 0].sum(-1).ravel(), kind="stable")
    best_hg = None
    for gs in (64, 128):
        protected = []
        for idx in order:
            cand = protected + [divmod(int(idx), g.num_kv_heads)]
            p = headguard_plan(g, cand, protected_key_bits=4, group_size=gs, residual_length=0, modalities=mods,
                               reference=ref)
            if p.bpv().total > a.budget + 1e-9:
                break
            protected = cand
        if protected:
            p = headguard_plan(g, protected, protected_key_bits=4, group_size=gs, residual_length=0,
                               modalities=mods, reference=ref)
            m = held(p)
            if best_hg is None or m["kl"] < best_hg["kl"]:
                best_hg = {"kl": m["kl"], "bpv": p.bpv().total, "group_size": gs, "n_protected": len(protected),
                           "heldout": m}
    if best_hg:
        base["headguard-k4"] = best_hg
    t = time.time()
    kvt = search(budget=a.budget, granularity="kvtuner", n_trials=r.n_real_evals + r.n_profile_evals, seed=0,
                 scorer=cal, heldout_scorer=held, out=None, profile=False, baselines=False, surrogate=False,
                 progress=False)
    base["kvtuner-search"] = {"kl": kvt.plan.metrics["heldout"]["kl"], "bpv": kvt.plan.bpv().total,
                              "n_real": kvt.n_real_evals, "seconds": time.time() - t,
                              "heldout": kvt.plan.metrics["heldout"]}
    res["baselines"] = base
    best_base = min(v["kl"] for v in base.values())
    res["ratio_vs_best_baseline"] = res["searched"]["heldout"]["kl"] / best_base
    print("baselines", {k: (v["kl"], v["bpv"]) for k, v in base.items()}, "ratio", res["ratio_vs_best_baseline"],
          flush=True)
    if a.curve:
        curves = {}
        for sur in (True, False):
            for seed in (0, 1, 2):
                rr = search(budget=a.budget, n_trials=a.curve_trials, seed=seed, scorer=cal, out=None,
                            surrogate=sur, progress=False)
                curves[f"surrogate={sur},seed={seed}"] = [c[1] for c in rr.curve]
                print("curve", sur, seed, rr.curve[-1], flush=True)
        res["curves"] = curves
    res["total_s"] = time.time() - t0
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1, default=float)


if __name__ == "__main__":
    main()
