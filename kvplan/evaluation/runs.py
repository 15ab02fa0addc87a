"""What ``kvplan eval`` and ``kvplan sweep`` run: :func:`run_eval` and :func:`run_sweep` (a model, a task split,
its full-precision prefills, then one plan's scores or the sensitivity sweep), and :func:`get_model`, the
per-process model memo they share with the tests and the search's scorers."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np

from ..models.geometry import Geometry
from ..plans import Plan, is_baseline_name
from ..plans.baselines import check_plan_argument
from ..plans._files import check_not_inputs, check_writable, existing_path
from .baselines import PEER_BITS, evaluate_peer, head_sensitivity, headguard_from_sensitivity, named_plan, parse_peer
from .harness import check_commits_any, evaluate, prepare_samples
from .sweep import SWEEP_BITS, format_layers, format_ratios, format_table, sweep_prepared, write_sweep
from .tasks import (ALL_RECORDS, DEFAULT_EVAL_TOKENS, DEFAULT_HISTORY_TOKENS, canonical_split, check_task,
                    check_task_lengths, pad_token_id, task_file_digest, task_samples)

_MODELS: dict[tuple, Any] = {}


class _threads:
    """Temporarily set torch's intra-op threads (``None``: leave as is, e.g. what ``kvplan
    --threads`` set). On a shared 2-core machine, 2 spinning OpenMP threads per process were
    ~10x slower than 1 (measured while other jobs ran): pass ``num_threads=1`` there."""

    def __init__(self, n):
        self.n = n

    def __enter__(self):
        import torch

        self.old = torch.get_num_threads()
        if self.n:
            torch.set_num_threads(self.n)

    def __exit__(self, *a):
        import torch

        torch.set_num_threads(self.old)


def get_model(model="smollm2-135m", dtype: str = "float32"):
    """``(model, processor)``: a name/path loaded once per process, or a ``(model, processor)`` pair as is."""
    if isinstance(model, tuple):
        return model
    from ..models import load_model

    key = (model, dtype)
    if key not in _MODELS:
        _MODELS[key] = load_model(model, dtype=dtype)  # a dtype name: load_model checks it
    return _MODELS[key]


DEFAULT_TASK_SAMPLES = 16  # eval and sweep on the built-in task


def resolve_sample_count(task: str, samples: int | None) -> int | None:
    """``samples``, or where it is ``None`` the default: 16 of the built-in task, every record of a
    JSONL task's split (``None``), as ``kvplan search`` measures its validation and test splits."""
    if samples is not None:
        return samples
    return DEFAULT_TASK_SAMPLES if task == "default" else None


def _modalities(samples) -> tuple[str, ...]:
    present = set()
    for s in samples:
        present.update(s.history_labels)
    return ("text",) + tuple(sorted(present - {"text"}))


def _print_eval(r: dict[str, Any]) -> None:
    print(f"plan: {r['plan']}   samples: {r['n']}   bpv: {r['bpv']:.3f} (real bytes: {r['bpv_measured']:.3f}, "
          f"{r['storage_bits']}-bit storage)")
    print(f"{'metric':<14}{'mean':>12}{'95% CI':>26}")
    for k in ("kl", "kl_answer", "nll", "nll_fp", "delta_nll", "top1", "acc", "acc_fp", "choice_agree"):
        if k in r:
            m, (lo, hi) = r[k]["mean"], r[k]["ci95"]
            print(f"{k:<14}{m:>12.5f}   [{lo:>10.5f}, {hi:>10.5f}]")
    # tokens per layer and KV head (a mean: heads hold different bits), summed over the samples
    for label, key in (("quantized", "quantized_tokens"), ("streamed, not stored", "streamed_tokens")):
        for kind, mods in r.get(key, {}).items():
            for mod, n in mods.items():
                print(f"{label} {kind.upper()} {mod}: {n / max(1, r['n']):.1f} tokens per sample, layer and KV "
                      f"head ({n:.1f} over the {r['n']} samples)")


def run_eval(plan_or_baseline, model="smollm2-135m", task: str = "default", split: str = "test",
             samples: int | None = None, out: str | os.PathLike | None = None, *, seed: int | None = None,
             history_tokens: int | None = None, eval_tokens: int | None = None, dtype: str = "float32",
             num_threads: int | None = None, progress: bool = True, verbose: bool = True) -> dict:
    """Evaluate a plan under the historical-cache protocol and return (and optionally write) the results.

    ``plan_or_baseline``: a :class:`~kvplan.Plan`, a plan YAML path, a baseline name
    (``fp16``, ``int8``, ``int4``, ``int2``, ``k4v2``, with optional ``-g64``/``-g128``),
    ``"headguard"`` (sensitivity on the calibration split, top 1/8 heads protected, rest
    INT2), or a transformers QuantizedCache peer ``quanto-int2`` / ``hqq-int4``... ``samples``:
    default 16 of the built-in task, every record of a JSONL task's split (as the search measures it).
    ``history_tokens`` / ``eval_tokens``: the built-in task's (a JSONL record sets its own: giving them with a
    JSONL task is an error). ``seed``
    (how a JSONL task's records and the built-in task's topics are split), the two lengths and ``samples``
    default to the plan's search's (``metrics.search``, and ``metrics.<split>.n_samples``) when the plan
    was searched on this task, so a plan is measured on its own test samples, else to 0, 512, 32 and the
    default count.
    """
    with _threads(num_threads):
        return _run_eval(plan_or_baseline, model, task, split, samples, out, seed, history_tokens, eval_tokens,
                         dtype, progress, verbose)


def _prepared_task(model, dtype, task, split, samples, history_tokens, eval_tokens, seed, progress,
                   plan: Plan | None = None, source=None):
    """Model, task samples and their full-precision prefills: ``(m, proc, samples, prepared, modalities, kw)``.
    ``plan``: checked against the model's geometry as soon as it loads, before the prefills."""
    m, proc = get_model(model, dtype)
    if plan is not None:
        plan.check_geometry(Geometry.of(m), source=source)
    kw = {"history_tokens": history_tokens, "eval_tokens": eval_tokens} if task == "default" else {}
    ss = task_samples(task, m, proc, split=split, n=resolve_sample_count(task, samples), seed=seed, **kw)
    prepared = prepare_samples(m, ss, pad_id=pad_token_id(proc), progress=progress)
    return m, proc, ss, prepared, _modalities(ss), kw


# the names kvplan eval takes beyond the built-in plans: "; also headguard, quanto-int2/4, hqq-int1/2/3/4/8"
EVAL_ALSO = "; also headguard, " + ", ".join(f"{b}-int{'/'.join(map(str, bits))}" for b, bits in PEER_BITS.items())


def _check_eval_arguments(plan_or_baseline, model, task, out) -> Plan | None:
    """Fail before the model loads: a plan file that does not parse, a peer's bit width its backend
    lacks, or an ``out`` that is one of the inputs or cannot be written. Returns the plan to evaluate
    (parsed from its file), or None for a baseline or peer."""
    plan = plan_or_baseline if isinstance(plan_or_baseline, Plan) else None
    if isinstance(plan_or_baseline, (str, os.PathLike)):
        name = os.fspath(plan_or_baseline)
        if parse_peer(name) is None and name != "headguard" and not check_plan_argument(name, EVAL_ALSO):
            plan = Plan.from_yaml(name)  # PlanError naming the file and key
    if out is not None:
        check_writable(out, "--out", is_dir=False)
        check_not_inputs({"--out": out}, {"plan": existing_path(plan_or_baseline), "task file": existing_path(task),
                                          "model": existing_path(model)})
    return plan


def _search_on(plan: Plan | None, task: str) -> dict:
    """``plan``'s ``metrics.search`` when that search drew its splits from ``task``, else ``{}``: a task file
    with the bytes the search recorded (``sha256``), under any path or name; the built-in task, or a plan
    searched before digests were recorded, by name."""
    search = (plan.metrics.get("search") if plan is not None else None) or {}
    recorded = search.get("task")
    if not isinstance(recorded, dict):
        return {}
    if recorded.get("sha256") is not None:
        return search if task_file_digest(task) == recorded["sha256"] else {}
    return search if recorded.get("name") == os.fspath(task) else {}


def _searched_elsewhere(plan: Plan | None, search: dict) -> str | None:
    """The task ``plan``'s search drew its splits from, when that is not the task ``search`` (its
    :func:`_search_on`) is empty for (another file, or the file changed since): eval then draws its own
    splits, and says so."""
    recorded = ((plan.metrics.get("search") if plan is not None else None) or {}).get("task")
    if not isinstance(recorded, dict) or "name" not in recorded or search:
        return None
    return str(recorded["name"])


def eval_settings(plan: Plan | None, task: str, seed: int | None, history_tokens: int | None,
                  eval_tokens: int | None, search: dict | None = None) -> tuple[dict[str, int], list[str]]:
    """``({"seed", "history_tokens", "eval_tokens"}, the names taken from the plan)``: each setting
    given, else the one ``plan``'s search drew its splits with (``metrics.search``: its seed, and the
    built-in task's lengths) when it searched this ``task``, else 0 / 512 / 32. ``search``:
    ``_search_on(plan, task)`` when the caller has it (it reads the whole task file)."""
    search = _search_on(plan, task) if search is None else search
    plans = {**search["task"], "seed": search.get("seed")} if search else {}
    given = {"seed": seed, "history_tokens": history_tokens, "eval_tokens": eval_tokens}
    defaults = {"seed": 0, "history_tokens": DEFAULT_HISTORY_TOKENS, "eval_tokens": DEFAULT_EVAL_TOKENS}
    settings, from_plan = {}, []
    for name in given:
        if given[name] is not None:
            settings[name] = given[name]
        elif isinstance(plans.get(name), int) and not isinstance(plans[name], bool):
            settings[name] = plans[name]
            from_plan.append(name)
        else:
            settings[name] = defaults[name]
    return settings, from_plan


def eval_sample_count(plan: Plan | None, task: str, split: str, samples: int | None,
                      search: dict | None = None) -> tuple[int | None, bool]:
    """``(samples, taken from the plan)``: ``samples`` given, else the count ``plan``'s search measured
    ``split`` on (``metrics.<split>.n_samples``, e.g. ``kvplan search --test-samples 2``) when it searched
    this ``task``, else the default (:func:`resolve_sample_count`). ``search``: as in :func:`eval_settings`."""
    if samples is not None:
        return samples, False
    search = _search_on(plan, task) if search is None else search
    # not ALL_RECORDS: every record of the task, which no search measured
    measured = plan.metrics.get(canonical_split(split)) if split != ALL_RECORDS and search else None
    n = measured.get("n_samples") if isinstance(measured, dict) else None
    if isinstance(n, (int, float)) and not isinstance(n, bool) and n >= 1 and float(n).is_integer():
        return int(n), True
    return resolve_sample_count(task, None), False


def _token_lengths(samples) -> dict[str, int | dict[str, float]]:
    """``history_tokens`` / ``eval_tokens`` the samples hold: one number when every sample holds the same
    (the built-in task's settings), else their ``min`` / ``mean`` / ``max`` (a JSONL task's records)."""
    out = {}
    for name, lengths in (("history_tokens", [len(s.history_ids) for s in samples]),
                          ("eval_tokens", [len(s.eval_ids) for s in samples])):
        lo, hi = min(lengths, default=0), max(lengths, default=0)
        out[name] = lo if lo == hi else {"min": lo, "mean": sum(lengths) / len(lengths), "max": hi}
    return out


def _history_title(lengths: dict) -> str:
    h = lengths["history_tokens"]
    return f"{h}-token history" if isinstance(h, int) else f"{h['min']}-{h['max']}-token histories"


def _run_eval(plan_or_baseline, model, task, split, samples, out, seed, history_tokens, eval_tokens, dtype,
              progress, verbose) -> dict:
    t0 = time.perf_counter()
    check_task_lengths(task, history_tokens, eval_tokens)
    plan = _check_eval_arguments(plan_or_baseline, model, task, out)
    search = _search_on(plan, task)  # once: a task file is named by the digest of all its bytes
    settings, from_plan = eval_settings(plan, task, seed, history_tokens, eval_tokens, search=search)
    seed, history_tokens, eval_tokens = settings["seed"], settings["history_tokens"], settings["eval_tokens"]
    samples, samples_from_plan = eval_sample_count(plan, task, split, samples, search=search)
    if samples_from_plan:
        settings["samples"] = samples
        from_plan.append("samples")
    if from_plan and verbose:
        print(f"kvplan eval: {', '.join(f'{n} {settings[n]}' for n in from_plan)} as the plan's search drew its "
              "splits (pass them to override)")
    elsewhere = _searched_elsewhere(plan, search)
    if elsewhere is not None and verbose:
        print(f"kvplan eval: the plan was searched on task {elsewhere!r}, not on this one (another file, or its "
              f"content changed since): its {split} split is drawn here at seed {seed}, not as the search drew it")
    check_task(task, {split: resolve_sample_count(task, samples)}, seed)
    source = os.fspath(plan_or_baseline) if isinstance(plan_or_baseline, (str, os.PathLike)) else None
    m, proc, ss, prepared, mods, kw = _prepared_task(model, dtype, task, split, samples, history_tokens,
                                                     eval_tokens, seed, progress, plan, source)
    peer = parse_peer(plan_or_baseline) if isinstance(plan_or_baseline, str) else None
    if peer is not None:
        r = evaluate_peer(m, peer[0], peer[1], prepared, seed=seed, progress=progress)
    else:
        plan = plan_or_baseline
        if plan == "headguard":
            bulk = [x for x in mods if x != "text"]
            bulk_mod = bulk[0] if bulk else "text"
            # its quantizer does not depend on the heads it protects: histories that commit nothing are said
            # before the head profile's minutes of evaluations, not after them
            g = Geometry.of(m)
            unprotected = headguard_from_sensitivity(m, np.zeros((g.num_layers, g.num_kv_heads)), modalities=mods,
                                                     protected_modality=bulk_mod)
            check_commits_any(unprotected, ss, "headguard: ")
            cal = task_samples(task, m, proc, split="calibration", n=min(len(ss), 8), seed=seed, **kw)
            cprep = prepare_samples(m, cal, pad_id=pad_token_id(proc), progress=progress)
            sens = head_sensitivity(m, cprep, modality=bulk_mod, progress=progress)
            plan = headguard_from_sensitivity(m, sens["score"], modalities=mods, protected_modality=bulk_mod)
        elif is_baseline_name(plan):
            plan = named_plan(plan, m, modalities=mods)
        r = evaluate(m, plan, prepared, seed=seed, progress=progress)
    split = split if split == ALL_RECORDS else canonical_split(split)  # recorded as "test", not "heldout"
    r["task"] = {"task": task, "split": split, "samples": len(ss), "seed": seed, **_token_lengths(ss),
                 "dtype": dtype, "model": model if isinstance(model, str) else "<object>"}
    r["seconds"] = time.perf_counter() - t0
    if verbose:
        _print_eval(r)
    if out is not None:
        from ..plans import atomic_write_text

        atomic_write_text(out, json.dumps(r, indent=1, default=float))
    return r


def run_sweep(model="smollm2-135m", samples: int | None = None, out_dir: str | os.PathLike | None = None, *,
              task: str = "default", split: str = "test", bits=SWEEP_BITS, seed: int = 0,
              history_tokens: int | None = None, eval_tokens: int | None = None, group_size: int = 32,
              dtype: str = "float32",
              num_threads: int | None = None, progress: bool = True, verbose: bool = True) -> dict:
    """{FP16, INT8, INT4, INT2} x {each modality} x {K, V}: quantize only that part of the history.

    Writes ``sweep.csv``, ``sweep.json`` and ``sweep.png`` into ``out_dir`` (``None``, the default: no files;
    ``kvplan sweep`` writes ``sweep-results/``); returns ``{"rows", "ratios", "results", "paths", "seconds",
    "meta"}`` (``paths`` empty without ``out_dir``). ``history_tokens`` / ``eval_tokens``: the built-in task's
    (``None``: 512 / 32); a JSONL task's records hold their own, and giving them with one is an error.
    """
    with _threads(num_threads):
        return _run_sweep(model, samples, out_dir, task, split, bits, seed, history_tokens, eval_tokens, group_size,
                          dtype, progress, verbose)


def _run_sweep(model, samples, out_dir, task, split, bits, seed, history_tokens, eval_tokens, group_size, dtype,
               progress, verbose) -> dict:
    t0 = time.perf_counter()
    check_task_lengths(task, history_tokens, eval_tokens)
    history_tokens = DEFAULT_HISTORY_TOKENS if history_tokens is None else history_tokens
    eval_tokens = DEFAULT_EVAL_TOKENS if eval_tokens is None else eval_tokens
    if out_dir is not None:  # before the sweep's work, not after it
        check_writable(out_dir, "--out-dir", is_dir=True)
    m, proc, ss, prepared, mods, _ = _prepared_task(model, dtype, task, split, samples, history_tokens,
                                                    eval_tokens, seed, progress)
    res = sweep_prepared(m, prepared, mods, bits=bits, seed=seed, group_size=group_size, progress=progress)
    res["seconds"] = time.perf_counter() - t0
    lengths = _token_lengths(ss)  # what the samples hold (--history-tokens applies to the built-in task only)
    meta = {"model": model if isinstance(model, str) else "<object>", "task": task,
            "split": split if split == ALL_RECORDS else canonical_split(split),
            "samples": len(ss), "seed": seed, **lengths, "group_size": group_size, "residual_length": 0,
            "dtype": dtype, "modalities": list(mods),
            "layer_types": list(Geometry.of(m).layer_types), "sliding_window": Geometry.of(m).sliding_window,
            "seconds": res["seconds"], "title": f"{model if isinstance(model, str) else 'model'}: "
                                                f"{len(ss)} samples, {_history_title(lengths)}"}
    res["meta"] = meta
    if verbose:  # the results first: a failure writing the files below (a full disk) does not lose them
        print(format_layers(Geometry.of(m)))
        print(format_table(res["rows"]))
        print()
        print(format_ratios(res["ratios"]))
        print(f"wall time: {res['seconds']:.1f} s", flush=True)
    res["paths"] = {} if out_dir is None else write_sweep(res, os.fspath(out_dir), meta)
    return res
