"""Quality bar of ``kvplan search`` on the embedded SmolLM2-135M, on the held-out split.

Takes a plan written by ``kvplan search --budget B --out plan.yaml`` (its ``plan.search.json``
beside it holds the sensitivity profile and the trial count) and scores, with the same
held-out scorer the search used for its final measurement (built-in task, same data seed,
sample counts and history length):

- the searched plan;
- uniform KIVI-style int2 at every group size / residual length that fits the budget, and
  the cheapest uniform int2 above it;
- HeadGuard-style: int2 everywhere, the Keys of the most sensitive physical KV heads (ranked
  by the profile's per-head measurements) at 3 or 4 bits, as many heads as the budget allows
  (best variant on held-out, which favours the baseline);
- a KVTuner-style search: one (K bits, V bits) pair per layer from KVTuner's candidates,
  plain TPE, no profile, no seeds, no surrogate, given as many real evaluations as the
  searched plan used (its profile evaluations included), chosen on calibration;
- kvplan's codec without the search (the baselines above are the published methods, which
  have neither kvplan's rotations nor its key correction): uniform int2 and the HeadGuard-style
  plan with the searched plan's rotations (``quantizer.rotation`` / ``key_pre_rope``), and
  uniform int2 with the rotations and every key corrected when the plan uses the correction.

``--curve``: does the surrogate earn its place? Best calibration KL against real
evaluations with and without the surrogate, search seeds 0, 1, 2, same data, same
profile (the one in the sidecar, so both arms start from the same seeds).

    kvplan search --budget 2.5bpv --out bench/results/search-2.5bpv.yaml
    python bench/search_quality.py bench/results/search-2.5bpv.yaml --part quality
    python bench/search_quality.py bench/results/search-2.5bpv.yaml --part curve

Writes ``bench/results/search_quality.json`` (merged across parts) and prints a summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _stamp import command, commit  # noqa: E402
from kvplan import Plan  # noqa: E402
from kvplan.plans import atomic_write_text, headguard_plan, slot_code, uniform_plan  # noqa: E402
from kvplan.search import search  # noqa: E402
from kvplan.search import sidecar_paths  # noqa: E402
from kvplan.search.scorers import harness_scorers  # noqa: E402


def _row(plan: Plan, metrics: dict, **extra) -> dict:
    return {"bpv": plan.bpv().total, "kl": metrics["kl"], "kl_ci95": [metrics.get("kl_ci95_lo"),
                                                                     metrics.get("kl_ci95_hi")],
            "top1": metrics.get("top1"), **extra}


def with_codec(p: Plan, searched: Plan) -> Plan:
    """``p`` with the searched plan's rotations (kvplan's codec; same bits, same bpv)."""
    q = dataclasses.replace(p.quantizer, rotation=searched.quantizer.rotation,
                            key_pre_rope=searched.quantizer.key_pre_rope)
    return p.replace(quantizer=q, rope_inv_freq=searched.rope_inv_freq)


def headguard_rows(held, profile: dict, budget: float, codec=lambda p: p) -> dict:
    """Best HeadGuard-style plan per protected bit width (keys of the most sensitive heads);
    ``codec`` maps each plan before it is scored."""
    g, mods, ref = held.geometry, held.modalities, held.reference
    heads = sorted(((v, n) for n, v in profile.items() if n.count(".") == 2 and ".k.h" in n), reverse=True)
    order = [(int(n[1:3]), int(n.rsplit("h", 1)[1])) for _, n in heads]  # "L20.k.h2" -> (20, 2)
    out = {}
    for bits in (3, 4):
        for gs in (64, 128):
            protected = []
            for lh in order:
                p = headguard_plan(g, protected + [lh], protected_key_bits=bits, group_size=gs, residual_length=0,
                                   modalities=mods, reference=ref)
                if p.bpv().total > budget + 1e-9:
                    break
                protected.append(lh)
            if not protected:
                continue
            p = codec(headguard_plan(g, protected, protected_key_bits=bits, group_size=gs, residual_length=0,
                                     modalities=mods, reference=ref))
            row = _row(p, held(p), group_size=gs, protected_key_bits=bits, protected_heads=protected)
            key = f"headguard-k{bits}"
            if key not in out or row["kl"] < out[key]["kl"]:
                out[key] = row
    return out


def quality(plan: Plan, side: dict, cal, held, budget: float) -> dict:
    res = {"searched": _row(plan, held(plan), n_real=None)}
    n_profile = len(side.get("profile") or {})
    n_real = int(plan.metrics.get("search", {}).get("n_trials", 0))
    res["searched"].update(n_real=n_real, n_profile=n_profile)
    g, mods, ref = held.geometry, held.modalities, held.reference
    uni, above = {}, []
    for gs in (32, 64, 128):
        for rl in (0, 32, 128):
            p = uniform_plan(g, 2, 2, group_size=gs, residual_length=rl, modalities=mods, reference=ref)
            b = p.bpv().total
            if b <= budget + 1e-9:
                uni[f"int2-g{gs}-r{rl}"] = _row(p, held(p))
            else:
                above.append((b, gs, rl, p))
    if above:
        b, gs, rl, p = min(above, key=lambda x: x[0])
        uni[f"int2-g{gs}-r{rl} (above budget)"] = _row(p, held(p))
    res["uniform"] = uni
    res["headguard"] = headguard_rows(held, side.get("profile") or {}, budget)
    t = time.time()
    kvt = search(budget=budget, granularity="kvtuner", n_trials=n_real + n_profile, seed=0, scorer=cal,
                 heldout_scorer=held, out=None, profile=False, baselines=False, surrogate=False,
                 sink_lengths=(0,), key_correction_rank=0, rotation="none", key_pre_rope=False, progress=False)
    res["kvtuner"] = {"kvtuner-search": _row(kvt.plan, kvt.plan.metrics["heldout"], n_real=kvt.n_real_evals,
                                             seconds=time.time() - t,
                                             calibration_kl=kvt.plan.metrics["calibration"]["kl"])}
    int2 = with_codec(uniform_plan(g, 2, 2, group_size=128, residual_length=0, modalities=mods, reference=ref), plan)
    res["codec"] = {"int2-g128-r0 + rotations": _row(int2, held(int2))}
    for name, row in headguard_rows(held, side.get("profile") or {}, budget, lambda p: with_codec(p, plan)).items():
        res["codec"][f"{name} + rotations"] = row
    if plan.key_basis is not None:
        q = dataclasses.replace(int2.quantizer, key_correction_rank=plan.quantizer.key_correction_rank,
                                key_correction_bits=plan.quantizer.key_correction_bits)
        codes = int2.table()
        codes[:, :, 0] = slot_code(codes[:, :, 0], corrected=True)
        p = int2.with_table(codes, quantizer=q, key_basis=plan.key_basis)
        res["codec"]["int2-g128-r0 + rotations + key correction (every key)"] = _row(p, held(p))
    kl = res["searched"]["kl"]
    ratios = {}
    for fam in ("uniform", "headguard", "kvtuner", "codec"):
        if fam not in res:
            continue
        for name, row in res[fam].items():
            ratios[name] = kl / row["kl"]
    res["ratios"] = ratios
    return res


# curve arms: name -> search() options. "with" is the default search (forest on log-KL minus
# the log of the profile's damage estimate); "forest_only" the forest on log-KL alone
CURVE_ARMS = {"with": dict(surrogate=True, surrogate_offset=True),
              "forest_only": dict(surrogate=True, surrogate_offset=False),
              "without": dict(surrogate=False)}


def curve(side: dict, cal, budget: float, n_trials: int, arms: list[str]) -> dict:
    curves, finals = {}, {}
    arms = {a: CURVE_ARMS[a] for a in dict.fromkeys([*arms, "without"])}  # "without" is the reference
    for arm, opts in arms.items():
        for seed in (0, 1, 2):
            t = time.time()
            r = search(budget=budget, n_trials=n_trials, seed=seed, scorer=cal, out=None, profile=side["profile"],
                       progress=False, **opts)
            curves[f"{arm},seed={seed}"] = [c[1] for c in r.curve]
            print(f"curve {arm} seed={seed}: best KL {r.curve[-1][1]:.4f} ({time.time() - t:.0f} s)", flush=True)
    for seed in (0, 1, 2):
        off = np.array(curves[f"without,seed={seed}"])
        finals[f"seed{seed}"] = {"evals_without": len(off)}
        for arm in arms:
            c = np.array(curves[f"{arm},seed={seed}"])
            finals[f"seed{seed}"][arm] = float(c[-1])
            if arm != "without":
                hit = np.nonzero(c <= off[-1] + 1e-12)[0]
                finals[f"seed{seed}"][f"evals_{arm}_to_reach_final_without"] = int(hit[0]) + 1 if hit.size else None
    return {"n_trials": n_trials, "arms": arms,
            "curves": curves, "summary": finals}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--part", choices=["quality", "curve", "all"], default="all")
    ap.add_argument("--curve-trials", type=int, default=None, help="default: the plan's own trial count")
    ap.add_argument("--curve-arms", nargs="+", choices=list(CURVE_ARMS), default=["with", "without"],
                    help="search variants to compare (forest_only: the forest without the profile offset)")
    ap.add_argument("--out", default="bench/results/search_quality.json")
    a = ap.parse_args()
    t0 = time.time()
    plan = Plan.from_yaml(a.plan)
    with open(sidecar_paths(a.plan)["search"]) as f:
        side = json.load(f)
    budget = plan.target_bpv
    s = plan.metrics.get("search", {})
    cal, held = harness_scorers(seed=int(s.get("seed", 0)), progress=False)
    res = {}
    if os.path.exists(a.out):
        with open(a.out) as f:
            res = json.load(f)
    res.update(plan=a.plan, budget=budget, command=command(), commit=commit())
    if a.part in ("quality", "all"):
        res["quality"] = quality(plan, side, cal, held, budget)
        for fam in ("uniform", "headguard", "kvtuner", "codec"):
            for name, row in res["quality"].get(fam, {}).items():
                print(f"{name:32s} {row['bpv']:.3f} bpv  KL {row['kl']:.4f}  ratio searched/this "
                      f"{res['quality']['ratios'][name]:.3f}", flush=True)
        print(f"searched {res['quality']['searched']['bpv']:.3f} bpv KL {res['quality']['searched']['kl']:.4f}")
    if a.part in ("curve", "all"):
        res["curve"] = curve(side, cal, budget, a.curve_trials or int(s.get("n_trials", 60)), a.curve_arms)
        print(json.dumps(res["curve"]["summary"], indent=1))
    res.setdefault("seconds", {})[a.part] = time.time() - t0
    atomic_write_text(a.out, json.dumps(res, indent=1, default=float))


if __name__ == "__main__":
    main()
