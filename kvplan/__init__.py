"""kvplan: find, explain and deploy mixed-precision KV-cache plans.

>>> import kvplan
>>> model = kvplan.load(model, "plan.yaml")   # then model.generate(...) as usual

Heavy parts (transformers, the runtime) are imported on first use, so plan tooling and
the CLI start fast.
"""

from __future__ import annotations

import importlib

from ._version import __version__
from .errors import CacheError, KVPlanError, ModelLoadError, PlanError
from .models.geometry import Geometry
from .plans import Plan, baseline_plan, headguard_plan, layerwise_plan, uniform_plan

_LAZY = {
    "KVPlanCache": "kvplan.runtime",
    "load": "kvplan.runtime",
    "make_cache": "kvplan.runtime",
    "unload": "kvplan.runtime",
    "load_model": "kvplan.models.loading",
    "Labelling": "kvplan.models.modality",
}

__all__ = [
    "CacheError",
    "Geometry",
    "KVPlanCache",
    "KVPlanError",
    "Labelling",
    "ModelLoadError",
    "Plan",
    "PlanError",
    "__version__",
    "baseline_plan",
    "headguard_plan",
    "layerwise_plan",
    "load",
    "load_model",
    "make_cache",
    "uniform_plan",
    "unload",
]


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvplan' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
