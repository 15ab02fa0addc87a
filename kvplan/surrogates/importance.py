"""Consensus importance of plan components (source document 4).

A random forest is fit on the trial history (per-slot bits as ``log2(bits)`` plus the
varied plan-wide quantizer fields -> log-KL). Importance is computed three ways:

1. impurity (mean decrease in impurity, ``feature_importances_``),
2. ``sklearn.inspection.permutation_importance`` on held-out trials: over K folds, a forest
   fit on the other folds is permuted on the held-out one (the forest's own training rows
   credit columns it memorized: 15% of the importance went to irrelevant slots that way, 10%
   held out, in a synthetic history); ``n_repeats`` sized so the run stays within a few
   seconds; negative means are clipped to 0,
3. mean ``|SHAP|`` from ``shap.TreeExplainer``.

Each is normalized to sum 1 and the three are summed (then divided by 3): the consensus,
reported as percentages per slot and per component group (K vs V, modality, layer,
physical KV head, quantizer field). A method that finds nothing (all 0) stays all 0 and
the consensus averages the others; with no varied column or a constant target every
method and the consensus are all 0: there is nothing to attribute.

Columns identical across all trials (e.g. every slot of one searched group in a coarse
granularity) are merged before fitting and their importance is split evenly between
them afterwards; constant columns get 0 and are marked not ``varied`` (no data: a report leaves
them out of its rankings instead of ranking them last).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import numpy as np
from sklearn.ensemble import RandomForestRegressor
from sklearn.inspection import permutation_importance

from ..plans import KINDS
from .features import bits_feature, slot_names
from .forest import log_kl

METHODS = ("impurity", "permutation", "shap")


@dataclass
class Importance:
    """Per-feature importance (fractions summing to 1 per method and for the consensus; all 0 where
    nothing was found)."""

    names: list[str]
    methods: dict[str, np.ndarray]
    consensus: np.ndarray
    n_trials: int
    r2_oob: float | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    varied: np.ndarray | None = None  # [F] bool: the feature took more than one value across the trials

    def ranking(self, top: int | None = None) -> list[tuple[str, float]]:
        """``(name, percent)`` by decreasing consensus importance."""
        order = np.argsort(-self.consensus, kind="stable")
        out = [(self.names[i], 100.0 * float(self.consensus[i])) for i in order]
        return out[:top] if top else out


def _normalize(v: np.ndarray) -> np.ndarray:
    """Shares summing to 1 (negative entries count 0), or all 0 when nothing is positive."""
    v = np.clip(np.nan_to_num(np.asarray(v, dtype=np.float64)), 0, None)
    s = v.sum()
    return v / s if s > 0 else np.zeros_like(v)


def consensus_importance(X: np.ndarray, y: np.ndarray, names: list[str], seed: int = 0, n_estimators: int = 200,
                         n_repeats: int | None = None, time_budget_s: float = 20.0) -> Importance:
    """Fit a forest on ``X -> y`` and return the three normalized importances and their consensus."""
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n, F = X.shape
    # merge identical columns, drop constant ones
    is_varied = X.std(axis=0) > 0
    uniq: dict[bytes, list[int]] = {}
    for j in np.nonzero(is_varied)[0]:
        uniq.setdefault(X[:, j].tobytes(), []).append(int(j))
    reps = [cols[0] for cols in uniq.values()]
    if not reps or n < 3 or not np.ptp(y) > 0:  # nothing varies, or nothing to explain
        z = np.zeros(F)
        return Importance(list(names), {m: z.copy() for m in METHODS}, z, n, varied=is_varied)
    Xr = X[:, reps]
    times = {}
    t0 = time.perf_counter()
    rf = RandomForestRegressor(n_estimators=n_estimators, random_state=seed, max_features=0.5,
                               oob_score=n >= 10, n_jobs=None).fit(Xr, y)
    times["fit"] = time.perf_counter() - t0
    imp = {"impurity": _normalize(rf.feature_importances_)}
    t0 = time.perf_counter()
    if n_repeats is None:
        # one permutation pass costs about one forest prediction per column
        t_pred = time.perf_counter()
        rf.predict(Xr)
        t_pred = time.perf_counter() - t_pred
        n_repeats = int(np.clip(time_budget_s * 0.5 / max(t_pred * len(reps), 1e-6), 2, 10))
    imp["permutation"] = _normalize(_held_out_permutation(Xr, y, seed, n_estimators, n_repeats))
    times["permutation"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    import shap

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sv = shap.TreeExplainer(rf).shap_values(Xr, check_additivity=False)
    imp["shap"] = _normalize(np.abs(np.asarray(sv)).mean(axis=0))
    times["shap"] = time.perf_counter() - t0
    full = {}
    for m, v in imp.items():
        out = np.zeros(F)
        for cols, val in zip(uniq.values(), v):
            out[cols] = val / len(cols)
        full[m] = out
    found = [m for m in METHODS if full[m].any()]
    consensus = sum(full[m] for m in found) / len(found) if found else np.zeros(F)
    r2 = float(rf.oob_score_) if n >= 10 else None
    return Importance(list(names), full, consensus, n, r2, times, varied=is_varied)


def _held_out_permutation(X: np.ndarray, y: np.ndarray, seed: int, n_estimators: int, n_repeats: int) -> np.ndarray:
    """Mean permutation importance ``[F]`` over folds: each fold's trials permuted under a forest fit on the
    other folds (3 folds, 2 below 6 trials)."""
    from sklearn.model_selection import KFold

    n_folds = 3 if len(y) >= 6 else 2
    total = np.zeros(X.shape[1])
    for train, test in KFold(n_folds, shuffle=True, random_state=seed).split(X):
        rf = RandomForestRegressor(n_estimators=n_estimators, random_state=seed, max_features=0.5).fit(X[train],
                                                                                                     y[train])
        with warnings.catch_warnings():  # a fold whose held-out KL is constant scores nan: it counts 0
            warnings.simplefilter("ignore")
            perm = permutation_importance(rf, X[test], y[test], n_repeats=n_repeats, random_state=seed)
        total += np.nan_to_num(perm.importances_mean)
    return total / n_folds


def history_features(tables: np.ndarray, q_fields: dict[str, list], modalities) -> tuple[np.ndarray, list[str]]:
    """Importance features: ``log2`` bits per slot (:func:`bits_feature`) + each quantizer field that varies."""
    N = tables.shape[0]
    X = [bits_feature(tables.reshape(N, -1))]
    names = ["slot:" + s for s in slot_names(tables.shape[1:], modalities)]
    for name, vals in q_fields.items():
        vals = list(vals)
        if len(set(vals)) <= 1:
            continue
        if name == "key_axis":
            X.append((np.asarray(vals) == "channel").astype(np.float64)[:, None])
        else:
            X.append(np.asarray(vals, dtype=np.float64)[:, None])
        names.append("q." + name)
    return np.concatenate(X, axis=1), names


def importance_from_history(tables, q_fields, kl, modalities, seed: int = 0, **kwargs) -> Importance:
    X, names = history_features(np.asarray(tables), q_fields, modalities)
    return consensus_importance(X, log_kl(kl), names, seed=seed, **kwargs)


def component_importance(imp: Importance, shape, modalities) -> dict[str, dict[str, float]]:
    """Consensus percentages per component group: ``kind`` (K vs V), ``modality``, ``layer``,
    ``head`` (physical KV head ``L03.H1``), ``quantizer`` (plan-wide fields), and ``slot``."""
    L, H, _, M = shape
    slot = np.zeros(shape)
    qpart: dict[str, float] = {}
    for name, v in zip(imp.names, imp.consensus):
        if name.startswith("slot:"):
            l, h, k, m = name[5:].split(".", 3)
            slot[int(l[1:]), int(h[1:]), KINDS.index(k), list(modalities).index(m)] = v
        else:
            qpart[name] = 100.0 * float(v)
    pct = 100.0 * slot
    return {
        "kind": {KINDS[k]: float(pct[:, :, k].sum()) for k in range(2)},
        "modality": {modalities[m]: float(pct[..., m].sum()) for m in range(M)},
        "layer": {f"L{l:02d}": float(pct[l].sum()) for l in range(L)},
        "head": {f"L{l:02d}.H{h}": float(pct[l, h].sum()) for l in range(L) for h in range(H)},
        "quantizer": qpart,
        "slot": {n: float(p) for n, p in zip(slot_names(shape, modalities), pct.ravel())},
    }
