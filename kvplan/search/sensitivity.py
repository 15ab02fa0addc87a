"""The cheap sensitivity profile run before the search, and the per-slot damage prior from it.

For every (layer, kind) unit the profile measures the KL when only that unit (all its KV
heads, all modalities) is stored at the lowest candidate bits and everything else stays at
full precision; with several modalities it also measures each (kind, modality) unit across
all layers, which splits a (layer, kind) sensitivity between modalities. That is
``2 * num_layers + 2 * n_modalities`` real evaluations (62 on SmolLM2 with one modality).

Profile plans are *diagnostic measurements*, not search trials: they are far from the
budget (mostly full precision) and are never told to the study as trials; they are stored
in the study's user attributes (``kvplan.profile``) so resumed searches and other workers
reuse them instead of measuring again.
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from ..kernels.qtypes import FULL_PRECISION_BITS
from ..plans import KINDS, Plan, Provenance, QuantizerSettings, Reference
from .space import SearchSpace


def profile_units(space: SearchSpace) -> dict[str, np.ndarray]:
    """Name -> boolean mask over the bit table of each profiled unit."""
    L, H, _, M = space.shape
    units: dict[str, np.ndarray] = {}
    for l in range(L):
        for k in range(2):
            m = np.zeros(space.shape, dtype=bool)
            m[l, :, k, :] = True
            units[f"L{l:02d}.{KINDS[k]}"] = m
    if M > 1:
        for k in range(2):
            for mi, mod in enumerate(space.modalities):
                m = np.zeros(space.shape, dtype=bool)
                m[:, :, k, mi] = True
                units[f"{KINDS[k]}.{mod}"] = m
    return units


def profile_quantizer(space: SearchSpace) -> QuantizerSettings:
    """Setting the profile is measured at: the largest group size and the shortest residual
    (every history token quantized, the clearest signal)."""
    return QuantizerSettings(group_size=space.group_sizes[-1], key_axis=space.key_axes[0],
                             value_axis=space.value_axis, residual_length=space.residual_lengths[0])


def profile_plans(space: SearchSpace, reference: Reference) -> dict[str, Plan]:
    q = profile_quantizer(space)
    low = space.bits[0]
    plans = {}
    for name, mask in profile_units(space).items():
        table = np.full(space.shape, FULL_PRECISION_BITS, dtype=np.int64)
        table[mask] = low
        plans[name] = Plan.from_table(table, space.geometry, space.modalities, quantizer=q, reference=reference,
                                      provenance=Provenance(produced_by="kvplan search profile"))
    return plans


def run_profile(score: Callable[[Plan], Mapping], space: SearchSpace, reference: Reference,
                progress: Callable[[int, int], None] | None = None) -> dict[str, float]:
    """Measure every unit; returns name -> mean KL."""
    plans = profile_plans(space, reference)
    out = {}
    for i, (name, plan) in enumerate(plans.items()):
        out[name] = float(score(plan)["kl"])
        if progress:
            progress(i + 1, len(plans))
    return out


def slot_sensitivity(space: SearchSpace, profile: Mapping[str, float] | None) -> np.ndarray | None:
    """Damage prior of each slot at the lowest bits, ``float [n_slots]`` (flat table order).

    ``s[l, h, k, m] = P[l, k] / H * share[k, m]`` where ``share`` splits a kind's damage between
    modalities in proportion to the (kind, modality) profile. ``None`` without a profile.
    """
    if not profile:
        return None
    L, H, _, M = space.shape
    s = np.zeros(space.shape)
    share = np.ones((2, M)) / M
    if M > 1:
        for k in range(2):
            vals = np.array([max(profile.get(f"{KINDS[k]}.{mod}", 0.0), 0.0) for mod in space.modalities])
            if vals.sum() > 0:
                share[k] = vals / vals.sum()
    for l in range(L):
        for k in range(2):
            p = max(float(profile.get(f"L{l:02d}.{KINDS[k]}", 0.0)), 0.0)
            s[l, :, k, :] = p / H * share[k][None, :]
    floor = max(s.max(), 1e-12) * 1e-4
    return np.maximum(s, floor).ravel()
