"""The budget: honest bits per value at the plan's reference, and the repair step.

Honest bpv (``Plan.bpv().total``, see :mod:`kvplan.plans.accounting`) is a sum of
independent per-slot byte counts plus the residual (``quantizer.residual_bits``), so for one quantizer
setting it is *linear* in the slot choices:
``bpv = const(q) + sum_slots cost(q, kind, modality, bits)``. :class:`BpvModel` tabulates
those terms once per quantizer setting (from the same ``run_bytes`` the accounting uses)
and evaluates any table in microseconds; tests check it equals ``Plan.bpv().total``.

:func:`repair` makes any proposal feasible: if even the all-lowest-bits table of its
quantizer setting is over budget it switches to the closest feasible setting, then it
lowers groups one level at a time, the lowest predicted damage per bit saved first,
until the plan fits. A real evaluation is never spent on an over-budget plan.
"""

from __future__ import annotations

import heapq
import re
import warnings
from dataclasses import dataclass

import numpy as np

from ..errors import KVPlanError
from ..kernels.qtypes import FULL_PRECISION_BITS, STREAMED
from ..plans import QuantizerSettings, Reference, committed_length, split_codes, stored_runs
from ..plans.accounting import (HEAVY_META_BYTES, _clip_runs, correction_bytes, heavy_tokens, recent_tokens, run_bytes,
                                sliding_kept_start, stored_tokens, stream_tokens)
from .space import Q_FIELDS, SearchSpace

EPS = 1e-9
_BUDGET_RE = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(bpv|bits?)?\s*$", re.IGNORECASE)


class BudgetError(KVPlanError, ValueError):
    """The budget cannot be parsed or no plan in the search space reaches it."""


def parse_budget(budget) -> float:
    """``"2.5bpv"``, ``"2.5 bpv"``, ``"2.5"`` or ``2.5`` -> ``2.5`` (honest bits per value)."""
    if isinstance(budget, bool):
        raise BudgetError(f"budget must be a number of bits per value like '2.5bpv', got {budget!r}")
    if isinstance(budget, (int, float)):
        value = float(budget)
    elif isinstance(budget, str):
        m = _BUDGET_RE.match(budget)
        if not m:
            raise BudgetError(f"budget {budget!r} is not a number of bits per value like '2.5bpv' or '2.5'")
        value = float(m.group(1))
    else:
        raise BudgetError(f"budget must be a number of bits per value like '2.5bpv', got {budget!r}")
    if not (value > 0 and np.isfinite(value)):
        raise BudgetError(f"budget must be a positive number of bits per value, got {budget!r}")
    return value


# damage of a corrected key slot relative to the same slot uncorrected, when the profile did
# not measure it (it does when the search uses the key correction)
DEFAULT_CORRECTION_FACTOR = 0.4


def quantization_damage(codes, bmin: int, correction_factor: float = DEFAULT_CORRECTION_FACTOR) -> np.ndarray:
    """Relative damage prior of storing at ``codes`` (bits, or bits + ``CORRECTED``) vs ``bmin``
    bits: squared step size ratio ``((2^bmin - 1) / (2^bits - 1))^2``, times ``correction_factor``
    for corrected key slots, and 0 at full precision (16) and for a streamed head's slots (bits 0: fixed
    before the search, the same in every plan of a space, so a constant the prior leaves out)."""
    b, corrected = split_codes(np.asarray(codes, dtype=np.int64))
    b = b.astype(np.float64)
    with np.errstate(divide="ignore"):
        out = ((2.0 ** bmin - 1) / (2.0 ** b - 1)) ** 2 * np.where(corrected, correction_factor, 1.0)
    return np.where((b >= FULL_PRECISION_BITS) | (b == STREAMED), 0.0, out)


@dataclass
class _QTerms:
    quantizer: QuantizerSettings
    const: float  # residual bits per value
    group_cost: np.ndarray  # float [n_groups, max_levels] (inf padding)
    floor: float  # bpv with every group at level 0


class BpvModel:
    """Exact, vectorized honest bpv of a search space's plans at one reference."""

    def __init__(self, space: SearchSpace, reference: Reference):
        self.space = space
        self.reference = reference
        self.labels = reference.labels()
        self._terms: dict[QuantizerSettings, _QTerms] = {}  # QuantizerSettings is frozen: a key
        for q in space.quantizers():
            self._terms[q] = self._build(q)

    def n_values(self, q: QuantizerSettings) -> int:
        """Values the cache holds at the reference (sliding-window layers: their kept window)."""
        g = self.space.geometry
        return g.num_kv_heads * 2 * g.head_dim * stored_tokens(g, len(self.labels), q.group_size)

    def _kept_starts(self, q: QuantizerSettings) -> list[int]:
        """First stored position of each layer at the reference (0 for full layers)."""
        g = self.space.geometry
        return [sliding_kept_start(len(self.labels), g.window(layer), q.group_size) for layer in range(g.num_layers)]

    def slot_costs(self, q: QuantizerSettings) -> np.ndarray:
        """bpv contributed by each slot at each format code of the space (``space.codes``):
        float ``[n_slots, len(space.codes)]``."""
        g = self.space.geometry
        fp_bytes = self.reference.full_precision_bits // 8
        T = len(self.labels)
        C = committed_length(T, q.residual_length, q.group_size)
        all_runs = stored_runs(self.labels, 0, C, q.sink_length)
        n_values = self.n_values(q)
        codes = self.space.codes
        by_start: dict[int, np.ndarray] = {}  # a layer's kept start -> per [2, M, n_codes]
        for kept in set(self._kept_starts(q)):
            runs = _clip_runs(all_runs, kept) if kept else all_runs
            per = np.zeros((2, len(self.space.modalities), len(codes)))
            for k, kind in enumerate(("k", "v")):
                for m, mod in enumerate(self.space.modalities):
                    for ci, code in enumerate(codes):
                        bits, corrected = split_codes(code)
                        if bits == STREAMED:  # no codes: the head's window copies (counted in one modality)
                            copies = stream_tokens(C, q.stream_window, q.recent_length, q.sink_length) if m == 0 else 0
                            per[k, m, ci] = 8.0 * copies * q.residual_token_bytes(g.head_dim, fp_bytes) / n_values
                            continue
                        tot = 0
                        for lab, start, length, sink in runs:
                            if lab == mod and not sink:  # sink positions are a constant (see _build)
                                p, s = run_bytes(bits, q.axis(kind), q.group_size, g.head_dim, start, length,
                                                 fp_bytes, q.format(kind, bits))
                                tot += p + s + (correction_bytes(q, start, length) if corrected else 0)
                        per[k, m, ci] = 8.0 * tot / n_values
            by_start[kept] = per
        L, H, _, M = self.space.shape
        layers = np.stack([by_start[kept] for kept in self._kept_starts(q)])  # [L, 2, M, n_codes]
        return np.broadcast_to(layers[:, None], (L, H, 2, M, len(codes))).reshape(-1, len(codes))

    def _build(self, q: QuantizerSettings) -> _QTerms:
        g = self.space.geometry
        T = len(self.labels)
        C = committed_length(T, q.residual_length, q.group_size)
        # per layer: residual positions it keeps (held as quantizer.residual_bits says), plus committed
        # sink positions it keeps (quantizer.sink_bits, in every slot); sliding-window layers keep only from
        # their kept start on
        fp_bytes = self.reference.full_precision_bits // 8
        kept_starts = self._kept_starts(q)
        # ... and the copies of its newest committed tokens (quantizer.recent_length), held like the residual
        residual_positions = sum(T - max(C, kept) + recent_tokens(C, q.recent_length, q.sink_length, kept)
                                 for kept in kept_starts)
        sink_positions = sum(max(0, min(q.sink_length, C) - kept) for kept in kept_starts)
        # ... and the heavy-hitter copies of full-attention layers, with their positions and scores
        heavy = sum(heavy_tokens(C, q.heavy_length, q.sink_length, g.window(layer) is not None)
                    for layer in range(g.num_layers))
        token_bytes = q.residual_token_bytes(g.head_dim, fp_bytes)
        const = 8.0 * ((residual_positions + heavy) * token_bytes * 2
                       + sink_positions * q.sink_token_bytes(g.head_dim, fp_bytes) * 2
                       + heavy * HEAVY_META_BYTES) * g.num_kv_heads / self.n_values(q)
        sc = self.slot_costs(q)
        bit_col = {c: i for i, c in enumerate(self.space.codes)}
        groups = self.space.groups
        max_lv = max(gr.n_levels for gr in groups)
        cost = np.full((len(groups), max_lv), np.inf)
        for gi, gr in enumerate(groups):
            cols = np.vectorize(bit_col.__getitem__)(gr.level_bits)  # [n_levels, n_slots]
            cost[gi, : gr.n_levels] = sc[gr.slots[None, :], cols].sum(axis=1)
        return _QTerms(q, const, cost, const + float(cost[:, 0].sum()))

    def terms(self, q: QuantizerSettings) -> _QTerms:
        try:
            return self._terms[q]
        except KeyError:
            raise KVPlanError(f"quantizer {q} is not in the search space") from None

    def bpv(self, levels, q: QuantizerSettings) -> float:
        t = self.terms(q)
        lv = np.asarray(levels, dtype=np.int64)
        return t.const + float(t.group_cost[np.arange(len(lv)), lv].sum())

    def floor(self, q: QuantizerSettings) -> float:
        return self.terms(q).floor

    def cheapest(self) -> tuple[float, QuantizerSettings]:
        """The lowest bpv any plan of the space reaches, and its quantizer setting."""
        t = min(self._terms.values(), key=lambda t: t.floor)
        return t.floor, t.quantizer

    def dearest(self) -> float:
        """The highest bpv any plan of the space reaches: every group at its dearest level, the dearest quantizer."""
        return max(t.const + float(np.where(np.isfinite(t.group_cost), t.group_cost, -np.inf).max(axis=1).sum())
                   for t in self._terms.values())

    def warn_if_unconstrained(self, budget: float) -> None:
        """Warn when every plan of the space fits ``budget``: nothing is traded for memory."""
        hi = self.dearest()
        if budget + EPS >= hi:
            warnings.warn(f"kvplan: budget {budget:g} bpv is at or above the dearest plan of this search space "
                          f"({hi:.4f} bpv, every slot at its highest bits): every plan fits, so the search trades "
                          f"no memory for quality; give a budget below {hi:.4f} bpv to allocate bits", stacklevel=3)

    def feasible_quantizers(self, budget: float) -> list[QuantizerSettings]:
        return [t.quantizer for t in self._terms.values() if t.floor <= budget + EPS]

    def check_budget(self, budget: float, hint: str = "") -> None:
        """Raise :class:`BudgetError` naming the cheapest reachable bpv when ``budget`` is below it (``hint``:
        more ways to widen the space, appended to the message)."""
        lo, q = self.cheapest()
        if budget + EPS < lo:
            space, ref = self.space, self.reference
            how = f"every slot at {space.bits[0]} bits"
            n_streamed, g = len(space.streamed_heads), space.geometry
            if n_streamed:
                how = f"{n_streamed} KV heads streamed with window {space.fixed_fields['stream_window']}" + (
                    f", every other slot at {space.bits[0]} bits" if n_streamed < g.num_layers * g.num_kv_heads
                    else "")
            raise BudgetError(
                f"budget {budget:g} bpv is below the cheapest reachable plan in this search space: {lo:.4f} bpv "
                f"({how}, group_size {q.group_size}, residual_length {q.residual_length}, at context_len "
                f"{ref.context_len}); raise the budget or widen the space (bits, group_sizes, residual_lengths{hint})")


def group_damage(space: SearchSpace, slot_sensitivity: np.ndarray | None,
                 correction_factor: float = DEFAULT_CORRECTION_FACTOR) -> np.ndarray:
    """Predicted damage of each group at each level: ``float [n_groups, max_levels]`` (inf padding).

    ``slot_sensitivity[slot]`` is the damage of that slot at the lowest candidate bits (from
    the sensitivity profile); ``None`` means every slot equally sensitive.
    ``correction_factor``: damage of a corrected key slot relative to uncorrected.
    """
    n_slots = int(np.prod(space.shape))
    s = np.ones(n_slots) if slot_sensitivity is None else np.asarray(slot_sensitivity, dtype=np.float64).ravel()
    bmin = space.bits[0]
    max_lv = max(g.n_levels for g in space.groups)
    out = np.full((len(space.groups), max_lv), np.inf)
    for gi, g in enumerate(space.groups):
        out[gi, : g.n_levels] = (quantization_damage(g.level_bits, bmin, correction_factor)
                                 * s[g.slots][None, :]).sum(axis=1)
    return out


def closest_feasible_quantizer(model: BpvModel, q: QuantizerSettings, budget: float) -> QuantizerSettings:
    """``q`` if its floor fits, else the feasible setting changing the fewest fields (then the dearest floor,
    i.e. the least aggressive change)."""
    if model.floor(q) <= budget + EPS:
        return q
    feas = model.feasible_quantizers(budget)
    if not feas:
        model.check_budget(budget)
    def rank(c):
        changed = sum(getattr(c, f) != getattr(q, f) for f in Q_FIELDS.values())
        return (changed, -model.floor(c), c.group_size, c.residual_length, c.sink_length, c.recent_length)
    return min(feas, key=rank)


def repair(model: BpvModel, levels, q: QuantizerSettings, budget: float,
           damage: np.ndarray) -> tuple[np.ndarray, QuantizerSettings, bool]:
    """Lower a proposal until it fits ``budget``: returns ``(levels, quantizer, changed)``.

    Groups step down one level at a time, the step with the least predicted damage per
    bpv saved first (a heap; each group's next step depends only on that group).
    """
    levels = np.array(levels, dtype=np.int64)
    q2 = closest_feasible_quantizer(model, q, budget)
    changed = q2 != q
    t = model.terms(q2)
    idx = np.arange(len(levels))
    total = t.const + float(t.group_cost[idx, levels].sum())
    if total <= budget + EPS:
        return levels, q2, changed

    def key(gi):
        lv = levels[gi]
        d_cost = t.group_cost[gi, lv] - t.group_cost[gi, lv - 1]
        d_dmg = damage[gi, lv - 1] - damage[gi, lv]
        if d_cost <= 0:
            return (1, -d_cost, gi)  # saves nothing: last resort
        return (0, d_dmg / d_cost, gi)

    heap = [key(gi) for gi in idx if levels[gi] > 0]
    heapq.heapify(heap)
    while total > budget + EPS and heap:
        _, _, gi = heapq.heappop(heap)
        lv = levels[gi]
        total += t.group_cost[gi, lv - 1] - t.group_cost[gi, lv]
        levels[gi] = lv - 1
        if levels[gi] > 0:
            heapq.heappush(heap, key(gi))
    assert total <= budget + EPS, "repair could not reach a budget the quantizer's floor fits"
    return levels, q2, True


def knapsack_seed(model: BpvModel, q: QuantizerSettings, budget: float, damage: np.ndarray) -> np.ndarray:
    """Greedy multiple-choice knapsack: start at the floor, repeatedly take the upgrade (to any higher
    level) with the most predicted damage removed per bpv spent that still fits; returns levels."""
    t = model.terms(q)
    slack = budget - t.floor
    if slack < -EPS:
        raise BudgetError(f"quantizer {q} cannot reach {budget:g} bpv (floor {t.floor:.4f})")
    return greedy_knapsack(t.group_cost, damage, slack)


def greedy_knapsack(cost: np.ndarray, damage: np.ndarray, slack: float) -> np.ndarray:
    """The greedy of :func:`knapsack_seed` on any ``cost`` / ``damage`` ``[n_groups, n_levels]`` (inf
    padding): every group starts at level 0; ``slack`` is what the upgrades may add to the cost."""
    n = len(cost)
    levels = np.zeros(n, dtype=np.int64)
    idx = np.arange(n)
    cost = np.where(np.isfinite(cost), cost, np.inf)
    dmg = np.where(np.isfinite(damage), damage, np.inf)
    while True:
        d_cost = cost - cost[idx, levels][:, None]  # [n, max_lv]
        with np.errstate(invalid="ignore"):  # inf - inf at padded levels: nan, never ok below
            d_dmg = dmg[idx, levels][:, None] - dmg
        ok = (d_cost > 0) & (d_cost <= slack + EPS) & (d_dmg > 0) & np.isfinite(d_cost)
        if not ok.any():
            break
        ratio = np.where(ok, d_dmg / np.where(ok, d_cost, 1.0), -np.inf)
        gi, lv = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
        slack -= d_cost[gi, lv]
        levels[gi] = lv
    return levels
