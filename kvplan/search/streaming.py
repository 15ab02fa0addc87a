"""Streamed KV heads, chosen before the search (DuoAttention's streaming heads, plans' bits 0).

A streamed head stores no codes: its queries attend to the sink positions, copies of its newest
``stream_window`` committed tokens and the residual (:mod:`kvplan.runtime.cache`). At a 512-token
reference it costs a few hundredths of the bpv its two 2-bit slots cost, a level far below the
2-bit floor that most slots of a 2.5 bpv plan sit on, so the bits it frees buy higher bits for the
heads that need them.

Which heads: the profile measures each full-attention KV head streamed alone, everything else at
full precision (``L07.stream.h2``: the same units as the sensitivity profile's one-unit KLs), and the
search's additive damage model picks them: a knapsack over KV heads whose options are every
(key level, value level) pair of the space and streaming, at the search's budget
(``bench/streaming_heads_probe.py`` measured this choice on the validation split), once two real
evaluations have put the streaming damages on the quantized slots' scale (:func:`calibrate_streaming`;
chosen on validation, ``bench/search.md``). The chosen set is fixed for the whole search (the space's
streamed slots have one level); the search allocates the rest.

Sliding-window layers: a plan may stream their heads where the window holds the copies
(:func:`~kvplan.plans.accounting.stream_fits_window`), but the search does not profile them: on
Gemma-3-270M, letting it (all 15 local layers profiled, two streamed) read validation KL 0.0501
against 0.0403 without (``bench/gemma3.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Mapping

import numpy as np

from ..kernels.qtypes import FULL_PRECISION_BITS, STREAMED
from ..models.geometry import Geometry
from ..plans import Plan, Provenance, QuantizerSettings, Reference
from ..plans.accounting import committed_length, stream_tokens
from .budget import BpvModel, greedy_knapsack, group_damage
from .sensitivity import ResumableMeasurements, correction_factor, profile_quantizer, slot_sensitivity
from .space import SearchSpace


def stream_key(layer: int, head: int) -> str:
    """Profile entry of a KV head streamed alone."""
    return f"L{layer:02d}.stream.h{head}"


def stream_sink(space: SearchSpace) -> int:
    """Sink positions the streaming profile keeps: the space's smallest positive sink length (a streamed
    head without an attention sink loses much more; DuoAttention's streaming heads keep one), else 0."""
    return min([s for s in space.sink_lengths if s > 0], default=0)


def searched_stream_heads(geometry: Geometry) -> list[tuple[int, int]]:
    """The ``(layer, KV head)``s the search profiles streamed and may stream: every head of a full-attention
    layer (a plan may stream heads of sliding layers, the search does not: module docstring)."""
    return [(layer, head) for layer in range(geometry.num_layers) if geometry.layer_types[layer] == "full"
            for head in range(geometry.num_kv_heads)]


def streaming_plans(space: SearchSpace, reference: Reference, stream_window: int) -> dict[str, Plan]:
    """One plan per KV head of :func:`searched_stream_heads`: that head streamed, every other slot at 16 bits,
    with the sink of :func:`stream_sink`."""
    q = replace(profile_quantizer(space), stream_window=stream_window, sink_length=stream_sink(space))
    plans = {}
    for layer, head in searched_stream_heads(space.geometry):
        table = np.full(space.shape, FULL_PRECISION_BITS, dtype=np.int64)
        table[layer, head] = STREAMED
        plans[stream_key(layer, head)] = space.plan_of_table(
            table, q, reference, provenance=Provenance(produced_by="kvplan search profile"))
    return plans


def run_streaming_profile(score: Callable[[Plan], Mapping], space: SearchSpace, reference: Reference,
                          stream_window: int, progress: Callable[[int, int], None] | None = None,
                          done: Mapping[str, float] | None = None,
                          save: Callable[[dict[str, float]], None] | None = None) -> dict[str, float]:
    """KL of each full-attention KV head streamed alone (:func:`streaming_plans`); ``done`` / ``save``:
    measurements an interrupted run saved, and where to save them (:class:`.ResumableMeasurements`)."""
    plans = streaming_plans(space, reference, stream_window)
    run = ResumableMeasurements(score, len(plans), done, save, progress)
    run.measure(plans)
    return run.finish()


# profile entries of the streaming calibration (:func:`calibrate_streaming`)
STREAM_SCALE_KEY = "streaming.scale"
STREAM_PARTS_KEYS = ("streaming.quantized_part", "streaming.streamed_part")


def streaming_parts(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A slot-code table ``[L, H_kv, 2, M]`` with streamed heads split in two: its quantized slots alone (the
    streamed heads at 16 bits) and its streamed heads alone (every other slot at 16 bits)."""
    streamed = table == STREAMED
    return (np.where(streamed, FULL_PRECISION_BITS, table), np.where(streamed, STREAMED, FULL_PRECISION_BITS))


@dataclass
class StreamingOptimum:
    """The damage model's best plan with streamed heads at a budget (:func:`streaming_optimum`)."""

    predicted: float  # its predicted damage (streaming damages scaled as asked)
    heads: list[tuple[int, int]]  # the streamed (layer, KV head)s
    quantizer: QuantizerSettings  # the quantizer setting it was found for
    table: np.ndarray  # its slot codes [L, H_kv, 2, M] (STREAMED for the streamed heads)
    quantized_damage: float  # predicted damage of its quantized slots
    streamed_damage: float  # the profile's damage of its streamed heads, unscaled


def streaming_optimum(space: SearchSpace, reference: Reference, profile: Mapping[str, float], stream_window: int,
                      budget: float, stream_scale: float = 1.0) -> StreamingOptimum | None:
    """The damage model's optimum over KV heads at ``budget``: for each quantizer setting of ``space`` the
    greedy knapsack over heads (options: every key level x value level of the head's slots, and
    streaming, at its measured damage times ``stream_scale`` and its window copies' cost), over the
    settings that keep at least the sink the damage was measured with; the setting whose optimum has
    the least predicted damage. ``None`` when nothing is measured or no setting fits."""
    if space.granularity != "slot" or not any(k.startswith("L") and ".stream.h" in k for k in profile):
        return None
    model = BpvModel(space, reference)
    damage = group_damage(space, slot_sensitivity(space, profile), correction_factor(profile))
    g = space.geometry
    L, H, _, M = space.shape
    slot_group = {}
    for gi, grp in enumerate(space.groups):
        (s,) = grp.slots
        layer, head, kind, mod = np.unravel_index(int(s), space.shape)
        slot_group[layer, head, kind, mod] = gi
    heads = {(l, h) for l in range(L) for h in range(H) if stream_key(l, h) in profile}
    best = None
    for q in space.quantizers():
        if q.sink_length < stream_sink(space):  # the streaming damage was measured with that sink
            continue
        terms = model.terms(q)
        C = committed_length(reference.context_len, q.residual_length, q.group_size)
        fp_bytes = reference.full_precision_bits // 8
        copy_cost = (8.0 * 2 * stream_tokens(C, stream_window, q.recent_length, q.sink_length)
                     * q.residual_token_bytes(g.head_dim, fp_bytes) / model.n_values(q))  # K and V of one head
        options = []  # per (layer, head): [(cost, damage, (key level, value level) or None: streamed)]
        for l in range(L):
            for h in range(H):
                gk = [slot_group[l, h, 0, m] for m in range(M)]
                gv = [slot_group[l, h, 1, m] for m in range(M)]
                opts = [(sum(terms.group_cost[gi, lk] for gi in gk) + sum(terms.group_cost[gi, lv] for gi in gv),
                         sum(damage[gi, lk] for gi in gk) + sum(damage[gi, lv] for gi in gv), (lk, lv))
                        for lk in range(space.groups[gk[0]].n_levels) for lv in range(space.groups[gv[0]].n_levels)]
                if (l, h) in heads:
                    opts.append((copy_cost, stream_scale * float(max(profile[stream_key(l, h)], 0.0)), None))
                options.append(sorted(opts, key=lambda o: (o[0], o[1])))
        n = max(len(o) for o in options)
        cost = np.full((len(options), n), np.inf)
        dmg = np.full((len(options), n), np.inf)
        for i, opts in enumerate(options):
            for j, (c, d, _) in enumerate(opts):
                cost[i, j], dmg[i, j] = c, d
        slack = budget - terms.const - float(cost[:, 0].sum())
        if slack < 0:
            continue
        choice = greedy_knapsack(cost, dmg, slack)
        predicted = float(dmg[np.arange(len(options)), choice].sum())
        if best is not None and predicted >= best.predicted:
            continue
        levels = np.zeros(len(space.groups), dtype=np.int64)
        streamed, quantized_damage, streamed_damage = [], 0.0, 0.0
        for i, j in enumerate(choice):
            l, h = divmod(i, H)
            lk_lv = options[i][j][2]
            if lk_lv is None:
                streamed.append((l, h))
                streamed_damage += float(max(profile[stream_key(l, h)], 0.0))
                continue
            quantized_damage += options[i][j][1]
            for m in range(M):
                levels[slot_group[l, h, 0, m]], levels[slot_group[l, h, 1, m]] = lk_lv
        table = space.table_of_levels(levels)
        for l, h in streamed:
            table[l, h] = STREAMED
        best = StreamingOptimum(predicted, streamed, q, table, quantized_damage, streamed_damage)
    return best


def choose_streamed(space: SearchSpace, reference: Reference, profile: Mapping[str, float], stream_window: int,
                    budget: float) -> list[tuple[int, int]]:
    """The KV heads the damage model streams at ``budget`` (:func:`streaming_optimum`), the streaming
    damages scaled by the profile's calibration (``STREAM_SCALE_KEY``, :func:`calibrate_streaming`; 1
    without it). ``[]`` when streaming pays nowhere (or nothing is measured)."""
    opt = streaming_optimum(space, reference, profile, stream_window, budget,
                            float(profile.get(STREAM_SCALE_KEY, 1.0)))
    return [] if opt is None else opt.heads


def calibrate_streaming(score: Callable[[Plan], Mapping], space: SearchSpace, reference: Reference,
                        profile: Mapping[str, float], stream_window: int, budget: float,
                        done: Mapping[str, float] | None = None,
                        save: Callable[[dict[str, float]], None] | None = None) -> dict[str, float]:
    """Put the streaming damages on the scale of the quantized slots' damage, by two real evaluations.

    The two come from different extrapolations: a streamed head's damage is measured as it is used
    (the head streamed alone), a quantized slot's is its 2-bit unit's share, scaled to its level by
    the prior; on the default model the prior overstates the quantized slots of a whole plan 1.5-2.7x
    (by quantizer setting) while the streamed heads' damages add up as measured
    (``bench/damage_additivity.py``), so the uncalibrated model streams too many heads. Both parts of the
    damage model's optimum (:func:`streaming_parts`) are scored; the scale is ``(measured / predicted streamed) / (measured / predicted quantized)``, clipped to
    ``[1/16, 16]``. Returns the profile entries (``STREAM_SCALE_KEY``, ``STREAM_PARTS_KEYS``); ``{}``
    when the optimum streams no head or every head (nothing to compare). ``done`` / ``save``: what an
    interrupted run measured, and where each new evaluation is saved (:class:`ResumableMeasurements`)."""
    opt = streaming_optimum(space, reference, profile, stream_window, budget)
    if opt is None or not opt.heads or opt.quantized_damage <= 0 or opt.streamed_damage <= 0:
        return {}
    q = replace(opt.quantizer, stream_window=stream_window)
    prov = Provenance(produced_by="kvplan search profile")
    # each evaluation is a whole plan's: saved one by one
    run = ResumableMeasurements(score, len(STREAM_PARTS_KEYS), done, save, save_every=1)
    run.measure({name: space.plan_of_table(table, q, reference, provenance=prov)
                 for name, table in zip(STREAM_PARTS_KEYS, streaming_parts(opt.table))})
    out = run.finish()
    quantized, streamed_kl = (max(out[k], 0.0) for k in STREAM_PARTS_KEYS)
    if quantized <= 0:
        return out
    scale = (streamed_kl / opt.streamed_damage) / (quantized / opt.quantized_damage)
    out[STREAM_SCALE_KEY] = float(np.clip(scale, 1 / 16, 16))
    return out
