"""``kvplan.load``: make a model's ``generate`` run on a plan's quantized cache."""

from __future__ import annotations

import functools
import os

from ..errors import PlanError
from ..models.geometry import Geometry
from ..models.modality import labels_from_input_ids, visual_token_ids
from ..plans import BASELINES, Plan, baseline_plan
from .cache import KVPlanCache


def resolve_plan(plan, model_or_geometry) -> Plan:
    """A :class:`Plan` from a Plan, a YAML path, or a baseline name (``int4``, ``k4v2-g64``...),
    checked against the model's geometry."""
    geometry = Geometry.of(model_or_geometry)
    source = None
    if isinstance(plan, Plan):
        resolved = plan
    elif isinstance(plan, (str, os.PathLike)) and os.path.exists(plan):
        source = os.fspath(plan)
        resolved = Plan.from_yaml(plan)
    elif isinstance(plan, str) and plan.partition("-g")[0] in BASELINES:
        modalities = ("text", "visual") if visual_token_ids(_config(model_or_geometry)) else ("text",)
        resolved = baseline_plan(plan, geometry, modalities=modalities)
    elif isinstance(plan, str) and plan.endswith((".yaml", ".yml")):
        raise PlanError("<file>", "plan file not found", plan)
    else:
        raise PlanError("plan", f"expected a Plan, a YAML file path or a baseline name {sorted(BASELINES)}", plan)
    resolved.check_geometry(geometry, source=source)
    return resolved


def _config(model_or_geometry):
    return getattr(model_or_geometry, "config", None)


def make_cache(model, plan, input_ids=None, attention_mask=None) -> KVPlanCache:
    """A fresh :class:`KVPlanCache` for ``model``; with ``input_ids`` its prompt is labelled
    (image/video tokens of a VLM are ``"visual"``, the rest ``"text"``)."""
    cache = KVPlanCache(resolve_plan(plan, model), model)
    if input_ids is not None:
        cache.assign_labels(labels_from_input_ids(input_ids, model.config), attention_mask)
    return cache


def load(model, plan):
    """Validate ``plan`` (a path, a :class:`Plan` or a baseline name) against ``model`` and
    make ``model.generate(...)`` use a fresh quantized cache following it on every call.

    Returns the model. A ``cache=`` passed to ``generate`` explicitly is used as is.
    ``kvplan.unload(model)`` restores the original ``generate``.
    """
    resolved = resolve_plan(plan, model)
    unload(model)
    original = model.generate

    @functools.wraps(original)
    def generate(*args, **kwargs):
        if kwargs.get("cache") is None and kwargs.get("past_key_values") is None and kwargs.get("use_cache", True):
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            kwargs["cache"] = make_cache(model, resolved, input_ids, kwargs.get("attention_mask"))
        return original(*args, **kwargs)

    generate._kvplan_original = original
    model.generate = generate
    model.kvplan_plan = resolved
    return model


def unload(model):
    """Undo :func:`load`."""
    gen = model.__dict__.get("generate")
    if gen is not None and hasattr(gen, "_kvplan_original"):
        del model.generate
    model.__dict__.pop("kvplan_plan", None)
    return model
