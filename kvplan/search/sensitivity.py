"""The cheap sensitivity profile run before the search, and the per-slot damage prior from it.

For every (layer, kind) unit the profile measures the KL when only that unit (all its KV
heads, all modalities) is stored at the lowest candidate bits and everything else stays at
full precision; with several modalities it also measures each (kind, modality) unit across
all layers, which splits a (layer, kind) sensitivity between modalities. That is
``2 * num_layers + 2 * n_modalities`` real evaluations (64 on SmolLM2 with two modalities).

When the space resolves KV heads (``granularity="slot"``), a second stage splits the most
damaging (layer, kind) units by head: each head of the top ``head_units`` units alone at
the lowest bits (``head_units * num_kv_heads`` more evaluations; by default every unit,
``2 * num_layers * num_kv_heads``: 180 on SmolLM2). Damage is very uneven across the heads of
one layer (on SmolLM2 one key head often carries 80-95% of its layer's KL), and a per-head
prior lets the knapsack seed protect that head instead of the whole layer at a third of the
cost. A unit left out of this stage splits its damage evenly over its heads; measuring every
unit instead of the 12 worst was chosen on the validation split (``bench/search.md``).

A harness scorer runs each profile plan only from its first quantized layer on (the layers in
front of it read the exact full-precision history; their outputs are recorded once and replayed,
:mod:`kvplan.evaluation.prefix`, same numbers): on average half the layers of the model.

Profile plans are *diagnostic measurements*, not search trials: they are far from the
budget (mostly full precision) and are never told to the study as trials; they are stored
in the study's user attributes (``kvplan.profile``) so resumed searches and other workers
reuse them instead of measuring again.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Mapping

import numpy as np

from ..kernels.qtypes import FULL_PRECISION_BITS
from ..plans import KINDS, Plan, Provenance, QuantizerSettings, Reference, slot_code
from .budget import DEFAULT_CORRECTION_FACTOR
from .space import SearchSpace

DEFAULT_HEAD_UNITS: int | None = None  # (layer, kind) units whose heads the profile measures one by one; None: all


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
    (every history token quantized, the clearest signal), with the space's fixed codec
    settings (key correction, rotations) and its slot formats (the Lloyd-Max codebooks at that
    group size) so it measures the codec the plans will use: a quantizer of the space."""
    group_size, key_axis = space.group_sizes[-1], space.key_axes[0]
    return QuantizerSettings(group_size=group_size, key_axis=key_axis, value_axis=space.value_axis,
                             residual_length=space.residual_lengths[0],
                             codebooks=space.codebooks_for(group_size, key_axis), **space.fixed_fields)


def _n_head_units(space: SearchSpace, n_units: int | None) -> int:
    """How many (layer, kind) units the per-head stage splits: ``n_units`` capped at the space's
    ``2 * num_layers`` (``None``: all of them), 0 unless the space has one parameter per KV head
    (``granularity="slot"`` with at least 2 KV heads)."""
    L, H = space.shape[:2]
    if space.granularity != "slot" or H < 2:
        return 0
    return 2 * L if n_units is None else min(max(n_units, 0), 2 * L)


def head_units(space: SearchSpace, profile: Mapping[str, float], n_units: int | None) -> dict[str, np.ndarray]:
    """Per-head masks ``"L20.k.h1"`` of the ``n_units`` most damaging (layer, kind) units of
    ``profile`` (``None``: every unit); empty unless the space has one parameter per KV head
    (``granularity="slot"``)."""
    L, H, _, _ = space.shape
    n_units = _n_head_units(space, n_units)
    if n_units == 0:
        return {}
    layer_units = [(float(profile.get(f"L{l:02d}.{KINDS[k]}", 0.0)), l, k) for l in range(L) for k in range(2)]
    layer_units.sort(key=lambda u: (-u[0], u[1], u[2]))
    units: dict[str, np.ndarray] = {}
    for _, l, k in layer_units[:n_units]:
        for h in range(H):
            m = np.zeros(space.shape, dtype=bool)
            m[l, h, k, :] = True
            units[f"L{l:02d}.{KINDS[k]}.h{h}"] = m
    return units


def _unit_plans(space: SearchSpace, reference: Reference, units: Mapping[str, np.ndarray],
                code: int | None = None) -> dict[str, Plan]:
    """One plan per unit: its slots at ``code`` (default: the lowest candidate bits), the rest 16."""
    q = profile_quantizer(space)
    low = space.bits[0] if code is None else code
    plans = {}
    for name, mask in units.items():
        table = np.full(space.shape, FULL_PRECISION_BITS, dtype=np.int64)
        table[mask] = low
        plans[name] = space.plan_of_table(table, q, reference,
                                          provenance=Provenance(produced_by="kvplan search profile"))
    return plans


def profile_plans(space: SearchSpace, reference: Reference) -> dict[str, Plan]:
    """The first-stage profile plans (per (layer, kind) and per (kind, modality) unit)."""
    return _unit_plans(space, reference, profile_units(space))


PROFILE_SAVE_EVERY = 16  # new measurements between two calls of a profile's ``save``


class ResumableMeasurements:
    """The KL of named plans, measured one by one into ``out``: a name an interrupted run saved
    (``done``) is taken as measured (scores are deterministic); ``save`` gets the measurements so far
    every ``save_every`` new ones (default :data:`PROFILE_SAVE_EVERY`) and at :meth:`finish`;
    ``progress(done, total)``."""

    def __init__(self, score: Callable[[Plan], Mapping], total: int, done: Mapping[str, float] | None = None,
                 save: Callable[[dict[str, float]], None] | None = None,
                 progress: Callable[[int, int], None] | None = None, save_every: int = PROFILE_SAVE_EVERY):
        self.score, self.total, self.done, self.save, self.progress = score, total, done or {}, save, progress
        self.save_every = save_every
        self.out: dict[str, float] = {}
        self.fresh = 0  # measured by this run

    def measure(self, batch: Mapping[str, Plan]) -> None:
        for name, plan in batch.items():
            if name in self.done:
                self.out[name] = float(self.done[name])
            else:
                self.out[name] = float(self.score(plan)["kl"])
                self.fresh += 1
                if self.save is not None and self.fresh % self.save_every == 0:
                    self.save(dict(self.out))
            if self.progress:
                self.progress(len(self.out), self.total)

    def finish(self) -> dict[str, float]:
        if self.save is not None and self.fresh % self.save_every:
            self.save(dict(self.out))
        return self.out


def run_profile(score: Callable[[Plan], Mapping], space: SearchSpace, reference: Reference,
                progress: Callable[[int, int], None] | None = None,
                n_head_units: int | None = DEFAULT_HEAD_UNITS, done: Mapping[str, float] | None = None,
                save: Callable[[dict[str, float]], None] | None = None) -> dict[str, float]:
    """Measure every unit, then the heads of the ``n_head_units`` worst (layer, kind) units
    (``None``: of every unit); returns name -> mean KL. ``done`` / ``save``: measurements an
    interrupted run saved, and where to save them (:class:`ResumableMeasurements`)."""
    plans = profile_plans(space, reference)
    n_heads = _n_head_units(space, n_head_units) * space.shape[1]
    recent = recent_plans(space, reference)
    total = len(plans) + n_heads + (2 if space.corrects_keys else 0) + len(recent)
    run = ResumableMeasurements(score, total, done, save, progress)
    measure, out = run.measure, run.out

    measure(plans)
    measure(_unit_plans(space, reference, head_units(space, out, n_head_units)))
    if space.corrects_keys:
        measure(correction_plans(space, reference))
    measure(recent)
    return run.finish()


def recent_plans(space: SearchSpace, reference: Reference) -> dict[str, Plan]:
    """Every slot at the lowest level (keys corrected when the space corrects them) without recent
    copies (``"lowest"``) and with each of the space's ``recent_lengths`` (``"lowest+recent8"``, ...):
    their KL ratios are the damage factors of the copies (``recent_factor``). None when the space
    offers no copies."""
    if not any(space.recent_lengths):
        return {}
    q = profile_quantizer(space)
    table = np.full(space.shape, space.bits[0], dtype=np.int64)
    if space.corrects_keys:
        table[:, :, 0] = slot_code(space.bits[0], corrected=True)
    prov = Provenance(produced_by="kvplan search profile")
    return {("lowest" if w == 0 else f"lowest+recent{w}"): space.plan_of_table(table, replace(q, recent_length=w),
                                                                               reference, provenance=prov)
            for w in sorted({0, *space.recent_lengths})}


def recent_factor(profile: Mapping[str, float] | None, recent_length: int) -> float:
    """Measured damage of a plan with ``recent_length`` copies relative to none (profile entries
    ``lowest+recent<W>`` / ``lowest``); 1 when not measured (no profile, or no copies)."""
    if not recent_length or not profile or profile.get("lowest", 0.0) <= 0:
        return 1.0
    with_copies = profile.get(f"lowest+recent{recent_length}")
    if with_copies is None:
        return 1.0
    return float(min(1.0, max(with_copies, 0.0) / profile["lowest"]))


def correction_plans(space: SearchSpace, reference: Reference) -> dict[str, Plan]:
    """Every key at the lowest bits, without and with the key correction (values at full
    precision): their KL ratio is the damage factor of the correction (``correction_factor``)."""
    keys = np.zeros(space.shape, dtype=bool)
    keys[:, :, 0] = True
    return {**_unit_plans(space, reference, {"keys": keys}),
            **_unit_plans(space, reference, {"keys+correction": keys}, code=slot_code(space.bits[0], corrected=True))}


def correction_factor(profile: Mapping[str, float] | None) -> float:
    """Measured damage of corrected vs uncorrected keys (profile entries ``keys+correction`` /
    ``keys``), else ``DEFAULT_CORRECTION_FACTOR``."""
    if not profile or "keys" not in profile or "keys+correction" not in profile or profile["keys"] <= 0:
        return DEFAULT_CORRECTION_FACTOR
    return float(min(1.0, max(profile["keys+correction"], 0.0) / profile["keys"]))


def slot_sensitivity(space: SearchSpace, profile: Mapping[str, float] | None) -> np.ndarray | None:
    """Damage prior of each slot at the lowest bits, ``float [n_slots]`` (flat table order).

    ``s[l, h, k, m] = P[l, k] * w[l, k, h] * share[k, m]`` where ``share`` splits a kind's damage
    between modalities in proportion to the (kind, modality) profile and ``w`` splits a unit's
    damage between its heads in proportion to the per-head profile where measured (``1 / H``
    elsewhere). ``None`` without a profile.
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
            w = np.full(H, 1.0 / H)
            heads = [profile.get(f"L{l:02d}.{KINDS[k]}.h{h}") for h in range(H)]
            if all(x is not None for x in heads):
                hv = np.maximum(np.array(heads, dtype=np.float64), 0.0)
                if hv.sum() > 0:
                    w = hv / hv.sum()
            s[l, :, k, :] = p * w[:, None] * share[k][None, :]
    floor = max(s.max(), 1e-12) * 1e-4
    return np.maximum(s, floor).ravel()
