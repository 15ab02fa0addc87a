"""The explanation of a plan as one JSON-able dict: every number the text, the figures and
the HTML page show comes from here."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Sequence

import numpy as np

from ..errors import KVPlanError
from ..plans import KINDS, Plan, layout_labels, plan_bytes, split_codes, uniform_plan
from ..plans.accounting import stored_tokens
from ._sidecars import QUANTIZER_COLUMNS, TrialHistory, match_run, number, read_search, read_trials, show

CONTEXT_LENGTHS = (300, 1000, 1024, 4096, 32768, 131072)  # include lengths between group boundaries
BATCH_SIZES = (1,)
MAX_CONTEXT = 2**20  # --context above this is refused (the accounting walks every token)
MAX_BATCH = 2**16
CURVE_MAX = 131072
UNIFORM_BITS = (2, 4, 8)  # uniform baselines drawn on the bpv-vs-context curve
# (key in plan.metrics, label); ``test`` was called ``heldout`` in older plans
SPLITS = (("calibration", "calibration"), ("validation", "validation"), ("test", "test (held-out)"))
GIB = 2**30


class ExplainError(KVPlanError):
    """``kvplan explain`` was given an option it cannot use (bad context length, unwritable output)."""


def _sidecars(plan_path: str) -> dict[str, str]:
    from ..plans._files import plan_sidecar_paths

    return plan_sidecar_paths(plan_path)


def check_sizes(context_lengths: Sequence[int], batch_sizes: Sequence[int]) -> None:
    """Raise :class:`ExplainError` for a context length or batch size out of range."""
    for name, vals, hi in (("--context", context_lengths, MAX_CONTEXT), ("--batch", batch_sizes, MAX_BATCH)):
        for v in vals:
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v <= hi:
                raise ExplainError(f"{name}: must be an integer from 1 to {hi} (got {show(v)})")


# ----------------------------------------------------------------------------- memory and bpv
def modality_mixes(plan: Plan) -> dict[str, dict[str, float]]:
    """The reference mix and, for a multi-modality plan, each modality alone (``all text``...)."""
    mixes = {"reference": dict(plan.reference.modality_mix)}
    if len(plan.modalities) > 1:
        mixes.update({f"all {m}": {m: 1.0} for m in plan.modalities})
    return mixes


def cache_bytes(plan: Plan, context_len: int, modality_mix=None, batch: int = 1) -> int:
    """Bytes the runtime cache holds for ``batch`` sequences of ``context_len`` tokens, laid out as
    :meth:`Plan.bpv` lays them (no mix: the reference, its measured layout at the reference length)."""
    fp_bytes = plan.reference.full_precision_bits // 8
    labels = layout_labels(context_len, plan.bpv_layout(context_len, modality_mix))
    parts = plan_bytes(plan, plan.geometry, labels, batch, fp_bytes)
    return int(sum(parts.values()))


def _n_values(plan: Plan, context_len: int) -> int:
    """Values the runtime cache holds (sliding-window layers: their kept window)."""
    g = plan.geometry
    return g.num_kv_heads * 2 * g.head_dim * stored_tokens(g, context_len, plan.quantizer.group_size)


def _fp_cache_values(plan: Plan, context_len: int) -> int:
    """Values the model's own cache (``DynamicCache``) holds: sliding-window layers keep the newest
    ``window - 1`` tokens."""
    g = plan.geometry
    tokens = sum(context_len if g.window(i) is None else min(context_len, g.window(i) - 1)
                 for i in range(g.num_layers))
    return g.num_kv_heads * 2 * g.head_dim * tokens


def memory_rows(plan: Plan, context_lengths, batch_sizes) -> list[dict[str, Any]]:
    """KV-cache bytes and GiB of the plan next to the unquantized cache, per (context length, batch size):
    ``fp16_bytes`` / ``fp16_gib`` hold it at the reference's ``full_precision_bits`` (fp32 too)."""
    fpb = plan.reference.full_precision_bits
    rows = []
    for T in context_lengths:
        one = cache_bytes(plan, T)
        for B in batch_sizes:
            fp = _fp_cache_values(plan, T) * B * fpb // 8
            rows.append({"context_len": T, "batch": B, "bpv": 8 * one / _n_values(plan, T), "bytes": one * B,
                         "gib": one * B / GIB, "fp16_bytes": fp, "fp16_gib": fp / GIB,
                         "saved_fraction": 1 - one * B / fp})
    return rows


def mix_rows(plan: Plan, context_lengths) -> list[dict[str, Any]]:
    """Honest bpv per context length at each of :func:`modality_mixes` (``reference``: as
    :meth:`Plan.bpv` counts it, the measured layout at the reference length)."""
    mixes = modality_mixes(plan)
    rows = []
    for T in context_lengths:
        row: dict[str, Any] = {"context_len": T}
        for name, m in mixes.items():
            row[name] = plan.bpv(context_len=T, modality_mix=None if name == "reference" else m).total
        rows.append(row)
    return rows


def curve_lengths(plan: Plan, extra: Sequence[int] = (), max_len: int = CURVE_MAX) -> list[int]:
    """Context lengths for the bpv curve: every token up to a few groups, then both sides of
    every group boundary up to 4096 tokens, then log-spaced pairs around boundaries, and ``extra``."""
    q = plan.quantizer
    G, R = q.group_size, q.residual_length
    pts = set(range(1, min(max_len, max(256, R + 2 * G)) + 1))
    b = R + G
    while b <= min(4096, max_len):
        pts.update((b - 1, b, b + G // 2))
        b += G
    for x in np.geomspace(256, max_len, 120):
        c = R + G * max(1, round((x - R) / G))
        pts.update(v for v in (int(x), c - 1, c) if 1 <= v <= max_len)
    pts.update((plan.reference.context_len, *extra))
    return sorted(p for p in pts if p <= max_len)


def _plain_quantizer(q) -> str:
    rb = "" if q.residual_bits == 16 else f", residual {q.residual_bits}-bit"
    rc = f", {q.recent_length} recent copies" if q.recent_length else ""
    hc = f", {q.heavy_length} heavy-hitter copies" if q.heavy_length else ""
    sb = f" ({q.sink_bits}-bit)" if q.sink_length and q.sink_bits != 16 else ""
    return f"g{q.group_size}, r{q.residual_length}, s{q.sink_length}{sb}{rb}{rc}{hc}"


def bpv_curve(plan: Plan, extra: Sequence[int] = ()) -> dict[str, Any]:
    """bpv against context length for the plan, full precision and uniform plans with the plan's quantizer."""
    Ts = curve_lengths(plan, extra)
    q = plan.quantizer
    series = [{"label": "this plan", "bpv": [plan.bpv(context_len=T).total for T in Ts]},
              {"label": f"fp{plan.reference.full_precision_bits}",
               "bpv": [float(plan.reference.full_precision_bits)] * len(Ts)}]
    for b in UNIFORM_BITS:
        u = uniform_plan(plan.geometry, b, b, group_size=q.group_size, residual_length=q.residual_length,
                         key_axis=q.key_axis, value_axis=q.value_axis, sink_length=q.sink_length,
                         modalities=plan.modalities, reference=plan.reference)
        # the plan's slot formats (their scales cost what they cost in the plan), residual and
        # window copies: every field the label names
        u = u.replace(quantizer=dataclasses.replace(u.quantizer, key_scaling=q.key_scaling,
                                                    value_scaling=q.value_scaling, codebooks=q.codebooks,
                                                    residual_bits=q.residual_bits, sink_bits=q.sink_bits,
                                                    recent_length=q.recent_length, heavy_length=q.heavy_length))
        series.append({"label": f"uniform int{b} ({_plain_quantizer(q)})",
                       "bpv": [u.bpv(context_len=T).total for T in Ts]})
    ref = plan.reference.context_len
    return {"context_len": Ts, "series": series, "reference": {"context_len": ref, "bpv": plan.bpv().total},
            "target_bpv": plan.target_bpv}


# ----------------------------------------------------------------------------- allocation
def allocation(plan: Plan) -> dict[str, Any]:
    """Per-slot bits, corrected and protected slots, and their summaries."""
    g = plan.geometry
    codes = plan.code_table()  # [L, H, 2, M]
    table, corrected = split_codes(codes)
    mods = list(plan.modalities)
    med = float(np.median(table))
    alloc: dict[str, Any] = {
        "bits_used": sorted(int(b) for b in np.unique(table)),
        "mean_bits": {kind: float(table[:, :, k].mean()) for k, kind in enumerate(KINDS)},
        "per_modality": {m: {kind: float(table[:, :, k, i].mean()) for k, kind in enumerate(KINDS)}
                         for i, m in enumerate(mods)},
        "per_layer": [{"layer": l, "type": g.layer_types[l], "k": float(table[l, :, 0].mean()),
                       "v": float(table[l, :, 1].mean())} for l in range(g.num_layers)],
        "histogram": {kind: {str(int(b)): int((table[:, :, k] == b).sum()) for b in np.unique(table)}
                      for k, kind in enumerate(KINDS)},
        "median_bits": med,
        # bits[layer][head][kind][modality] and the same shape of booleans
        "bits": table.tolist(),
        "corrected": corrected.tolist(),
    }
    alloc["protected"] = [{"layer": int(l), "head": int(h), "kind": KINDS[k], "modality": mods[i],
                           "bits": int(table[l, h, k, i])}
                          for l, h, k, i in zip(*np.nonzero((table >= 8) & (table > med)))]
    alloc["corrected_keys"] = [{"layer": int(l), "head": int(h), "modality": mods[int(i)]}
                               for l, h, k, i in zip(*np.nonzero(corrected))]
    return alloc


# ----------------------------------------------------------------------------- metrics
def measured(metrics, warnings: list[str]) -> list[dict[str, Any]]:
    """The plan's measured splits with numeric values only; other values become warnings."""
    out = []
    for key, label in SPLITS:
        d = metrics.get(key)
        if key == "test" and d is None:
            key, d = "heldout", metrics.get("heldout")
        if d is None:
            continue
        if not isinstance(d, dict):
            warnings.append(f"plan metrics.{key}: not shown: not a mapping (got {show(d)})")
            continue
        row: dict[str, Any] = {"split": key, "label": label}
        for name, v in d.items():
            f = number(v)
            if f is not None and not isinstance(v, str):
                row[name] = f
            else:
                warnings.append(f"plan metrics.{key}.{name}: not shown: not a number (got {show(v)})")
        out.append(row)
    return out


# ----------------------------------------------------------------------------- history
def baseline_labels(hist: TrialHistory) -> dict[int, str]:
    """Distinct labels of the baseline trials (row index -> label): baselines with the same
    name get every quantizer field in which they differ, then the trial number if still equal."""
    idx = [i for i, s in enumerate(hist.source) if s.startswith("baseline:")]
    labels = {i: hist.source[i][len("baseline:"):] for i in idx}
    for name in set(labels.values()):
        group = [i for i in idx if labels[i] == name]
        if len(group) < 2:
            continue
        varied = [k for k in QUANTIZER_COLUMNS if len({hist.quantizer[k][i] for i in group}) > 1]
        for i in group:
            labels[i] = name + "".join(f" {k}={hist.quantizer[k][i]}" for k in varied)
        seen: dict[str, list[int]] = {}
        for i in group:
            seen.setdefault(labels[i], []).append(i)
        for same in seen.values():
            if len(same) > 1:
                for i in same:
                    labels[i] += f" #{hist.number[i] if hist.number[i] is not None else i}"
    return labels


def history_section(hist: TrialHistory, search: dict | None) -> dict[str, Any]:
    from ..search._search import pareto_front

    pts = [(k, b, i) for i, (k, b) in enumerate(zip(hist.kl, hist.bpv)) if b is not None]
    front = pareto_front([(k, b) for k, b, _ in pts])
    labels = baseline_labels(hist)
    points = [{"kl": k, "bpv": b, "source": hist.source[i], "number": hist.number[i]} for k, b, i in pts]
    best, run = math.inf, []
    for n, k in enumerate(hist.kl):  # running best calibration KL in trial order
        best = min(best, k)
        run.append({"trial": hist.number[n] if hist.number[n] is not None else n, "kl": k, "best_kl": best,
                    "source": hist.source[n]})
    sec = {"trials_csv": hist.path, "n_trials": len(hist), "n_rows": hist.n_rows,
           "points": points, "pareto": [points[i] for i in front],
           "baselines": [{**points[j], "label": labels[i]} for j, (_, _, i) in enumerate(pts) if i in labels],
           "progress": run}
    if search and search.get("budgets"):
        sec["budgets"] = [float(b) for b in search["budgets"]]
    return sec


def _importance(hist: TrialHistory, mods, shape, seed: int) -> dict[str, Any] | str:
    """The consensus importance section, or why the history cannot rank anything (a ``missing:`` line)."""
    from ..surrogates import component_importance, importance_from_history
    from ..surrogates.forest import KL_FLOOR, log_kl
    from ._direction import slot_direction

    q_fields = {k: hist.quantizer[k] for k in ("group_size", "residual_length", "key_axis", "sink_length",
                                               "recent_length")}
    imp = importance_from_history(hist.codes, q_fields, hist.kl, mods, seed=seed)
    if not imp.consensus.any():  # a constant KL or no varied column: nothing to attribute
        if np.ptp(np.asarray(hist.kl, dtype=np.float64)) == 0:
            why = f"the calibration KL is {hist.kl[0]:.4g} in all {len(hist)} trials"
        elif np.ptp(log_kl(hist.kl)) == 0:  # what the forest predicts: log KL, floored
            why = f"the calibration KL is at most the surrogate's floor {KL_FLOOR:g} in all {len(hist)} trials"
        else:
            why = f"no slot's bits and none of {', '.join(q_fields)} vary across the {len(hist)} trials"
        return f"consensus importance ({why}: nothing to rank)"
    comp = component_importance(imp, shape, mods)
    # slots whose bits never changed across the trials hold no information: left out of the rankings
    varied = {n[len("slot:"):] for n, v in zip(imp.names, imp.varied) if v and n.startswith("slot:")}
    fixed = [n for n in comp["slot"] if n not in varied]
    varied_heads = {n.rsplit(".", 2)[0] for n in varied}
    top_slots = dict(sorted(((n, v) for n, v in comp["slot"].items() if n in varied), key=lambda kv: -kv[1])[:15])
    return {
        "units": "% of consensus importance (impurity, permutation on held-out trials and |SHAP| of a random "
                 "forest predicting log-KL from log2 bits per slot, each normalized to 100%, averaged)",
        "n_trials": imp.n_trials, "oob_r2": imp.r2_oob, "methods": list(imp.methods),
        "no_fit": imp.r2_oob is not None and imp.r2_oob <= 0,  # the forest predicts no better than the mean
        "kind": comp["kind"], "modality": comp["modality"], "layer": comp["layer"],
        "head": dict(sorted(((h, v) for h, v in comp["head"].items() if h in varied_heads),
                            key=lambda kv: -kv[1])[:12]),
        "not_varied": {"slots": len(fixed), "of": len(comp["slot"]),
                       "heads": sorted(h for h in comp["head"] if h not in varied_heads)},
        "quantizer": comp["quantizer"], "top_slots": top_slots,
        "per_method_kind": {m: {kind: float(100 * sum(v for n, v in zip(imp.names, arr)
                                                     if n.startswith("slot:") and f".{kind}." in n))
                                for kind in KINDS} for m, arr in imp.methods.items()},
        "direction": slot_direction(hist, q_fields, mods, list(top_slots), seed=seed),
    }


def _history_gaps(hist: TrialHistory, metrics: dict) -> list[str]:
    """Warnings for a trial history that lacks trials the plan's search recorded (rows cut off or deleted):
    the importance and the Pareto front then rest on part of the search."""
    search = metrics.get("search") if isinstance(metrics.get("search"), dict) else {}
    out = []
    recorded = number(search.get("n_trials"))
    if recorded is not None and hist.n_rows < recorded:
        out.append(f"{hist.path}: holds {hist.n_rows} trial rows of the {int(recorded)} the search recorded "
                   f"(metrics.search.n_trials): cut off or edited? the importance and the Pareto front use its "
                   f"{len(hist)} usable trials")
    trial = search.get("trial")
    if isinstance(trial, int) and not isinstance(trial, bool) and trial not in hist.number:
        out.append(f"{hist.path}: the plan's own trial {trial} (metrics.search.trial) is not among its rows")
    return out


# ----------------------------------------------------------------------------- report
def report(plan_path, importance: bool = True, seed: int = 0, context_lengths: Sequence[int] | None = None,
           batch_sizes: Sequence[int] | None = None) -> dict[str, Any]:
    """The explanation as a JSON-able dict (what :func:`kvplan.explain.explain` renders).

    Corrupt optional sidecars (``.trials.csv``, ``.search.json``) are ignored with a line in
    ``warnings`` naming the file and the problem; the plan itself must be valid.
    """
    plan_path = os.fspath(plan_path)
    context_lengths = list(context_lengths if context_lengths else CONTEXT_LENGTHS)
    batch_sizes = list(batch_sizes if batch_sizes else BATCH_SIZES)
    check_sizes(context_lengths, batch_sizes)
    plan = Plan.from_yaml(plan_path)
    g = plan.geometry
    ref = plan.reference
    mods = list(plan.modalities)
    warnings: list[str] = []
    rep: dict[str, Any] = {"plan": plan_path, "name": plan.name, "missing": [], "warnings": warnings}
    rep["model"] = {"model_type": g.model_type, "num_layers": g.num_layers, "num_kv_heads": g.num_kv_heads,
                    "head_dim": g.head_dim, "layer_types": list(g.layer_types), "sliding_window": g.sliding_window,
                    "fingerprint": g.fingerprint}
    rep["modalities"] = mods
    rep["labelling"] = plan.labelling  # the token labelling it was searched with (kvplan.Labelling name)
    rep["quantizer"] = dataclasses.asdict(plan.quantizer)
    rep["error_feedback"] = plan.feedback_metric is not None  # slot codes chosen by error feedback
    rep["provenance"] = dataclasses.asdict(plan.provenance)
    rep["budget"] = {"target_bpv": plan.target_bpv,
                     "reference": {"context_len": ref.context_len, "modality_mix": dict(ref.modality_mix),
                                   "full_precision_bits": ref.full_precision_bits},
                     "bpv": plan.bpv().as_dict()}
    lengths = sorted(set(context_lengths) | {ref.context_len})
    rep["memory"] = memory_rows(plan, lengths, batch_sizes)
    rep["bpv_by_mix"] = {"mixes": modality_mixes(plan), "rows": mix_rows(plan, lengths)}
    rep["bpv_curve"] = bpv_curve(plan, lengths)
    rep["allocation"] = allocation(plan)
    rep["metrics"] = dict(plan.metrics)
    rep["measured"] = measured(plan.metrics, warnings)
    edited = plan.edited_note()
    warnings.extend(f"plan {note}" for note in (edited, plan.over_target_note()) if note)
    # measurements of another version of this plan: shown as such, never as this plan's numbers
    rep["measured_elsewhere"] = edited is not None
    if not plan.metrics:
        rep["missing"].append("measured metrics (the plan has none; produce it with kvplan search)")

    side = _sidecars(plan_path)
    search = read_search(side["search"], warnings)
    hist = read_trials(side["trials"], plan.code_table().shape, warnings)
    search, hist = match_run(plan.metrics, search, hist, side, warnings)  # one set, or a warning
    rep["history"] = {"trials_csv": side["trials"] if hist else None}
    if hist is None:
        why = "not found" if not os.path.exists(side["trials"]) else "unusable, see the warnings"
        rep["missing"].append(f"trial history ({side['trials']} {why}): no consensus importance and no "
                              "Pareto front; run kvplan search with --out next to this plan to produce it")
    else:
        warnings.extend(_history_gaps(hist, plan.metrics))
        rep["history"] = history_section(hist, search)
        if hist.hosts:
            rep["history"]["measured_on"] = dict(hist.hosts)  # host -> trials (several workers)
        if importance and len(hist) >= 5:
            imp = _importance(hist, mods, plan.code_table().shape, seed)
            if isinstance(imp, str):
                rep["missing"].append(imp)
            else:
                rep["importance"] = imp
        elif importance:
            rep["missing"].append(f"consensus importance (only {len(hist)} trials in the history; need >= 5)")
    if search:
        rep["search"] = {k: search[k] for k in ("space", "budgets", "seed", "study_name", "profile") if k in search}
    return rep


__all__ = ["BATCH_SIZES", "CONTEXT_LENGTHS", "ExplainError", "report"]
