"""``kvplan.load``: make a model's ``generate`` run on a plan's quantized cache."""

from __future__ import annotations

import contextlib
import math
import os
import types
import warnings

import torch

from ..errors import FILE_PATH, CacheError, PlanError
from ..models.geometry import Geometry, storage_bits, text_config
from ..models.modality import Labelling, resolve_labelling
from ..models.rope import rope_inv_freq
from ..plans import BASELINES, Plan, at_model_width, baseline_plan, is_baseline_name
from .cache import KVPlanCache


def resolve_plan(plan, model_or_geometry, labelling: Labelling | None = None) -> Plan:
    """A :class:`Plan` from a Plan, a YAML path, or a baseline name (``int4``, ``k4v2-g64``...),
    checked against the model's geometry. A baseline covers the modalities ``labelling``
    (default: token ids) gives the model's prompts, records that labelling, and states its bpv at the
    model's full-precision width (fp32: 32 bits; given a :class:`Geometry` or a config, 16)."""
    geometry = Geometry.of(model_or_geometry)
    source = None
    if isinstance(plan, Plan):
        resolved = plan
    elif isinstance(plan, (str, os.PathLike)) and os.path.exists(plan):
        source = os.fspath(plan)
        resolved = Plan.from_yaml(plan)
    elif is_baseline_name(plan):
        labelling = resolve_labelling(labelling)
        resolved = baseline_plan(plan, geometry, modalities=labelling.modalities(_config(model_or_geometry)),
                                 labelling=labelling.name, **at_model_width(model_or_geometry))
    elif isinstance(plan, (str, os.PathLike)) and os.fspath(plan).endswith((".yaml", ".yml")):
        raise PlanError(FILE_PATH, "plan file not found", show_value=False, source=os.fspath(plan))
    else:
        raise PlanError("plan", f"expected a Plan, a YAML file path or a baseline name {sorted(BASELINES)}", plan)
    resolved.check_geometry(geometry, source=source)
    _check_rope(resolved, model_or_geometry, source)
    return resolved


def _check_rope(plan: Plan, model, source: str | None) -> None:
    """Warn when a plan quantizes keys in a pre-RoPE frame built for other RoPE frequencies:
    reads stay exact (the same rotation is undone), only the accuracy gain is lost."""
    if plan.rope_inv_freq is None:
        return
    theirs = rope_inv_freq(model)
    if theirs is None:
        return
    for layer, layer_type in enumerate(plan.geometry.layer_types):  # each layer type's RoPE base
        mine = plan.layer_inv_freq(layer)
        model_freqs = theirs[layer_type] if isinstance(theirs, dict) else theirs
        if len(model_freqs) != len(mine) or not all(
                math.isclose(a, b, rel_tol=1e-5) for a, b in zip(model_freqs, mine)):
            if not _first_time(model, "_kvplan_rope_warned", (tuple(mine), tuple(model_freqs))):
                return  # once per model and frequencies, not at every generate (each makes a cache)
            if len(model_freqs) != len(mine):
                how = f"{len(mine)} values, the model's {len(model_freqs)}"
            else:
                gap = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(model_freqs, mine))
                how = f"relative difference up to {gap:.1e}"
            dtypes = {str(b.dtype).removeprefix("torch.") for n, b in model.named_buffers() if n.endswith("inv_freq")}
            low = sorted(dtypes & {"bfloat16", "float16"})
            hint = f"; this model keeps them in {low[0]}, which rounds them" if low else ""
            warnings.warn(f"{source or 'plan'}: rope_inv_freq of layer {layer} ({layer_type}) differs from this "
                          f"model's RoPE frequencies ({how}{hint}); keys are still read back exactly, but are "
                          "quantized in a frame that does not undo this model's RoPE (less accurate than searched)",
                          UserWarning, stacklevel=3)
            return


def _first_time(model, name: str, key) -> bool:
    """Whether ``key`` is new to the set ``model.<name>`` (then added): a warning given once per model and
    ``key``, not at every cache ``generate`` makes."""
    seen = model.__dict__.setdefault(name, set())
    if key in seen:
        return False
    seen.add(key)
    return True


def _config(model_or_geometry):
    return getattr(model_or_geometry, "config", None)


def labelling_in_force(model, labelling: Labelling | None = None) -> Labelling:
    """``labelling``, else the one ``kvplan.load`` installed on ``model``, else the default."""
    return resolve_labelling(labelling if labelling is not None else getattr(model, "_kvplan_labelling", None))


def check_modalities(plan: Plan, model, source: str | None = None, labelling: Labelling | None = None) -> None:
    """Refuse a plan searched with another labelling than ``labelling`` (by name), or with
    modalities it never produces for ``model``'s prompts: their rules would never apply, so the
    plan would not deploy as it was searched."""
    labelling = resolve_labelling(labelling)
    if plan.labelling != labelling.name:
        raise PlanError("labelling", f"the plan was searched with the token labelling {plan.labelling!r}, but this "
                        f"model labels prompts with {labelling.name!r}; pass the plan's labelling to kvplan.load "
                        "(labelling=...) so tokens get the labels the plan was searched on", plan.labelling,
                        source=source)
    producible = labelling.modalities(_config(model))
    foreign = [m for m in plan.modalities if m not in producible]
    if foreign:
        raise PlanError("modalities", f"{foreign} cannot be produced by the token labelling {labelling.name!r} of "
                        f"this model (it labels prompt tokens {list(producible)}); the plan was made for another "
                        "labelling and would not store what it was searched for", list(plan.modalities),
                        source=source)


def make_cache(model, plan, input_ids=None, attention_mask=None, labelling: Labelling | None = None) -> KVPlanCache:
    """A fresh :class:`KVPlanCache` for ``model``; with ``input_ids`` its prompt is labelled by
    ``labelling`` (default: the one ``kvplan.load`` installed, else token ids: image/video tokens
    of a VLM are ``"visual"``, the rest ``"text"``); with a left-padded ``attention_mask`` each
    row is stored as it would be unpadded (:meth:`KVPlanCache.align_to_padding`). If ``kvplan.load`` (or
    :func:`attention_route`) put the model on the fused attention, the cache uses it."""
    kernel = getattr(model, "_kvplan_attention_kernel", None)
    labelling = labelling_in_force(model, labelling)
    resolved = resolve_plan(plan, model, labelling)
    cache = KVPlanCache(resolved, model, attention_kernel=kernel)  # refuses streamed heads outside kvplan's attention
    cache.align_to_padding(attention_mask)  # a left-padded batch: each row's sinks and key frame as unpadded
    if input_ids is not None:
        check_modalities(resolved, model, labelling=labelling)
        cache.assign_labels(labelling(torch.as_tensor(input_ids), model.config, attention_mask), attention_mask)
    return cache


ATTENTION_MODES = ("auto", "triton", "native", "chunked", "dequantize")
def _attention_kernel(model, attention: str):
    """The decode-attention kernel to use, or ``None`` for dequantize-then-attend."""
    from ..kernels import decode_attention_kernel, native_unavailable, triton_available

    if attention not in ATTENTION_MODES:
        raise PlanError("attention", f"must be one of {list(ATTENTION_MODES)}", attention)
    if attention == "dequantize":
        return None
    on_cuda = next(model.parameters()).is_cuda
    head_dim = Geometry.of(model).head_dim
    if attention == "auto":  # Triton on CUDA when it imports, else native C loops (or chunked, with a warning)
        return decode_attention_kernel(cuda=on_cuda, head_dim=head_dim)
    if attention == "chunked":
        from ..kernels.attention_chunked import chunked_decode_attention

        return chunked_decode_attention
    if attention == "native":
        if on_cuda:
            raise PlanError("attention", "the native kernel runs on CPU models (CUDA models use Triton)", attention)
        why = native_unavailable(head_dim)
        if why is not None:
            raise PlanError("attention", f"native CPU kernel unavailable: {why}", attention)
        from ..kernels.attention_native import native_decode_attention

        return native_decode_attention
    if not triton_available():
        raise PlanError("attention", "Triton kernels requested but Triton cannot be imported", attention)
    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise PlanError("attention", "Triton kernels need a CUDA model (or TRITON_INTERPRET=1 on CPU)", attention)
    from ..kernels.triton_kernels import packed_decode_attention

    return packed_decode_attention


def load(model, plan, attention: str = "auto", labelling: Labelling | None = None):
    """Validate ``plan`` (a path, a :class:`Plan` or a baseline name) against ``model`` and
    make ``model.generate(...)`` use a fresh quantized cache following it on every call.

    ``attention`` (decode steps; prefill always dequantizes and runs the model's attention):
    ``"auto"`` uses the fused Triton decode attention on CUDA when Triton imports, and on the
    CPU the native kernel (``kernels/attention_native.py``: C loops compiled at first use that
    read the packed codes tile by tile), or -- no C compiler, or a head_dim above 256 -- the
    chunked PyTorch kernel (``kernels/attention_chunked.py``: dequantizes a cache-sized chunk
    at a time, never the whole history) with a warning saying why; ``"triton"``, ``"native"``,
    ``"chunked"`` or ``"dequantize"`` (dequantize the history, then the model's own attention)
    force one.
    ``labelling``: the :class:`~kvplan.Labelling` the plan was searched with, when it was not
    the default (token ids); a plan searched with another labelling is refused, naming it.
    Returns the model. A :class:`KVPlanCache` passed to ``generate`` (``cache=`` or ``past_key_values=``:
    a fresh one, one after ``reset()``, or a conversation's so far) is prepared as ``make_cache`` prepares
    a new one: aligned to the prompt's left padding when empty, and the prompt tokens past what it holds
    labelled from the ids (``input_ids=``, ``inputs=`` or positional) unless the caller labelled them. A
    plan with several modalities refuses a prompt given without token ids (``inputs_embeds`` only). A
    left-padded prompt without ``attention_mask`` is aligned to the mask ``generate`` infers from
    ``pad_token_id``. Another kind of cache passed in, a ``cache_implementation`` (per call or in
    ``model.generation_config``), and ``output_attentions`` where kvplan's attention runs are refused.
    ``kvplan.unload(model)`` restores the original ``generate`` and attention.
    """
    labelling = resolve_labelling(labelling)
    source = os.fspath(plan) if isinstance(plan, (str, os.PathLike)) else None
    resolved = resolve_plan(plan, model, labelling)
    check_modalities(resolved, model, source=source, labelling=labelling)
    _check_storage_width(resolved, model, source)
    kernel = _attention_kernel(model, attention)
    # heavy-hitter copies are chosen by a prompt's attention, and streamed KV heads mask what they do not
    # store: kvplan's attention function runs on the dequantize route too
    observe = resolved.quantizer.heavy_length > 0 or streams(resolved)
    if kernel is not None or observe:
        _check_attention_features(model, attention)
    unload(model)
    _install_attention(model, kernel, observe=observe)
    # bound methods, so that a deepcopy of the model generates with the copy, not with this model
    model._kvplan_original_generate = model.generate
    model.generate = types.MethodType(_generate, model)
    model.kvplan_plan = resolved
    model._kvplan_labelling = labelling
    return model


def _generate(self, *args, **kwargs):
    """``generate`` of a model under :func:`kvplan.load`: a fresh :class:`KVPlanCache` following
    ``self.kvplan_plan`` for each call (unless caching is off), or the caller's one prepared for the
    prompt; then the model's own ``generate``. Options that would put another cache in its place, or
    ask kvplan's attention for weights it does not return, are refused."""
    cache_keyword = "cache" if kwargs.get("cache") is not None else "past_key_values"
    given = kwargs.get(cache_keyword)
    # transformers names generate's first parameter `inputs`; `input_ids=` is the usual keyword
    input_ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    uses_cache = _uses_cache(self, kwargs)
    _check_generate_options(self, kwargs, given, cache_keyword, uses_cache)
    mask = kwargs.get("attention_mask")
    if mask is None and input_ids is not None:  # generate infers one from pad_token_id: align to the same
        mask = _inferred_attention_mask(self, kwargs, input_ids)
    _check_storage_width(self.kvplan_plan, self, None)  # the model may have been cast since load (model.to(...))
    if given is None and uses_cache:
        _require_ids(self.kvplan_plan, input_ids, None)
        kwargs["cache"] = make_cache(self, self.kvplan_plan, input_ids, mask)
    elif isinstance(given, KVPlanCache):  # the caller's cache: fresh, reset, or a conversation's so far
        _label_new_prompt(self, given, input_ids, mask)
    return self._kvplan_original_generate(*args, **kwargs)


def _generation_option(model, kwargs, name: str):
    """``(value, where)`` of a generation option as ``generate`` resolves it: the keyword, else the
    ``generation_config`` passed, else the model's own ``generation_config``; ``(None, None)`` where
    none sets it."""
    if name in kwargs:
        return kwargs[name], f"{name}="
    for where, config in (("generation_config=", kwargs.get("generation_config")),
                          ("model.generation_config", getattr(model, "generation_config", None))):
        value = getattr(config, name, None)
        if value is not None:
            return value, where
    return None, None


def _uses_cache(model, kwargs) -> bool:
    """``use_cache`` as ``generate`` resolves it (:func:`_generation_option`); unset (None) is on."""
    value, _ = _generation_option(model, kwargs, "use_cache")
    return value is None or bool(value)


def _check_generate_options(model, kwargs, given, cache_keyword: str, uses_cache: bool) -> None:
    """Refuse a ``generate`` call that would not run on the plan's cache: a cache of another kind passed
    in, a ``cache_implementation`` (transformers would build its own cache, or switch to continuous
    batching and drop ours), or ``output_attentions`` while kvplan's attention function (which returns
    no weights) runs the model's attention."""
    if given is not None and not isinstance(given, KVPlanCache):
        raise CacheError(f"generate got a {type(given).__name__} as {cache_keyword}=, but under kvplan.load the "
                         "plan's quantized cache is the cache: pass none, or a KVPlanCache from "
                         "kvplan.make_cache(model, plan, input_ids) (kvplan.unload(model) to generate on another)")
    implementation, where = _generation_option(model, kwargs, "cache_implementation")
    if implementation not in (None, "hybrid") and uses_cache:  # transformers drops "hybrid" itself
        raise CacheError(f"generate's cache_implementation={implementation!r} (from {where}) asks transformers "
                         "for its own cache, which would not follow the plan: under kvplan.load the plan's "
                         "quantized cache is the cache (leave cache_implementation unset, or kvplan.unload(model))")
    attentions, where = _generation_option(model, kwargs, "output_attentions")
    if attentions and "_kvplan_previous_attention" in model.__dict__:
        raise CacheError(f"output_attentions=True (from {where}): kvplan's attention function, which this "
                         "plan and route run, returns no attention weights; load with attention='dequantize' and "
                         "a plan that neither streams KV heads nor keeps heavy-hitter copies to get them")


def _inferred_attention_mask(model, kwargs, input_ids):
    """The attention mask ``generate`` infers when none is passed, as transformers infers it: ``ids !=
    pad_token_id`` where the prompt holds pad tokens and the pad token is no eos token; else None (no
    padding)."""
    ids = torch.as_tensor(input_ids)
    pad, _ = _generation_option(model, kwargs, "pad_token_id")
    if pad is None or ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
        return None
    pad = torch.as_tensor(pad, device=ids.device).flatten()
    eos, _ = _generation_option(model, kwargs, "eos_token_id")
    if eos is not None and torch.isin(torch.as_tensor(eos, device=ids.device).flatten(), pad).any():
        return None
    if not torch.isin(ids, pad).any():
        return None
    return ids.ne(pad[0]).long()  # [B, T]


def _check_storage_width(plan: Plan, model, source: str | None) -> None:
    """Warn when the plan states its bpv at another full-precision width than ``model`` stores (a plan
    searched on an fp32 CPU model, deployed in bf16, or a model cast after ``kvplan.load``): the tokens it
    holds at full precision then take the model's width, so the cache's bpv is not the stated one. Once
    per model, plan bpv and width (each ``generate`` makes a cache). Refuses dtypes kvplan does not store."""
    bits = storage_bits(model)
    stated = plan.reference.full_precision_bits
    if bits == stated:
        return
    mine, theirs = plan.bpv().total, plan.bpv(full_precision_bits=bits).total
    if not math.isclose(mine, theirs, rel_tol=1e-12) and _first_time(model, "_kvplan_width_warned",
                                                                     (mine, stated, bits)):
        warnings.warn(f"{source or 'plan'}: states its bpv at {stated}-bit full-precision storage, but this model "
                      f"caches {bits}-bit values: its cache holds {theirs:.4f} bpv at {plan.reference.context_len} "
                      f"tokens, not the stated {mine:.4f} (the tokens it keeps at full precision)", stacklevel=3)


def _check_attention_features(model, attention: str) -> None:
    """Refuse kvplan's attention function for a model whose attention it does not implement: logit
    soft-capping (Gemma 2) or learned attention sinks (GPT-OSS) would be dropped, silently."""
    cfg = text_config(model.config)
    feature = None
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        feature = "caps its attention logits (attn_logit_softcapping)"
    elif any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules()):
        feature = "has learned attention sinks (an attention module's `sinks`)"
    if feature is not None:
        raise PlanError("attention", f"this model {feature}, which kvplan's attention kernels do not implement: "
                        "use attention='dequantize' (the model's own attention over the dequantized cache), "
                        "with a plan that neither streams KV heads nor keeps heavy-hitter copies", attention)


def _require_ids(plan: Plan, input_ids, cache: KVPlanCache | None) -> None:
    """Refuse a prompt without token ids for a plan whose modalities differ: nothing would tell its
    visual tokens from its text ones (every token would be stored at the text bits)."""
    if input_ids is None and len(plan.modalities) > 1 and (cache is None or not cache.has_labels_from(
            cache.get_seq_length())):
        raise PlanError("modalities", f"generate was given no input_ids (only inputs_embeds?), so the plan's "
                        f"modalities {list(plan.modalities)} cannot be told apart: pass input_ids, or label the "
                        "prompt with cache.assign_labels on a make_cache cache passed as cache=", show_value=False)


def _label_new_prompt(model, cache: KVPlanCache, input_ids, attention_mask) -> None:
    """Prepare the caller's cache for ``generate`` as :func:`make_cache` prepares a new one: an empty
    cache is aligned to the prompt's left padding; the prompt tokens past what the cache holds (all of
    them after ``cache.reset()``, a conversation's new turn otherwise) are labelled, unless the caller
    labelled them already (:meth:`KVPlanCache.assign_labels`)."""
    start = cache.get_seq_length()
    if not start:
        cache.align_to_padding(attention_mask)
    _require_ids(cache.plan, input_ids, cache)
    if input_ids is None or cache.has_labels_from(start):
        return
    input_ids = torch.as_tensor(input_ids)
    labelling = labelling_in_force(model, None)
    check_modalities(cache.plan, model, labelling=labelling)  # as make_cache: the plan's own labelling
    rows = [row[start:] for row in labelling(input_ids, model.config, attention_mask)]  # [B][T - start]
    cache.assign_labels(rows, None if attention_mask is None else torch.as_tensor(attention_mask)[:, start:])


def unload(model):
    """Undo :func:`load`."""
    gen = model.__dict__.get("generate")
    if getattr(gen, "__func__", None) is _generate:
        del model.generate
        model.__dict__.pop("_kvplan_original_generate", None)
    model.__dict__.pop("kvplan_plan", None)
    model.__dict__.pop("_kvplan_labelling", None)
    _remove_attention(model)
    return model


def _install_attention(model, kernel, observe: bool = False) -> None:
    """Route the text decoder's attention through kvplan's packed-cache kernel (``None``: keep
    the model's own attention, the dequantize route, unless ``observe``: then kvplan's attention
    function runs SDPA over the dequantized cache and scores prompts for heavy-hitter copies)."""
    if kernel is None and not observe:
        return
    from . import fused

    previous = text_config(model.config)._attn_implementation
    name = fused.register()
    fused.set_text_attention(model, name)
    if text_config(model.config)._attn_implementation != name:  # transformers only logs that it cannot
        raise PlanError("attention", f"{type(model).__name__} cannot switch its attention implementation (it keeps "
                        f"{previous!r}), so kvplan's attention cannot run in it: use attention='dequantize' (the "
                        "model's own attention over the dequantized cache), with a plan that neither streams KV "
                        "heads nor keeps heavy-hitter copies", show_value=False)
    model._kvplan_previous_attention = previous
    model._kvplan_attention_kernel = kernel


def _remove_attention(model) -> None:
    model.__dict__.pop("_kvplan_attention_kernel", None)
    previous = model.__dict__.pop("_kvplan_previous_attention", None)
    if previous is not None:
        from .fused import set_text_attention

        set_text_attention(model, previous)


def streams(plan: Plan) -> bool:
    """Whether ``plan`` streams KV heads (slots at bits 0): every attention route, the dequantize one
    included, then runs kvplan's attention function, which masks what those heads do not store."""
    return bool(plan.streamed_heads())


@contextlib.contextmanager
def attention_route(model, attention: str = "auto", plan: Plan | None = None):
    """Inside the block, ``model`` attends as ``kvplan.load(model, plan, attention=attention)``
    makes it attend (caches from :func:`make_cache` pick the same kernel): how the search's
    scorers measure plans on the deployed route. A model already under ``kvplan.load`` keeps
    the route ``load`` chose. ``plan``: the plan scored (a plan with streamed KV heads needs kvplan's
    attention function on the dequantize route as well). Restores the model's attention afterwards."""
    if getattr(model, "kvplan_plan", None) is not None:
        yield model
        return
    kernel = _attention_kernel(model, attention)
    saved = {k: model.__dict__[k] for k in ("_kvplan_attention_kernel", "_kvplan_previous_attention")
             if k in model.__dict__}
    observe = plan is not None and streams(plan)
    if kernel is not None or observe:
        _check_attention_features(model, attention)
    _install_attention(model, kernel, observe=observe)
    try:
        yield model
    finally:
        if kernel is not None or observe:
            _remove_attention(model)
        model.__dict__.update(saved)
