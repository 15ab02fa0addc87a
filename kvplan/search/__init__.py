"""Budgeted plan search: space, honest-bpv budget and repair, sensitivity profile, Optuna study.

>>> from kvplan.search import search
>>> result = search(budget="2.5bpv", n_trials=120, out="plan.yaml")
"""

from ._search import Scorer, SearchResult, pareto_front, search, sidecar_paths, write_history
from .budget import BpvModel, BudgetError, group_damage, knapsack_seed, parse_budget, quantization_damage, repair
from .sensitivity import profile_plans, profile_units, run_profile, slot_sensitivity
from .key_basis import query_basis
from .space import DEFAULT_BITS, DEFAULT_KEY_CORRECTION_RANK, GRANULARITIES, Group, SearchSpace
from .storage import fail_orphaned_trials, make_storage

__all__ = [
    "DEFAULT_BITS",
    "DEFAULT_KEY_CORRECTION_RANK",
    "GRANULARITIES",
    "BpvModel",
    "BudgetError",
    "Group",
    "Scorer",
    "SearchResult",
    "SearchSpace",
    "fail_orphaned_trials",
    "group_damage",
    "knapsack_seed",
    "make_storage",
    "pareto_front",
    "parse_budget",
    "profile_plans",
    "profile_units",
    "query_basis",
    "quantization_damage",
    "repair",
    "run_profile",
    "search",
    "sidecar_paths",
    "slot_sensitivity",
    "write_history",
]
