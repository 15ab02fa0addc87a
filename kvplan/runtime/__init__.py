"""Runtime: the plan-following quantized cache and ``kvplan.load``."""

from .cache import KVPlanCache, resolve_batch_labels
from .load import attention_route, check_modalities, load, make_cache, resolve_plan, unload

__all__ = ["KVPlanCache", "attention_route", "check_modalities", "load", "make_cache", "resolve_batch_labels",
           "resolve_plan", "unload"]
