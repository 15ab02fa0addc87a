"""Runtime: the plan-following quantized cache and ``kvplan.load``."""

from .cache import KVPlanCache, resolve_batch_labels
from .load import load, make_cache, resolve_plan, unload

__all__ = ["KVPlanCache", "load", "make_cache", "resolve_batch_labels", "resolve_plan", "unload"]
