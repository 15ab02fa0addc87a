"""A searched plan with its sidecars for the explain tests (synthetic scorer, seconds)."""

import os
import shutil

from kvplan.search import search
from tests.search.synthetic import SyntheticScorer


def searched_plan(folder) -> str:
    """Search a small synthetic plan into ``folder/plan.yaml`` (with ``.trials.csv`` and ``.search.json``)."""
    out = os.path.join(folder, "plan.yaml")
    search(budget="3.0bpv", n_trials=20, scorer=SyntheticScorer(), heldout_scorer=SyntheticScorer(), out=out,
           progress=False, n_candidates=6, n_local=10,
           # the space before recent copies and coded residuals: its seeds leave room for TPE in 20 trials
           recent_lengths=(0,), residual_bits=16)
    return out


def copy_plan(plan: str, folder, stem: str = "plan") -> dict[str, str]:
    """Copy a plan and its sidecars to ``folder/<stem>.*``; returns the new paths by role."""
    src = plan[: -len(".yaml")]
    paths = {}
    for role, ext in (("plan", ".yaml"), ("trials", ".trials.csv"), ("search", ".search.json")):
        paths[role] = os.path.join(folder, stem + ext)
        if os.path.exists(src + ext):
            shutil.copy(src + ext, paths[role])
    return paths
