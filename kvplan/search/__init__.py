"""Budgeted plan search: space, honest-bpv budget and repair, sensitivity profile, Optuna study.

>>> from kvplan.search import search
>>> result = search(budget="2.5bpv", n_trials=120, out="plan.yaml")
"""

import importlib

# imported on first use, so that e.g. ``kvplan.search.space`` (the CLI's parser, ``kvplan validate``)
# does not pull in the evaluation harness, transformers and scikit-learn
_LAZY = {
    **dict.fromkeys(("Scorer", "SearchResult", "check_budgets", "output_paths", "pareto_front", "search",
                     "sidecar_paths", "write_history"), "._search"),
    **dict.fromkeys(("BpvModel", "BudgetError", "group_damage", "knapsack_seed", "parse_budget",
                     "quantization_damage", "repair"), ".budget"),
    **dict.fromkeys(("profile_plans", "profile_units", "run_profile", "slot_sensitivity"), ".sensitivity"),
    "query_basis": ".key_basis",
    "SearchConfig": ".config",
    **dict.fromkeys(("DEFAULT_BITS", "DEFAULT_KEY_CORRECTION_RANK", "GRANULARITIES", "Group", "SearchSpace"),
                    ".space"),
    **dict.fromkeys(("fail_orphaned_trials", "make_storage"), ".storage"),
}

__all__ = [
    "DEFAULT_BITS",
    "DEFAULT_KEY_CORRECTION_RANK",
    "GRANULARITIES",
    "BpvModel",
    "BudgetError",
    "Group",
    "Scorer",
    "SearchConfig",
    "SearchResult",
    "SearchSpace",
    "check_budgets",
    "fail_orphaned_trials",
    "group_damage",
    "knapsack_seed",
    "make_storage",
    "output_paths",
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


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvplan.search' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
