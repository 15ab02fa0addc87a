"""Scorers on the evaluation harness (:mod:`kvplan.evaluation`) for :func:`kvplan.search.search`.

A scorer is ``scorer(plan) -> {"kl": mean KL, "bpv": honest bpv, ...}``. This module
adapts the historical-cache protocol (prefill once at full precision, then per plan
quantize the history through :class:`~kvplan.KVPlanCache` and score the evaluated tokens):

- the **calibration** scorer scores only the continuation (KL, NLL, top-1): the
  multiple-choice rows are dropped from its samples to make each candidate cheaper;
- the **held-out** scorer (other topics) scores everything, including multiple-choice
  accuracy, and reports bootstrap 95% CIs.

The default reference (where the budget is stated) is the calibration history layout
itself: ``context_len`` = history length, modality mix = its text/doc fractions, so the
plan's honest bpv is exactly what the evaluated caches store.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any, Sequence

from ..models.geometry import Geometry
from ..plans import Plan, Reference


def _summary(agg: dict[str, Any], plan: Plan) -> dict[str, Any]:
    out: dict[str, Any] = {"bpv": plan.bpv().total, "n_samples": agg.get("n")}
    for k in ("kl", "kl_max", "nll", "delta_nll", "top1", "kl_answer", "acc", "acc_fp", "choice_agree"):
        v = agg.get(k)
        if isinstance(v, dict) and "mean" in v:
            out[k] = v["mean"]
            lo, hi = v.get("ci95", [None, None])
            out[f"{k}_ci95_lo"], out[f"{k}_ci95_hi"] = lo, hi
    if "samples" in agg:
        kls = [s["kl"] for s in agg["samples"]]
        if len(kls) > 1:
            import numpy as np

            out["kl_se"] = float(np.std(kls, ddof=1) / np.sqrt(len(kls)))
    out["bpv_cache"] = agg.get("bpv")
    return out


class HarnessScorer:
    """Scores plans on prepared samples with :func:`kvplan.evaluation.harness.evaluate`."""

    def __init__(self, model, prepared: Sequence, reference: Reference, modalities: Sequence[str], name: str,
                 data_hash: str, model_name: str | None = None):
        self.model = model
        self.prepared = list(prepared)
        self.geometry = Geometry.of(model)
        self.reference = reference
        self.modalities = tuple(modalities)
        self.name = name
        self.data_hash = data_hash
        self.model_name = model_name
        self.calls = 0

    def calibration_sequences(self) -> list[list[int]]:
        """Token ids of each sample (history then evaluated tokens), e.g. to learn query bases."""
        return [list(p.sample.history_ids) + list(p.sample.eval_ids) for p in self.prepared]

    def __call__(self, plan: Plan) -> dict[str, Any]:
        from ..evaluation.harness import evaluate

        self.calls += 1
        # A candidate may legitimately quantize nothing of a modality (e.g. a residual longer than the
        # history); its KL is what it is, so the sweep's zero-quantized-token guard is off here.
        agg = evaluate(self.model, plan, self.prepared, progress=False, keep_samples=True, expect_quantized=())
        return _summary(agg, plan)


def reference_of(samples: Sequence) -> tuple[Reference, tuple[str, ...]]:
    """Reference layout of the first sample's history (runs in order) and the modalities used."""
    labels = list(samples[0].history_labels)
    order = list(dict.fromkeys(labels))
    runs = []
    i = 0
    while i < len(labels):
        j = i
        while j < len(labels) and labels[j] == labels[i]:
            j += 1
        runs.append((labels[i], j - i))
        i = j
    if len(runs) != len(order):
        # non-contiguous layout: state the budget at the modality totals in first-seen order
        runs = [(m, labels.count(m)) for m in order]
    T = len(labels)
    mix, acc = [], 0.0
    for name, n in runs[:-1]:
        f = (n + 0.5) / T  # int(f * T) == n exactly in layout_labels
        mix.append((name, f))
        acc += f
    mix.append((runs[-1][0], 1.0 - acc))
    mods = tuple(order) if "text" in order else ("text",) + tuple(order)
    return Reference(context_len=T, modality_mix=tuple(mix)), mods


def harness_scorers(model="smollm2-135m", *, seed: int = 0, n_calibration: int = 12, n_heldout: int = 16,
                    history_tokens: int = 512, eval_tokens: int = 32, progress: bool = True, before_prefill=None):
    """``(calibration_scorer, heldout_scorer)`` on the built-in documentation task.

    ``model``: a name/path for :func:`kvplan.load_model` or a loaded ``(model, tokenizer)``
    pair. ``before_prefill(geometry, reference, modalities)`` runs once the task's layout is
    known and before the (slow) full-precision prefills, e.g. to reject an infeasible budget.
    """
    from ..evaluation.harness import prepare_samples
    from ..evaluation.tasks import default_task_samples, pad_token_id
    from ..models import load_model

    model_name = model if isinstance(model, str) else None
    if isinstance(model, str):
        model, tok = load_model(model)
    else:
        model, tok = model
    cal = default_task_samples(tok, split="calibration", n=n_calibration, history_tokens=history_tokens,
                               eval_tokens=eval_tokens, seed=seed)
    cal = [replace(s, question_ids=None, options=None, answer=None) for s in cal]
    held = default_task_samples(tok, split="heldout", n=n_heldout, history_tokens=history_tokens,
                                eval_tokens=eval_tokens, seed=seed)
    reference, mods = reference_of(cal)
    if before_prefill is not None:
        before_prefill(Geometry.of(model), reference, mods)
    pad = pad_token_id(tok)
    h = hashlib.sha256(repr([(s.history_ids, s.eval_ids) for s in cal]).encode()).hexdigest()[:16]
    cal_p = prepare_samples(model, cal, pad, progress=progress)
    held_p = prepare_samples(model, held, pad, progress=progress)
    return (HarnessScorer(model, cal_p, reference, mods, "calibration", "sha256:" + h, model_name),
            HarnessScorer(model, held_p, reference, mods, "heldout", "sha256:" + h, model_name))
