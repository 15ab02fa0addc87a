"""Scorers on the evaluation harness (:mod:`kvplan.evaluation`) for :func:`kvplan.search.search`.

A scorer is ``scorer(plan) -> {"kl": mean KL, "bpv": honest bpv, ...}``. This module
adapts the historical-cache protocol (prefill once at full precision, then per plan
quantize the history through :class:`~kvplan.KVPlanCache` and score the evaluated tokens):

- the **calibration** scorer scores only the continuation (KL, NLL, top-1): the
  multiple-choice rows are dropped from its samples to make each candidate cheaper;
- the **validation** scorer (other topics / records) chooses among the search's best
  plans and is where defaults are chosen;
- the **test** scorer (other topics / records again) scores everything, including
  multiple-choice accuracy, with bootstrap 95% CIs, and is only reported.

The default reference (where the budget is stated) is the calibration history layout
itself: ``context_len`` = history length, modality mix = its label fractions (``{text:
1.0}`` on a text model), full-precision storage at the model dtype's bits, so the plan's
honest bpv is exactly what the evaluated caches store (``bpv_cache``).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, replace
from typing import Any, Sequence

from ..evaluation.tasks import DEFAULT_EVAL_TOKENS, DEFAULT_HISTORY_TOKENS, task_file_digest
from ..models.geometry import Geometry, storage_bits
from ..models.modality import TOKEN_IDS
from ..plans import Plan, Reference
from ..plans.accounting import label_runs


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
    out["bpv_cache"] = agg.get("bpv_measured")  # 8 * real cache bytes / values, model-dtype storage
    return out


def samples_digest(samples) -> str:
    """What identifies a study's calibration data: the token ids of each sample's history and
    continuation and, for a VLM's samples, their media inputs (an image's token ids depend only on its
    size: its pixels must count too). Text samples hash as they always did (resumable studies)."""
    import torch

    digest = hashlib.sha256(repr([(s.history_ids, s.eval_ids) for s in samples]).encode())
    for s in samples:
        for name in sorted(s.prefill_inputs or {}):
            value = s.prefill_inputs[name]
            digest.update(name.encode())
            if isinstance(value, torch.Tensor):
                digest.update(str(value.dtype).encode() + repr(tuple(value.shape)).encode())
                digest.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            else:
                digest.update(repr(value).encode())
    return digest.hexdigest()[:16]


def _extended(inputs: dict[str, Any], n_history: int, n_eval: int) -> dict[str, Any]:
    """A prompt's model inputs for the history followed by ``n_eval`` text tokens: per-token integer
    inputs ``[1, n_history]`` (a VLM's ``mm_token_type_ids`` / ``token_type_ids``) get 0 (text) for the new
    tokens; the rest (pixels, grids) are the history's."""
    import torch

    out = {}
    for name, value in inputs.items():
        if (isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dim() == 2
                and value.shape == (1, n_history)):
            value = torch.cat([value, value.new_zeros(1, n_eval)], dim=-1)
        out[name] = value
    return out


class HarnessScorer:
    """Scores plans on prepared samples with :func:`kvplan.evaluation.harness.evaluate`, through
    the attention route ``kvplan.load(model, plan, attention)`` deploys (``"auto"``: the chunked
    kernel on CPU, Triton on CUDA), so the KL it measures is the KL users get."""

    def __init__(self, model, prepared: Sequence, reference: Reference, modalities: Sequence[str], name: str,
                 data_hash: str, model_name: str | None = None, attention: str = "auto", processes: int = 1,
                 task_setup: dict | None = None):
        from ..evaluation.parallel import SampleProcesses

        self.model = model
        self.prepared = list(prepared)
        # each plan's samples are scored in `processes` CPU processes at once (same numbers as 1)
        self.processes = SampleProcesses(model, self.prepared, processes)
        # how the samples' tokens are labelled (kvplan.Labelling), as kvplan.load must label them
        self.labelling = self.prepared[0].labelling if self.prepared else TOKEN_IDS
        self.geometry = Geometry.of(model)
        self.reference = reference
        self.modalities = tuple(modalities)
        self.name = name
        self.data_hash = data_hash
        self.model_name = model_name
        self.attention = attention
        # the task and settings its samples were drawn with (task_scorers); None: samples of the caller's
        self.task_setup = task_setup
        self.calls = 0

    def calibration_sequences(self) -> list[dict[str, Any]]:
        """Model inputs of each sample (history then evaluated tokens, plus e.g. a VLM's
        ``pixel_values``), e.g. to learn query bases."""
        return [{"input_ids": list(p.sample.history_ids) + list(p.sample.eval_ids),
                 **_extended(p.sample.prefill_inputs, len(p.sample.history_ids), len(p.sample.eval_ids))}
                for p in self.prepared]

    def __call__(self, plan: Plan, reuse_prefix: bool = False) -> dict[str, Any]:
        """Score ``plan``; ``reuse_prefix``: replay the full-precision layers before its first
        quantized layer as recorded by earlier calls (same numbers; see :mod:`kvplan.evaluation.prefix`)."""
        from ..evaluation.harness import evaluate

        self.calls += 1
        # A candidate may legitimately quantize nothing of a modality (e.g. a residual longer than the
        # history); its KL is what it is, so the sweep's zero-quantized-token guard is off here.
        agg = evaluate(self.model, plan, self.prepared, progress=False, keep_samples=True, expect_quantized=(),
                       attention=self.attention, processes=self.processes, reuse_prefix=reuse_prefix)
        return _summary(agg, plan)

    def score_profile_plan(self, plan: Plan) -> dict[str, Any]:
        """Score a sensitivity-profile plan (one unit quantized, the rest at 16 bits): each runs the
        model only from its first quantized layer on."""
        return self(plan, reuse_prefix=True)

    def close(self) -> None:
        """Stop the scorer's worker processes (they start again at the next call)."""
        self.processes.close()


def reference_of(samples: Sequence, context_len: int | None = None, full_precision_bits: int = 16
                 ) -> tuple[Reference, tuple[str, ...]]:
    """Where the budget is stated for ``samples`` (the calibration data) and the modalities used.

    ``context_len``: the deployment context (default: the median history length). The
    modality mix is the pooled label fractions of all histories, as runs in first-seen order
    (one run per modality: a text model's mix is ``{text: 1.0}``); with several modalities at the
    default context the reference also records the median history's own runs (``layout``).
    ``full_precision_bits``:
    storage of full-precision tokens (the model dtype's bits: 32 for an fp32 model on CPU).
    """
    counts: dict[str, int] = {}
    lengths = []
    for s in samples:
        lengths.append(len(s.history_labels))
        for label in s.history_labels:
            counts[label] = counts.get(label, 0) + 1
    T = int(context_len) if context_len is not None else int(sorted(lengths)[len(lengths) // 2])
    total = sum(counts.values())
    names = list(counts)
    mix, acc = [], 0.0
    for name in names[:-1]:
        f = counts[name] / total
        mix.append((name, f))
        acc += f
    mix.append((names[-1], 1.0 - acc))
    mods = ("text",) + tuple(n for n in names if n != "text")  # text first (generated tokens are text)
    layout = None
    if context_len is None and len(names) > 1:
        # several modalities at the default context: state the bpv on the measured runs of the
        # median-length history (text, image, text... as a real prompt interleaves them), so the
        # plan's bpv is that prompt's bytes exactly, not those of one contiguous run per modality
        median = next(s for s in samples if len(s.history_labels) == T)
        layout = tuple((lab, n) for lab, _, n in label_runs(median.history_labels))
    return Reference(context_len=T, modality_mix=tuple(mix), full_precision_bits=full_precision_bits,
                     layout=layout), mods


@dataclass
class TaskScorers:
    """The three scorers of a task: ``calibration`` (the search), ``validation`` (choosing
    settings and the final plan) and ``test`` (reported only). ``None``: split not used."""

    calibration: HarnessScorer
    validation: HarnessScorer | None
    test: HarnessScorer | None


DEFAULT_SAMPLES = {"calibration": 12, "validation": 16, "test": 16}  # of the built-in task


def task_scorers(model="smollm2-135m", task: str = "default", *, seed: int = 0, n_calibration: int | None = None,
                 n_validation: int | None = None, n_test: int | None = None,
                 history_tokens: int | None = None, eval_tokens: int | None = None,
                 context_len: int | None = None, attention: str = "auto",
                 progress: bool = True, before_prefill=None, labelling=None, processes: int | None = None
                 ) -> TaskScorers:
    """Scorers on ``task`` (``"default"``: the built-in documentation task; or a JSONL file).

    ``model``: a name/path for :func:`kvplan.load_model` or a loaded ``(model, processor)``
    pair. ``n_calibration`` / ``n_validation`` / ``n_test``: samples per split (``None``: 12 /
    16 / 16 on the built-in task, every record of the split on a JSONL task; 0 skips the
    validation or test split). ``history_tokens`` / ``eval_tokens``: the built-in task's (``None``: 512 / 32);
    a JSONL task's records hold their own, and giving them with one is an error. ``context_len``: where the
    budget is stated (default: the calibration history length). ``before_prefill(geometry,
    reference, modalities)`` runs once the task's layout is known and before the (slow)
    full-precision prefills, e.g. to reject an infeasible budget. ``labelling``: a
    :class:`~kvplan.Labelling` for the samples' tokens (default: token ids), the one the
    exported plans record and ``kvplan.load`` must be given. ``processes``: CPU processes that
    score each plan's samples together (``None``: the cores this process may use, capped at each
    split's samples; 1 on CUDA; same numbers with any value, see :mod:`kvplan.evaluation.parallel`).
    """
    from ..evaluation.harness import prepare_samples
    from ..evaluation.parallel import usable_processes
    from ..evaluation.tasks import check_task, check_task_lengths, pad_token_id, task_samples
    from ..models import load_model

    check_task_lengths(task, history_tokens, eval_tokens)
    history_tokens = DEFAULT_HISTORY_TOKENS if history_tokens is None else history_tokens
    eval_tokens = DEFAULT_EVAL_TOKENS if eval_tokens is None else eval_tokens
    asked = {"calibration": n_calibration, "validation": n_validation, "test": n_test}
    if task == "default":
        asked = {k: DEFAULT_SAMPLES[k] if n is None else n for k, n in asked.items()}
    check_task(task, asked, seed)
    model_name = model if isinstance(model, str) else None
    if isinstance(model, str):
        model, proc = load_model(model)
    else:
        model, proc = model
    kw = {"history_tokens": history_tokens, "eval_tokens": eval_tokens} if task == "default" else {}
    cal, val, test = (task_samples(task, model, proc, split=split, n=n, seed=seed, labelling=labelling, **kw)
                      if n != 0 else []
                      for split, n in asked.items())
    # the calibration scorer scores only the continuation: cheaper, and what the search minimizes
    cal = [replace(s, question_ids=None, options=None, answer=None) for s in cal]
    reference, mods = reference_of(cal, context_len, storage_bits(model))
    if before_prefill is not None:
        before_prefill(Geometry.of(model), reference, mods)
    pad = pad_token_id(proc)
    h = samples_digest(cal)

    def scorer(samples, name):
        if not samples:
            return None
        n = usable_processes(model, len(samples)) if processes is None else processes
        return HarnessScorer(model, prepare_samples(model, samples, pad, progress=progress, attention=attention,
                                                    labelling=labelling, processes=n),
                             reference, mods, name, "sha256:" + h, model_name, attention, processes=n,
                             task_setup=task_setup)

    # how every split was drawn, recorded with the plan (metrics.search.task) so that kvplan eval measures a
    # plan on its own splits by default: the seed splits a task's records, the lengths cut the built-in task's
    # (a task file is also named by its bytes' digest: eval finds it under another path or name)
    digest = task_file_digest(task)
    task_setup = {"name": os.fspath(task), **({"sha256": digest} if digest else {}), **kw}

    return TaskScorers(scorer(cal, "calibration"), scorer(val, "validation"), scorer(test, "test"))


def harness_scorers(model="smollm2-135m", *, seed: int = 0, n_calibration: int = 12, n_heldout: int = 16,
                    history_tokens: int = DEFAULT_HISTORY_TOKENS, eval_tokens: int = DEFAULT_EVAL_TOKENS,
                    progress: bool = True, before_prefill=None):
    """``(calibration_scorer, test_scorer)`` on the built-in task (no validation split), as
    the benchmark scripts use them; see :func:`task_scorers`."""
    s = task_scorers(model, seed=seed, n_calibration=n_calibration, n_validation=0, n_test=n_heldout,
                     history_tokens=history_tokens, eval_tokens=eval_tokens, progress=progress,
                     before_prefill=before_prefill)
    return s.calibration, s.test
