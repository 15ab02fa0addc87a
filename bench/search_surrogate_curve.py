"""Does the surrogate earn its place? Best KL vs real evaluations, with and without it, 3 seeds.

Runs on the synthetic scorer (tests/search/synthetic.py) at SmolLM2's geometry (30 layers x 3 KV
heads, 2 modalities -> 360 slot parameters), so it is cheap and repeatable; the real-model
version is ``bench/search_quality.py --curve``.

    python bench/search_surrogate_curve.py --n-trials 60 --budget 2.6
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _stamp import command, commit  # noqa: E402
from kvplan.models import Geometry  # noqa: E402
from kvplan.plans import Reference  # noqa: E402
from kvplan.search import search  # noqa: E402
from tests.search.synthetic import SyntheticScorer  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-trials", type=int, default=60)
    ap.add_argument("--budget", type=float, default=2.6)
    ap.add_argument("--out", default="bench/results/search_surrogate_curve.json")
    a = ap.parse_args()
    run = {"command": command(), "commit": commit()}  # taken before the run, as it starts
    geom = Geometry(30, 3, 64, ("full",) * 30, "llama")
    ref = Reference(512, (("text", 0.0673828125), ("doc", 0.9326171875)))
    curves = {}
    for sur in (True, False):
        for seed in (0, 1, 2):
            sc = SyntheticScorer(geometry=geom, reference=ref, seed=seed)
            r = search(budget=a.budget, n_trials=a.n_trials, seed=seed, scorer=sc, out=None, surrogate=sur,
                       progress=False)
            curves[(sur, seed)] = np.array([c[1] for c in r.curve])
            print(f"surrogate={sur} seed={seed}: best KL {r.curve[-1][1]:.5g} after {a.n_trials} evals "
                  f"(+{r.n_profile_evals} profile)", flush=True)
    res = {**run, "args": vars(a), "curves": {f"surrogate={k[0]},seed={k[1]}": v.tolist() for k, v in curves.items()}}
    for seed in (0, 1, 2):
        on, off = curves[(True, seed)], curves[(False, seed)]
        target = off[-1]  # the KL plain TPE reaches with all its evaluations
        n_on = int(np.argmax(on <= target)) + 1 if (on <= target).any() else None
        res[f"seed{seed}"] = {"tpe_final": float(off[-1]), "surrogate_final": float(on[-1]),
                              "evals_for_surrogate_to_reach_tpe_final": n_on, "tpe_evals": len(off)}
        print(res[f"seed{seed}"], flush=True)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
