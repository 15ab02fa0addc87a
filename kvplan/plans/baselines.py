"""Built-in baseline plans, by name or by constructor.

``fp16``; uniform KIVI-style ``int8`` / ``int4`` / ``int2`` (keys per channel, values per
token, group 32, residual 128); ``k4v2``; any uniform plan via :func:`uniform_plan`;
KVTuner-style per-layer (K, V) pairs via :func:`layerwise_plan`; HeadGuard-style
protected heads via :func:`headguard_plan`.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from ..errors import FILE_PATH, PlanError, or_list
from ..kernels.qtypes import GROUP_SIZES
from ..models.geometry import Geometry, storage_bits
from ._checks import DEFAULT_MODALITY, check_int
from ._fields import Provenance, QuantizerSettings, Reference
from ._plan import Plan

# name -> (key bits, value bits)
BASELINES: dict[str, tuple[int, int]] = {
    "fp16": (16, 16),
    "int8": (8, 8),
    "int4": (4, 4),
    "int2": (2, 2),
    "k4v2": (4, 2),
}

# KVTuner's per-layer (K bits, V bits) candidates.
KVTUNER_PAIRS: tuple[tuple[int, int], ...] = ((8, 8), (8, 4), (4, 4), (4, 2), (2, 2))


def uniform_plan(geometry: Geometry, key_bits: int, value_bits: int | None = None, *, group_size: int = 32,
                 residual_length: int = 128, key_axis: str = "channel", value_axis: str = "token",
                 sink_length: int = 0, modalities: Sequence[str] = (DEFAULT_MODALITY,), name: str | None = None,
                 **plan_kwargs) -> Plan:
    """Every slot at the same bits (``value_bits`` defaults to ``key_bits``)."""
    value_bits = key_bits if value_bits is None else value_bits
    modalities = tuple(modalities)
    # dtype object: a fractional width reaches Plan.from_table's check instead of being truncated here
    table = np.empty((geometry.num_layers, geometry.num_kv_heads, 2, len(modalities)), dtype=object)
    table[:, :, 0, :] = key_bits
    table[:, :, 1, :] = value_bits
    q = QuantizerSettings(group_size=group_size, key_axis=key_axis, value_axis=value_axis,
                          residual_length=residual_length, sink_length=sink_length)
    plan_kwargs.setdefault("provenance", Provenance(produced_by="baseline"))
    return Plan.from_table(table, geometry, modalities, quantizer=q, name=name, **plan_kwargs)


def is_baseline_name(name) -> bool:
    """Whether ``name`` names a built-in baseline (``int4``, ``k4v2-g64``...) rather than a plan file: the
    whole string is a baseline name with an optional ``-g<group size>``, and no file of that name exists."""
    if not isinstance(name, str) or os.path.exists(name):
        return False
    base, sep, suffix = name.partition("-g")
    return base in BASELINES and (not sep or suffix.isdigit())


def at_model_width(model_or_geometry) -> dict:
    """Plan keyword arguments that state a baseline's bpv at the model's full-precision width, the width
    :func:`kvplan.load` stores (an fp32 model's: 32 bits); none for a Geometry or a config (16 bits)."""
    if not hasattr(model_or_geometry, "parameters"):
        return {}
    return {"reference": Reference(full_precision_bits=storage_bits(model_or_geometry))}


BASELINE_NAMES = f"{', '.join(BASELINES)} (optionally with -g{'/-g'.join(map(str, GROUP_SIZES))})"


def check_baseline_name(name: str) -> None:
    """Raise :class:`PlanError` naming ``name`` unless it is a built-in baseline with a group size plans take
    (``int4-g7`` is refused here, before a model loads, not by the plan built from it)."""
    base, sep, suffix = name.partition("-g")
    if base not in BASELINES or (sep and not suffix.isdigit()):
        raise PlanError("plan", f"unknown baseline name; known: {BASELINE_NAMES}", name)
    if sep and int(suffix) not in GROUP_SIZES:
        raise PlanError("plan", f"group size {int(suffix)} is not one plans take ({or_list(GROUP_SIZES)})", name)


def check_plan_argument(name: str, also: str = "") -> bool:
    """A command's plan argument, checked before any model loads: ``True`` for a built-in baseline name (its
    group size checked), ``False`` for what :meth:`Plan.from_yaml` reads (a path, or YAML text: a one-line
    plan is a ``{...}`` mapping). A :class:`PlanError` for a one-line name that is neither, listing the
    built-in names and ``also`` (the other names the command takes: ``kvplan eval``'s peers)."""
    if is_baseline_name(name):
        check_baseline_name(name)
        return True
    if "\n" in name or os.path.exists(name) or name.endswith((".yaml", ".yml")) or name.lstrip().startswith("{"):
        return False
    raise PlanError(FILE_PATH, f"no such plan file, and not a built-in plan: {BASELINE_NAMES}{also}",
                    show_value=False, source=name)


def baseline_plan(name: str, geometry: Geometry, **kwargs) -> Plan:
    """A built-in baseline by name: ``fp16``, ``int8``, ``int4``, ``int2``, ``k4v2``.

    Also accepts ``int4-g64`` / ``k4v2-g128`` style names for another group size.
    """
    check_baseline_name(name)
    base, _, suffix = name.partition("-g")
    if suffix:
        kwargs["group_size"] = int(suffix)
    kb, vb = BASELINES[base]
    return uniform_plan(geometry, kb, vb, name=name, **kwargs)


def layerwise_plan(geometry: Geometry, pairs: Sequence[tuple[int, int]], **kwargs) -> Plan:
    """KVTuner-style plan: one ``(key bits, value bits)`` pair per layer."""
    if len(pairs) != geometry.num_layers:
        raise PlanError("pairs", f"need one (K, V) pair per layer ({geometry.num_layers})", len(pairs))
    plan = uniform_plan(geometry, 16, 16, **kwargs)
    table = plan.table().astype(object)  # as uniform_plan: fractional bits are refused, not truncated
    for layer, (kb, vb) in enumerate(pairs):
        table[layer, :, 0, :] = kb
        table[layer, :, 1, :] = vb
    return plan.with_table(table)


def headguard_plan(geometry: Geometry, protected: Sequence[tuple[int, int]], *, low_bits: tuple[int, int] = (2, 2),
                   protected_key_bits: int = 16, protected_value_bits: int | None = None,
                   protected_modality: str | None = None, **kwargs) -> Plan:
    """HeadGuard-style plan: ``protected`` physical KV heads ``(layer, head)`` keep their Keys
    (of ``protected_modality``, or all modalities) at high precision; everything else is low-bit.
    """
    plan = uniform_plan(geometry, low_bits[0], low_bits[1], **kwargs)
    table = plan.table().astype(object)  # as uniform_plan: fractional bits are refused, not truncated
    if protected_modality is not None and protected_modality not in plan.modalities:
        raise PlanError("protected_modality", f"must be one of the plan's modalities {list(plan.modalities)}",
                        protected_modality)
    mods = [plan.modalities.index(protected_modality)] if protected_modality else list(range(len(plan.modalities)))
    for i, pair in enumerate(protected):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise PlanError(f"protected[{i}]", "must be a (layer, KV head) pair", pair)
        layer, head = (int(x) if isinstance(x, np.integer) else x for x in pair)  # np.argwhere's are indices too
        check_int(layer, f"protected[{i}] layer", 0, geometry.num_layers - 1)
        check_int(head, f"protected[{i}] KV head", 0, geometry.num_kv_heads - 1)
        for m in mods:
            table[layer, head, 0, m] = protected_key_bits
            if protected_value_bits is not None:
                table[layer, head, 1, m] = protected_value_bits
    return plan.with_table(table)
