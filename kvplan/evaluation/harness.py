"""The historical-cache measurement protocol.

A :class:`Sample` is a *history* (token ids, one modality label per token, and any extra
prefill inputs such as ``pixel_values``) followed by *evaluated* tokens: a continuation
``eval_ids`` and optionally a multiple-choice question (``question_ids`` + ``options``).

Protocol (DESIGN.md, "What the source documents found" item 1):

1. The history is prefilled ONCE at full precision with a plain ``DynamicCache``; its
   K/V (``[1, H_kv, T_hist, D]`` per layer) and the FP logits of the evaluated tokens are
   kept in a :class:`PreparedSample`.
2. For each plan a fresh :class:`~kvplan.KVPlanCache` is made by
   :func:`kvplan.make_cache` -- labelled from the history's token ids by the runtime's own
   labelling, which the sample's labels must equal -- and the FP history K/V is written into
   it layer by layer through ``cache.layers[i].update(k, v)``: the same quantize/pack code
   and, under :func:`kvplan.runtime.attention_route`, the same attention route that
   ``kvplan.load`` deploys (``attention="auto"``). Only the *historical* cache is quantized: the evaluated tokens
   enter the cache during their own forward pass and are returned to it at full
   precision (the runtime returns freshly written tokens unquantized).
3. The continuation runs alone against the cache (batch 1: the forward a user runs, so the
   same attention route), then is cropped off again and the multiple-choice rows (question
   + each option) run as one right-padded batch against the batch-repeated cache; logits at
   evaluated positions are compared with the FP run made the same way.

Metrics per sample: KL(P_fp || P_q) over the full vocabulary averaged over the
continuation positions, NLL of the reference continuation tokens, top-1 agreement with
FP, KL at the answer position and multiple-choice accuracy (option log-likelihood given
history + question; FP and quantized). Aggregates carry seeded bootstrap 95% CIs.
"""

from __future__ import annotations

import inspect
import math
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from ..errors import KVPlanError
from ..models.geometry import text_config
from ..models.modality import TOKEN_IDS, Labelling, resolve_labelling
from ..plans import KINDS, Plan, committed_length, plan_bytes
from ..runtime.cache import KVPlanCache
from ..runtime.heavy import recording_window_queries
from ..runtime.load import attention_route, check_modalities, make_cache, resolve_plan
from ..kernels.qtypes import FULL_PRECISION_BITS
from .prefix import PrefixReplay, decoder_layers, first_quantized_layer, settings_key


class ProtocolError(KVPlanError):
    """A measurement would be meaningless (e.g. a condition quantized nothing)."""


# ----------------------------------------------------------------------------- data
@dataclass
class Sample:
    """One evaluation item.

    ``history_ids``/``history_labels``: the historical prompt (what gets quantized).
    ``eval_ids``: evaluated continuation; logits are compared at each of its positions and
    its tokens ``eval_ids[1:]`` are the reference for NLL.
    ``question_ids`` + ``options`` (+ ``answer`` index): an optional multiple-choice item
    scored by option log-likelihood after history + question.
    ``prefill_inputs``: extra model inputs of the history forward (VLM ``pixel_values``...).
    """

    history_ids: list[int]
    history_labels: list[str]
    eval_ids: list[int]
    question_ids: list[int] | None = None
    options: list[list[int]] | None = None
    answer: int | None = None
    prefill_inputs: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if len(self.history_ids) != len(self.history_labels):
            raise ValueError(f"sample {self.meta.get('id', '?')}: {len(self.history_ids)} history tokens but "
                             f"{len(self.history_labels)} labels")
        if len(self.eval_ids) < 1:
            raise ValueError(f"sample {self.meta.get('id', '?')}: needs at least one evaluated token")
        if self.options is not None:
            if not self.question_ids or len(self.options) < 2 or any(len(o) == 0 for o in self.options):
                raise ValueError(f"sample {self.meta.get('id', '?')}: multiple choice needs question tokens and "
                                 ">= 2 non-empty options")
            if self.answer is not None and not 0 <= self.answer < len(self.options):
                raise ValueError(f"sample {self.meta.get('id', '?')}: answer index {self.answer} out of range")


@dataclass
class PreparedSample:
    """A sample whose full-precision history K/V and FP evaluated log-probs are computed."""

    sample: Sample
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer ([1, H_kv, T, D], [1, H_kv, T, D])
    rows: torch.Tensor  # [R, L_max] evaluated rows: continuation, then question + option_i
    row_lengths: list[int]
    position_ids: torch.Tensor  # [R, L_max] or [3, R, L_max] (mrope)
    fp: dict[str, Any]  # FP log-probs at the scored positions and FP metrics
    labelling: Labelling = TOKEN_IDS  # how its history is labelled (checked), also in every plan cache
    # this process's recorded full-precision layer outputs (evaluate(..., reuse_prefix=True))
    replay: PrefixReplay | None = field(default=None, repr=False, compare=False)
    # per layer, the prefill's last queries [1, Hq, w, D], attention scaling and their mask rows (what
    # kvplan's attention function sees at a deployed prompt: they choose heavy-hitter copies)
    window_queries: dict[int, tuple[torch.Tensor, float, torch.Tensor | None]] | None = field(
        default=None, repr=False, compare=False)

    @property
    def history_len(self) -> int:
        return len(self.sample.history_ids)


# ----------------------------------------------------------------------------- helpers
def _num_layers(model) -> int:
    return text_config(model.config).num_hidden_layers


def _model_device(model):
    return next(model.parameters()).device


def _rope_owner(model):
    """The submodule computing multimodal (3-D) RoPE positions, if any."""
    for m in (getattr(model, "model", None), model):
        if m is not None and hasattr(m, "get_rope_index"):
            return m
    return None


def _rows(sample: Sample, pad_id: int) -> tuple[torch.Tensor, list[int]]:
    rows = [list(sample.eval_ids)]
    if sample.options:
        rows += [list(sample.question_ids) + list(o) for o in sample.options]
    lengths = [len(r) for r in rows]
    L = max(lengths)
    # Right padding: a valid token only attends to history + earlier valid tokens (causal),
    # so pads after it never change its logits; their logits are never read.
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return ids, lengths


def logits_to_keep(model, n: int) -> dict[str, int]:
    """``{"logits_to_keep": n}`` when ``model.forward`` can skip the vocabulary projection of all but the
    last ``n`` positions, else ``{}`` (the caller then slices the logits itself)."""
    return {"logits_to_keep": n} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


@torch.no_grad()
def _forward_rows(model, cache, rows: torch.Tensor, position_ids: torch.Tensor, keep: int | None = None
                  ) -> torch.Tensor:
    """Log-probs ``[R, L, V]`` of ``rows`` run against ``cache``; ``keep``: only the last ``keep``
    positions' (``[R, keep, V]``; the model skips the others' vocabulary projection where it can)."""
    dev = _model_device(model)
    extra = {} if keep is None else logits_to_keep(model, keep)
    out = model(input_ids=rows.to(dev), cache=cache, position_ids=position_ids.to(dev), use_cache=True, **extra)
    logits = out.logits if keep is None or extra else out.logits[:, -keep:]
    return torch.log_softmax(logits.float(), dim=-1)


def _score_rows(model, cache, rows: torch.Tensor, position_ids: torch.Tensor, sample: Sample
                ) -> dict[str, torch.Tensor]:
    """The log-probs the metrics need, run as a user runs them on ``cache`` (batch 1, history written):
    the continuation alone (the KL and NLL rows: the same forward, hence the same attention route,
    as a user's), then, after cropping it off again, the multiple-choice rows as one right-padded
    batch (answer-position distribution, option log-likelihoods)."""
    L_eval = len(sample.eval_ids)
    # position_ids: [R, L] or [3, R, L] (mrope); row 0 is the continuation
    logp = _forward_rows(model, cache, rows[:1, :L_eval], position_ids[..., :1, :L_eval])
    d = {"eval": logp[0].contiguous()}
    if sample.options:
        cache.crop(-L_eval)
        n_opt = len(sample.options)
        cache.batch_repeat_interleave(n_opt)
        # only positions q-1 .. L-1 are read (the answer position and each option's tokens), so the
        # question's positions skip the vocabulary projection (most of this forward on a large vocabulary)
        q, L = len(sample.question_ids), rows.shape[1]
        logp = _forward_rows(model, cache, rows[1:], position_ids[..., 1:, :], keep=L - q + 1)  # [n_opt, L-q+1, V]
        d["answer_pos"] = logp[0, 0].contiguous()  # [V] distribution of the first answer token (position q-1)
        lls = []
        for i, opt in enumerate(sample.options):
            pos = torch.arange(len(opt))  # positions q-1 .. q-2+len(opt) predict the option's tokens
            tgt = torch.tensor(opt, dtype=torch.long)
            lls.append(logp[i, pos, tgt].sum())
        d["option_ll"] = torch.stack(lls)
    return d


# float64 bytes of one chunk of rows in kl_divergence: its temporaries stay in the CPU caches (a whole
# [32, 262144] float64 temporary is 64 MiB, and every one of them is a fresh, page-faulted allocation)
_KL_CHUNK_BYTES = 1 << 20


def kl_divergence(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) per row from log-probs ``[..., V]``: ``sum exp(lp) (lp - lq)`` in float64, a few
    rows at a time (each row's arithmetic is the same whatever the chunk)."""
    V = lp.shape[-1]
    a2, b2 = lp.reshape(-1, V), lq.reshape(-1, V)
    out = torch.empty(a2.shape[0], dtype=torch.float64, device=lp.device)
    step = max(1, _KL_CHUNK_BYTES // (8 * V))
    for i in range(0, a2.shape[0], step):
        a, d = a2[i : i + step].double(), b2[i : i + step].double()
        torch.sub(a, d, out=d)  # lp - lq
        out[i : i + step] = a.exp_().mul_(d).sum(-1)
    return out.reshape(lp.shape[:-1]).clamp_min(0.0)


def _nll(lp: torch.Tensor, eval_ids: Sequence[int]) -> float:
    if len(eval_ids) < 2:
        return float("nan")
    tgt = torch.tensor(eval_ids[1:], dtype=torch.long)
    return float(-lp[:-1].gather(-1, tgt[:, None]).double().mean())


def _choice(option_ll: torch.Tensor, options: list[list[int]]) -> int:
    return int(torch.argmax(option_ll).item())


# ----------------------------------------------------------------------------- preparation
def check_labels(model, sample: Sample, labelling: Labelling | None = None) -> None:
    """Raise :class:`ProtocolError` unless the sample's modality labels are the ones the runtime
    gives its tokens at deployment (``kvplan.load`` labels prompts with ``labelling``, default
    their token ids): a label deployment cannot reproduce must never shape or score a plan."""
    labelling = resolve_labelling(labelling)
    runtime = labelling(torch.tensor([sample.history_ids]), model.config)[0]
    if list(sample.history_labels) != runtime:
        t = next(i for i, (a, b) in enumerate(zip(sample.history_labels, runtime)) if a != b)
        raise ProtocolError(f"sample {sample.meta.get('id', '?')}: history token {t} is labelled "
                            f"{sample.history_labels[t]!r} but kvplan.load labels it {runtime[t]!r} (labelling "
                            f"{labelling.name!r}); labels must be the runtime's")


@torch.no_grad()
def prepare_sample(model, sample: Sample, pad_id: int = 0, attention: str = "auto",
                   labelling: Labelling | None = None) -> PreparedSample:
    """Prefill ``sample``'s history once at full precision and score the FP reference.

    The reference's evaluated tokens attend through ``attention`` (the route plans are then
    scored on, see :func:`evaluate`), so an all-16-bit plan scores KL exactly 0. ``labelling``:
    how deployment labels the prompt (default: token ids); the sample's labels must be its."""
    from transformers import DynamicCache

    dev = _model_device(model)
    ids = torch.tensor([sample.history_ids], dtype=torch.long, device=dev)
    labelling = resolve_labelling(labelling)
    check_labels(model, sample, labelling)
    inputs = {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in sample.prefill_inputs.items()}
    if "pixel_values" in inputs and torch.is_floating_point(inputs["pixel_values"]):
        inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    # a cache of full layers only: it keeps every history token of sliding-window layers too (the
    # prefill's outputs are the same, the model's masks apply the windows), so each plan's cache can
    # be written the whole history, as a deployed prefill writes it
    cache = DynamicCache()
    rope = _rope_owner(model)
    if rope is not None:
        rope.rope_deltas = None
    window_queries: dict = {}
    with recording_window_queries(model, window_queries):
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1, **inputs)
    T = ids.shape[1]
    kv = []
    for i in range(_num_layers(model)):
        layer = cache.layers[i]
        if layer.keys.shape[-2] != T:
            raise ProtocolError(f"layer {i} of the FP prefill holds {layer.keys.shape[-2]} tokens, expected {T}")
        kv.append((layer.keys.detach().clone(), layer.values.detach().clone()))
    rows, lengths = _rows(sample, pad_id)
    R, L = rows.shape
    pos = torch.arange(T, T + L, dtype=torch.long)[None].expand(R, L)
    deltas = getattr(rope, "rope_deltas", None) if rope is not None else None
    if deltas is not None:  # mrope: text tokens after the history share one position on all 3 axes
        pos = (pos + deltas.reshape(-1)[0].to("cpu").long())[None].expand(3, R, L)
    prepared = PreparedSample(sample, kv, rows, lengths, pos.contiguous(), {}, labelling,
                              window_queries=window_queries)
    with attention_route(model, attention):
        sc = _score_rows(model, _fp_cache(model, prepared), rows, prepared.position_ids, sample)
    fp = {"scored": sc, "nll": _nll(sc["eval"], sample.eval_ids), "top1_ids": sc["eval"].argmax(-1)}
    if sample.options:
        fp["choice"] = _choice(sc["option_ll"], sample.options)
        fp["correct"] = None if sample.answer is None else float(fp["choice"] == sample.answer)
    prepared.fp = fp
    return prepared


def _fp_cache(model, prepared: PreparedSample):
    """The model's own full-precision cache holding the history: ``DynamicCache`` built from the
    config, so sliding-window layers keep only their window, as in a plain ``generate``."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(prepared.kv):
        layer = cache.layers[i]
        if prepared.sample.options and hasattr(layer, "activate_past_recording"):
            # the continuation is cropped off again before the multiple-choice rows; a sliding layer
            # past its window can only be cropped when it records the past (reads are unchanged)
            layer.activate_past_recording()
        layer.update(k.clone(), v.clone())
    return cache


def prepare_samples(model, samples: Sequence[Sample], pad_id: int = 0, progress: bool = True,
                    attention: str = "auto", labelling: Labelling | None = None, processes: int = 1
                    ) -> list[PreparedSample]:
    """:func:`prepare_sample` of every sample; ``processes > 1``: in that many CPU processes at
    once (:func:`kvplan.evaluation.parallel.map_forked`; the same tensors, bit for bit)."""
    from tqdm.auto import tqdm

    from .parallel import check_processes, map_forked

    labelling = resolve_labelling(labelling)
    check_processes(model, processes)
    if processes == 1:
        return [prepare_sample(model, s, pad_id, attention, labelling) for s in tqdm(samples, desc="FP prefill",
                                                                            disable=not progress, leave=False)]

    def prepare(s):  # the labelling (maybe a user's closure) stays here: it is not pickled back
        return replace(prepare_sample(model, s, pad_id, attention, labelling), labelling=TOKEN_IDS)

    out = map_forked(prepare, list(samples), processes, [len(s.history_ids) + len(s.eval_ids) for s in samples])
    return [replace(p, labelling=labelling) for p in out]


# ----------------------------------------------------------------------------- caches
def build_plan_cache(model, plan: Plan, prepared: PreparedSample) -> KVPlanCache:
    """A :class:`KVPlanCache` holding ``prepared``'s history, made and labelled by
    :func:`kvplan.make_cache` (the deployment's code) and quantized by the runtime."""
    cache = make_cache(model, plan, torch.tensor([prepared.sample.history_ids]), labelling=prepared.labelling)
    for i, (k, v) in enumerate(prepared.kv):
        layer = cache.layers[i]
        layer.update(k, v)
        if layer.heavy is not None and layer.heavy.pending:
            # what kvplan's attention function does at a deployed prompt: its last queries (recorded
            # by the full-precision prefill) score the committed tokens for the heavy-hitter copies
            if prepared.window_queries is None or i not in prepared.window_queries:
                raise ProtocolError(f"layer {i}: the sample's prefill recorded no queries to choose the plan's "
                                    "heavy-hitter copies (quantizer.heavy_length) with")
            query, scaling, mask = prepared.window_queries[i]
            layer.observe_prompt(query, k, scaling, mask)
    return cache


def full_precision_bytes(cache: KVPlanCache) -> int:
    """Bytes ``cache`` holds in the model dtype: committed 16-bit (unquantized) slots and the residual
    tokens, recent copies, streamed heads' window copies and heavy-hitter copies held as written (all of
    them, unless ``quantizer.residual_bits`` codes them)."""
    n = 0
    for layer in cache.layers:
        for kind in KINDS:
            for seg in getattr(layer, "segments", {}).get(kind, []):
                for block in seg.blocks:
                    if block.bits == FULL_PRECISION_BITS:
                        n += block.codes.nbytes
            for held in (getattr(layer, "residual", {}).get(kind), getattr(layer, "recent", {}).get(kind),
                         (getattr(layer, "stream_copies", None) or {}).get(kind)):
                if held is not None:  # the residual, the recent copies and the streamed heads' window copies
                    n += held.fresh.nbytes
            heavy = getattr(layer, "heavy", None)
            if heavy is not None and torch.is_tensor(heavy.copies[kind]):  # heavy-hitter copies as written
                n += heavy.copies[kind].nbytes
    return n


def cache_stats(cache: KVPlanCache, prepared: PreparedSample, plan: Plan) -> dict[str, Any]:
    """What the cache actually stores for the history: quantized tokens per (kind, modality,
    bits) -- in tokens and in raw token-heads-layers -- and honest bpv from its real bytes."""
    g = cache.geometry
    raw = cache.stored_token_bits()  # (kind, modality, bits) -> token-heads summed over layers
    per = g.num_layers * g.num_kv_heads
    tokens: dict[str, dict[str, dict[str, float]]] = {}
    quantized: dict[str, dict[str, float]] = {}
    streamed: dict[str, dict[str, float]] = {}
    for (kind, mod, bits), n in sorted(raw.items()):
        tokens.setdefault(kind, {}).setdefault(mod, {})[str(bits)] = n / per
        if bits < FULL_PRECISION_BITS:  # coded, or (bits 0) a streamed head's, not stored at all
            into = quantized if bits > 0 else streamed
            into.setdefault(kind, {}).setdefault(mod, 0.0)
            into[kind][mod] += n / per
    parts = cache.nbytes_breakdown()
    nvals = cache.num_values()
    elem = prepared.kv[0][0].element_size()
    fp_bytes = full_precision_bytes(cache)
    bytes16 = parts["total"] - fp_bytes + fp_bytes * 2 // elem
    expected = plan_bytes(plan, g, cache.labels_for(0, prepared.history_len), fp_bytes=elem)
    out = {
        "history_tokens": prepared.history_len,
        "history_modalities": dict(Counter(prepared.sample.history_labels)),
        "token_bits": tokens,  # kind -> modality -> bits -> tokens (per layer and head)
        "quantized_tokens": quantized,  # kind -> modality -> tokens stored as codes (1-15 bits)
        "streamed_tokens": streamed,  # kind -> modality -> tokens a streamed head does not store (bits 0)
        "raw_token_bits": {f"{k}/{m}/{b}": int(n) for (k, m, b), n in sorted(raw.items())},
        "nbytes": parts,
        "num_values": nvals,
        "bpv_measured": cache.bpv(),  # 8 * real bytes / values, full precision held in the model dtype
        "bpv": 8 * bytes16 / nvals if nvals else 0.0,  # same bytes with full precision counted at 16 bits
        "storage_bits": 8 * elem,
    }
    # what plans.accounting predicts for this layout at the model dtype's storage: must equal "bpv_measured"
    out["bpv_accounting"] = 8 * sum(expected.values()) / nvals if nvals else 0.0
    return out


def check_quantized(stats: dict, expect: Iterable[tuple[str, str]] | None, where: str = "") -> None:
    """Raise :class:`ProtocolError` if a ``(kind, modality)`` meant to be quantized has zero tokens quantized."""
    for kind, mod in expect or ():
        n = stats["quantized_tokens"].get(kind, {}).get(mod, 0.0)
        if n <= 0:
            present = stats["history_modalities"].get(mod, 0)
            raise ProtocolError(
                f"{where}condition meant to quantize {'keys' if kind == 'k' else 'values'} of modality {mod!r} "
                f"quantized zero of its tokens (history has {present} {mod!r} tokens of "
                f"{stats['history_tokens']}; tokens inside the full-precision residual or the trailing partial "
                "group are never quantized)")


def check_commits_any(plan: Plan, samples: Sequence[Sample], where: str = "") -> None:
    """Raise :class:`ProtocolError` before any measurement when ``samples``' histories commit no token of a
    ``(kind, modality)`` the plan quantizes (:func:`intended_quantized`): each history of ``T`` tokens holds
    only its oldest ``committed_length(T)`` in the plan's groups, the rest in the residual or the trailing
    partial group. What :func:`check_quantized` would say after the run, said before it."""
    q = plan.quantizer
    committed = Counter()
    for s in samples:
        committed.update(s.history_labels[:committed_length(len(s.history_ids), q.residual_length, q.group_size)])
    for kind, mod in intended_quantized(plan):
        if not committed[mod]:
            lengths = sorted({len(s.history_ids) for s in samples})
            raise ProtocolError(
                f"{where}condition meant to quantize {'keys' if kind == 'k' else 'values'} of modality {mod!r} "
                f"would quantize zero of its tokens: histories of {lengths[0]}"
                f"{f' to {lengths[-1]}' if len(lengths) > 1 else ''} tokens commit none at group_size "
                f"{q.group_size} + residual_length {q.residual_length} (use longer histories)")


def intended_quantized(plan: Plan) -> list[tuple[str, str]]:
    """``(kind, modality)`` pairs the plan stores as codes (1-15 bits) somewhere; streamed heads (bits 0)
    store nothing to quantize."""
    t = plan.table()
    out = []
    for k, kind in enumerate(KINDS):
        for m, mod in enumerate(plan.modalities):
            slots = t[:, :, k, m]
            if ((slots > 0) & (slots < FULL_PRECISION_BITS)).any():
                out.append((kind, mod))
    return out


# ----------------------------------------------------------------------------- scoring
def _metrics(prepared: PreparedSample, sc: dict[str, torch.Tensor]) -> dict[str, float]:
    s = prepared.sample
    fp = prepared.fp["scored"]
    kl = kl_divergence(fp["eval"], sc["eval"])
    out = {
        "kl": float(kl.mean()),
        "kl_max": float(kl.max()),
        "nll": _nll(sc["eval"], s.eval_ids),
        "nll_fp": prepared.fp["nll"],
        "top1": float((prepared.fp["top1_ids"] == sc["eval"].argmax(-1)).double().mean()),
    }
    out["delta_nll"] = out["nll"] - out["nll_fp"]
    if s.options:
        out["kl_answer"] = float(kl_divergence(fp["answer_pos"], sc["answer_pos"]))
        choice = _choice(sc["option_ll"], s.options)
        out["choice_agree"] = float(choice == prepared.fp["choice"])
        if s.answer is not None:
            out["acc"] = float(choice == s.answer)
            out["acc_fp"] = prepared.fp["correct"]
    return out


@torch.no_grad()
def score_cache(model, prepared: PreparedSample, cache, prefix_key: str | None = None) -> dict[str, float]:
    """Run the evaluated rows of ``prepared`` against ``cache`` (history already written, batch 1).

    ``prefix_key`` (a :func:`kvplan.evaluation.prefix.settings_key` of ``cache.plan``): replay the
    recorded outputs of the full-precision layers before the plan's first quantized layer instead
    of running them (same numbers; see :mod:`kvplan.evaluation.prefix`)."""
    if hasattr(cache, "pause_commits"):
        # The evaluated tokens reach attention at full precision either way (a KVPlanLayer returns
        # what it reads *before* committing); not quantizing them afterwards keeps them in the
        # residual, so the continuation can be cropped off before the multiple-choice rows.
        cache.pause_commits()
    skip = nullcontext()
    layers = decoder_layers(model) if prefix_key is not None and not prepared.sample.options else None
    if layers is not None:
        if prepared.replay is None:
            prepared.replay = PrefixReplay()
        skip = prepared.replay.around(layers, prefix_key, first_quantized_layer(cache.plan))
    with skip:
        scored = _score_rows(model, cache, prepared.rows, prepared.position_ids, prepared.sample)
    return _metrics(prepared, scored)


@torch.no_grad()
def evaluate_plan_sample(model, plan: Plan, prepared: PreparedSample,
                         expect_quantized: Iterable[tuple[str, str]] | None = None,
                         prefix_key: str | None = None) -> dict[str, Any]:
    """One sample's metrics and cache statistics under ``plan`` (``prefix_key``: see :func:`score_cache`)."""
    cache = build_plan_cache(model, plan, prepared)
    stats = cache_stats(cache, prepared, plan)
    check_quantized(stats, expect_quantized, where=f"sample {prepared.sample.meta.get('id', '?')}: ")
    metrics = score_cache(model, prepared, cache, prefix_key)
    return {"metrics": metrics, "cache": stats}


# ----------------------------------------------------------------------------- aggregation
def bootstrap_ci(values: Sequence[float], n_boot: int = 2000, seed: int = 0, stat: Callable = np.mean,
                 alpha: float = 0.05) -> tuple[float, float, float]:
    """``(statistic, low, high)``: percentile bootstrap over samples (seeded)."""
    x = np.asarray([v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))], float)
    if x.size == 0:
        return float("nan"), float("nan"), float("nan")
    est = float(stat(x))
    if x.size == 1:
        return est, est, est
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_boot, x.size))
    boots = np.array([stat(x[i]) for i in idx]) if stat is not np.mean else x[idx].mean(axis=1)
    lo, hi = np.quantile(boots, [alpha / 2, 1 - alpha / 2])
    return est, float(lo), float(hi)


def bootstrap_ratio(num: Sequence[float], den: Sequence[float], n_boot: int = 2000, seed: int = 0,
                    alpha: float = 0.05) -> tuple[float, float, float]:
    """Ratio of means ``mean(num) / mean(den)`` with a paired (same samples) bootstrap CI."""
    a, b = np.asarray(num, float), np.asarray(den, float)
    if a.shape != b.shape or a.size == 0:
        raise ValueError("bootstrap_ratio needs paired, non-empty per-sample values")
    est = float(a.mean() / b.mean()) if b.mean() > 0 else float("inf")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, a.size, size=(n_boot, a.size))
    with np.errstate(divide="ignore", invalid="ignore"):
        r = a[idx].mean(1) / b[idx].mean(1)
    lo, hi = np.quantile(r, [alpha / 2, 1 - alpha / 2])
    return est, float(lo), float(hi)


METRIC_KEYS = ("kl", "kl_max", "nll", "nll_fp", "delta_nll", "top1", "kl_answer", "acc", "acc_fp", "choice_agree")


def aggregate(per_sample: Sequence[dict[str, Any]], seed: int = 0, n_boot: int = 2000) -> dict[str, Any]:
    """Means with bootstrap 95% CIs over samples, plus summed cache statistics."""
    out: dict[str, Any] = {"n": len(per_sample)}
    for k in METRIC_KEYS:
        vals = [r["metrics"][k] for r in per_sample if r["metrics"].get(k) is not None]
        if vals:
            m, lo, hi = bootstrap_ci(vals, n_boot=n_boot, seed=seed)
            out[k] = {"mean": m, "ci95": [lo, hi]}
    # quantized history tokens: summed over samples (tokens), per kind and modality
    q: dict[str, dict[str, float]] = {}
    streamed: dict[str, dict[str, float]] = {}
    tb: dict[str, dict[str, dict[str, float]]] = {}
    raw: Counter = Counter()
    for r in per_sample:
        c = r["cache"]
        for key, into in (("quantized_tokens", q), ("streamed_tokens", streamed)):
            for kind, mods in c.get(key, {}).items():
                for mod, n in mods.items():
                    into.setdefault(kind, {}).setdefault(mod, 0.0)
                    into[kind][mod] += n
        for kind, mods in c["token_bits"].items():
            for mod, bits in mods.items():
                for b, n in bits.items():
                    tb.setdefault(kind, {}).setdefault(mod, {}).setdefault(b, 0.0)
                    tb[kind][mod][b] += n
        raw.update(c["raw_token_bits"])
    out["quantized_tokens"] = q
    out["streamed_tokens"] = streamed
    out["token_bits"] = tb
    out["raw_token_bits"] = dict(sorted(raw.items()))
    out["history_tokens"] = int(sum(r["cache"]["history_tokens"] for r in per_sample))
    nbytes = Counter()
    for r in per_sample:
        nbytes.update(r["cache"]["nbytes"])
    nvals = sum(r["cache"]["num_values"] for r in per_sample)
    out["nbytes"] = dict(nbytes)
    out["num_values"] = nvals
    # pooled over samples: total bits / total values
    out["bpv"] = sum(r["cache"]["bpv"] * r["cache"]["num_values"] for r in per_sample) / nvals if nvals else 0.0
    out["bpv_measured"] = 8 * nbytes["total"] / nvals if nvals else 0.0
    if per_sample and all("bpv_accounting" in r["cache"] for r in per_sample):
        out["bpv_accounting"] = sum(r["cache"]["bpv_accounting"] * r["cache"]["num_values"]
                                    for r in per_sample) / nvals if nvals else 0.0
    out["storage_bits"] = per_sample[0]["cache"]["storage_bits"] if per_sample else None
    return out


def evaluate(model, plan, prepared: Sequence[PreparedSample], *, expect_quantized="auto", seed: int = 0,
             progress: bool = True, desc: str | None = None, keep_samples: bool = True,
             attention: str = "auto", processes=1, reuse_prefix: bool = False) -> dict[str, Any]:
    """Evaluate one plan (a :class:`Plan`, YAML path or baseline name) on prepared samples.

    ``attention``: the route the evaluated tokens attend through, as ``kvplan.load(model,
    plan, attention=...)`` deploys it (``"auto"``: chunked kernel on CPU, Triton on CUDA;
    ``"dequantize"``: the model's own attention over the dequantized history).

    ``expect_quantized``: ``(kind, modality)`` pairs that must have quantized tokens in
    *every* sample (checked per sample, raises :class:`ProtocolError`). ``"auto"``: every
    pair the plan stores below 16 bits for a non-``text`` modality present in the history
    (``text`` for a single-modality plan) must have quantized tokens in at least one sample.

    ``processes``: score the samples in this many CPU processes at once (an int; see
    :mod:`kvplan.evaluation.parallel`), or a :class:`~kvplan.evaluation.parallel.SampleProcesses`
    made for these ``prepared`` samples and kept across calls. Same numbers as ``1``.

    ``reuse_prefix``: run the model only from the plan's first quantized layer on, replaying the
    full-precision layers before it as recorded by earlier evaluations of plans with the same
    codec settings (:mod:`kvplan.evaluation.prefix`; same numbers, for the sensitivity profile).
    """
    from tqdm.auto import tqdm

    from .parallel import SampleProcesses

    plan = resolve_plan(plan, model, prepared[0].labelling if prepared else None)
    for labelling in {id(p.labelling): p.labelling for p in prepared}.values() or (TOKEN_IDS,):
        check_modalities(plan, model, labelling=labelling)
    auto = expect_quantized == "auto"
    expect = None if auto else expect_quantized
    prefix_key = settings_key(plan, attention) if reuse_prefix else None
    if isinstance(processes, SampleProcesses):
        if len(processes.prepared) != len(prepared) or any(a is not b for a, b in zip(processes.prepared, prepared)):
            raise ValueError("processes: a SampleProcesses made for other prepared samples")
        per = processes.evaluate_samples(plan, attention, expect, prefix_key)
    elif processes != 1:
        pool = SampleProcesses(model, prepared, processes)
        try:
            per = pool.evaluate_samples(plan, attention, expect, prefix_key)
        finally:
            pool.close()
    else:
        per = []
        with attention_route(model, attention, plan):
            for p in tqdm(prepared, desc=desc or (plan.name or "plan"), disable=not progress, leave=False):
                per.append(evaluate_plan_sample(model, plan, p, expect, prefix_key))
    for r, p in zip(per, prepared):
        r["id"] = p.sample.meta.get("id")
    if auto:
        present = set()
        for p in prepared:
            present.update(p.sample.history_labels)
        single = len(plan.modalities) == 1
        for kind, mod in intended_quantized(plan):
            if single or (mod in present and mod != "text"):
                if not any(r["cache"]["quantized_tokens"].get(kind, {}).get(mod, 0) > 0 for r in per):
                    check_quantized(per[0]["cache"], [(kind, mod)], where=f"plan {plan.name or '<unnamed>'}, all "
                                                                           f"{len(per)} samples: ")
    agg = aggregate(per, seed=seed)
    agg["plan"] = plan.name
    if keep_samples:
        agg["samples"] = [{"id": r["id"], **r["metrics"], "bpv": r["cache"]["bpv"],
                           "quantized_tokens": r["cache"]["quantized_tokens"]} for r in per]
    return agg
