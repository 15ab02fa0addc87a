"""kvplan: find, explain and deploy mixed-precision KV-cache plans.

>>> import kvplan
>>> model = kvplan.load(model, "plan.yaml")   # then model.generate(...) as usual
"""

from ._version import __version__
from .errors import CacheError, KVPlanError, ModelLoadError, PlanError
from .models import Geometry, load_model
from .plans import Plan, baseline_plan, headguard_plan, layerwise_plan, uniform_plan
from .runtime import KVPlanCache, load, make_cache, unload

__all__ = [
    "CacheError",
    "Geometry",
    "KVPlanCache",
    "KVPlanError",
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
