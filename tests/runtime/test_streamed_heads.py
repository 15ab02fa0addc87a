"""Streamed KV heads (slots at bits 0, quantizer.stream_window): no codes; the head attends to the
sink positions, copies of its newest committed tokens and the residual only."""

import contextlib

import numpy as np
import pytest
import torch

import kvplan
from kvplan import Geometry, KVPlanCache, uniform_plan
from kvplan.plans import STREAMED, committed_length, recent_tokens, stream_tokens
from kvplan.runtime.load import make_cache
from tests.runtime.routes import KERNELS, generate_like_dequantize, prefill_then_decode, with_quantizer
from tests.tiny_models import tiny_llama

GEOM = Geometry(2, 2, 64, ("full", "full"), "llama")
HYBRID = Geometry(2, 2, 64, ("full", "sliding"), "llama", 48)


def streamed(plan, heads):
    """``plan`` with the KV heads ``heads`` ([(layer, head)]) streamed."""
    table = plan.code_table().copy()
    for layer, head in heads:
        table[layer, head] = STREAMED
    return plan.with_table(table)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("window, recent", [(5, 3), (2, 3), (40, 0)])
def test_bytes_equal_the_plan_at_every_length(bits, window, recent):
    """Prefill then token by token: the cache holds exactly plan.bpv(T) (fp32 storage) after every step,
    and each streamed head as many copies as stream_tokens says (windows shorter and longer than the
    recent copies, and none of them)."""
    base = with_quantizer(uniform_plan(GEOM, 2, group_size=32, residual_length=8, sink_length=1),
                          residual_bits=bits, recent_length=recent, stream_window=window)
    plan = streamed(base, [(1, 0), (0, 1)])
    assert plan.streamed_heads() == [(0, 1), (1, 0)] and base.streamed_heads() == []
    cache = KVPlanCache(plan, GEOM)
    assert [layer.streamed for layer in cache.layers] == [(1,), (0,)]
    for T in prefill_then_decode(cache, 70):
        assert cache.bpv() == plan.bpv(context_len=T, full_precision_bits=32).total, (bits, T)
        layer = cache.layers[0]
        assert layer.stream_copies["k"].length == stream_tokens(layer.committed, window, recent, 1), T
    if window < 10:  # a few copies cost less than the 2-bit codes they replace (40 fp32 ones do not)
        assert plan.bpv(context_len=T).total < base.bpv(context_len=T).total


@pytest.mark.parametrize("bits", [16, 8])
def test_bytes_equal_the_plan_in_a_sliding_layer(bits):
    """A streamed head in a sliding-window layer (window 48, groups of 32): prefill then token by token
    far past the window, the cache holds exactly plan.bpv(T) after every step and the streamed heads
    their stream_tokens copies, while the layer frees its groups (its sink with the first)."""
    plan = streamed(with_quantizer(uniform_plan(HYBRID, 2, group_size=32, residual_length=8, sink_length=1),
                                   residual_bits=bits, recent_length=3, stream_window=5), [(0, 1), (1, 0)])
    cache = KVPlanCache(plan, HYBRID)
    for T in prefill_then_decode(cache, 90):
        assert cache.bpv() == plan.bpv(context_len=T, full_precision_bits=32).total, (bits, T)
        layer = cache.layers[1]
        assert layer.stream_copies["k"].length == stream_tokens(layer.committed, 5, 3, 1), T
        hidden = layer.stream_hidden()
        assert hidden is None or hidden[0] >= max(1, layer.dropped), T  # never a freed position
    assert cache.layers[1].dropped >= 64


@contextlib.contextmanager
def _attending_with(model, name: str, allowed_mask):
    """``model`` attends through SDPA with the bool mask ``allowed_mask(module, query, key)`` ``[B, Hq, Tq, T]``
    (True = attend), registered as ``name``, without gradients; its own attention comes back after."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def masked(module, query, key, value, attention_mask, **kwargs):
        kwargs["is_causal"] = False
        return sdpa_attention_forward(module, query, key, value, allowed_mask(module, query, key), **kwargs)

    AttentionInterface.register(name, masked)
    AttentionMaskInterface.register(name, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        with torch.no_grad():
            yield
    finally:
        model.set_attn_implementation(previous)


def _masked_reference(model, ids, n_history: int, hidden: tuple[int, int], heads):
    """Logits of ``ids[n_history:]`` after the full-precision history, with positions ``[a, b)`` hidden
    from the query heads of the streamed KV ``heads`` [(layer, head)]: SDPA with a per-head mask."""

    def allowed_mask(module, query, key):
        B, Hq, Tq, _ = query.shape
        T = key.shape[2]
        allowed = torch.ones(Tq, T, dtype=torch.bool).tril(T - Tq).expand(B, Hq, Tq, T).clone()
        rep = Hq // key.shape[1]
        if Tq < T:  # the continuation
            for layer, head in heads:
                if layer == module.layer_idx:
                    allowed[:, head * rep:(head + 1) * rep, :, hidden[0]:hidden[1]] = False
        return allowed

    with _attending_with(model, "test_streamed_reference", allowed_mask):
        out = model(input_ids=ids[:, :n_history], use_cache=True)
        return model(input_ids=ids[:, n_history:], cache=out.past_key_values).logits


@pytest.mark.parametrize("attention", ["dequantize"] + KERNELS)
def test_a_streamed_head_attends_to_the_sink_its_window_and_the_residual_only(attention):
    """Every other slot at 16 bits and the residual as written: the continuation's logits on each route
    are those of full-precision attention with the streamed heads' older committed positions masked."""
    model = tiny_llama(head_dim=64)
    heads = [(0, 1), (1, 0)]
    window, recent, sink = 6, 2, 1
    plan = with_quantizer(uniform_plan(GEOM, 16, group_size=32, residual_length=0, sink_length=sink),
                          recent_length=recent, stream_window=window)
    plan = streamed(plan, heads)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 256, (1, 76), generator=g)
    n_history = 70
    C = committed_length(n_history, 0, 32)  # 64 committed, 6 in the residual
    kept = recent_tokens(C, recent, sink) + stream_tokens(C, window, recent, sink)
    hidden = (sink, C - kept)
    assert hidden == (1, 58)
    kvplan.load(model, plan, attention=attention)
    try:
        with torch.no_grad():
            cache = make_cache(model, plan, ids[:, :n_history])
            model(input_ids=ids[:, :n_history], cache=cache)
            assert cache.layers[0].stream_hidden() == hidden
            got = model(input_ids=ids[:, n_history:], cache=cache).logits
    finally:
        kvplan.unload(model)
    want = _masked_reference(model, ids, n_history, hidden, heads)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    # the mask matters: without it the logits differ
    unmasked = _masked_reference(model, ids, n_history, (0, 0), heads)
    assert (unmasked - want).abs().max() > 1e-3


def _sliding_masked_reference(model, ids, n_history: int, hidden: tuple[int, int], heads, window: int):
    """Logits of ``ids[n_history:]`` from one full-precision forward over all of ``ids`` whose mask is built
    by absolute position: causal, sliding layers see their newest ``window`` positions, and the query heads
    of the streamed KV ``heads`` [(layer, head)] do not see ``[a, b)`` from ``n_history`` on."""
    types = Geometry.of(model).layer_types

    def allowed_mask(module, query, key):
        B, Hq, T, _ = query.shape
        i = torch.arange(T)[:, None]
        j = torch.arange(T)[None, :]
        allowed = j <= i
        if types[module.layer_idx] == "sliding":
            allowed = allowed & (i - j < window)
        allowed = allowed.expand(B, Hq, T, T).clone()
        rep = Hq // key.shape[1]
        for layer, head in heads:
            if layer == module.layer_idx:
                allowed[:, head * rep:(head + 1) * rep, n_history:, hidden[0]:hidden[1]] = False
        return allowed

    with _attending_with(model, "test_streamed_sliding_reference", allowed_mask):
        return model(input_ids=ids, use_cache=False).logits[:, n_history:]


@pytest.mark.parametrize("attention", ["dequantize"] + KERNELS)
def test_a_streamed_head_in_a_sliding_layer_attends_to_its_window_copies_and_the_residual(attention):
    """Tiny Gemma 3 (5 sliding layers of window 48, 1 full), a 100-token history (the sliding layers freed
    their first group, sink included): streamed heads in sliding layers and the full one, every other slot
    at 16 bits; the continuation's logits on each route are those of full-precision attention with the
    model's sliding mask and the streamed heads' older committed positions masked."""
    from tests.tiny_models import tiny_gemma3

    window = 48
    model = tiny_gemma3(sliding_window=window)
    geom = Geometry.of(model)
    heads = [(0, 1), (2, 0), (5, 1)]
    stream, recent, sink = 6, 2, 1
    plan = with_quantizer(uniform_plan(geom, 16, group_size=32, residual_length=0, sink_length=sink),
                          recent_length=recent, stream_window=stream)
    plan = streamed(plan, heads)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 256, (1, 106), generator=g)
    n_history = 100
    C = committed_length(n_history, 0, 32)  # 96 committed, 4 in the residual
    hidden = (sink, C - recent_tokens(C, recent, sink) - stream_tokens(C, stream, recent, sink))
    assert hidden == (1, 90)
    kvplan.load(model, plan, attention=attention)
    try:
        with torch.no_grad():
            cache = make_cache(model, plan, ids[:, :n_history])
            model(input_ids=ids[:, :n_history], cache=cache)
            assert cache.layers[0].dropped == 32 and cache.layers[0].stream_hidden() == (32, 90)
            assert cache.layers[5].stream_hidden() == hidden
            got = model(input_ids=ids[:, n_history:], cache=cache).logits
    finally:
        kvplan.unload(model)
    want = _sliding_masked_reference(model, ids, n_history, hidden, heads, window)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    # the streamed heads' mask matters in the sliding layers: without it there the logits differ
    full_only = _sliding_masked_reference(model, ids, n_history, hidden, [(5, 1)], window)
    assert (full_only - want).abs().max() > 1e-3


@pytest.mark.parametrize("attention", KERNELS)
def test_generation_in_sliding_layers_matches_the_dequantize_route(attention):
    """A 2-bit plan streaming heads of tiny Gemma 3's sliding layers (window 48): greedy generation from a
    48-token prompt to 88 tokens, through commits and freed groups, gives the same tokens and scores on
    every fused kernel as on the dequantize route, a batch of two."""
    from tests.tiny_models import tiny_gemma3

    model = tiny_gemma3(sliding_window=48)
    geom = Geometry.of(model)
    plan = with_quantizer(uniform_plan(geom, 2, group_size=32, residual_length=0, sink_length=1),
                          residual_bits=8, recent_length=2, stream_window=8)
    generate_like_dequantize(model, streamed(plan, [(0, 0), (1, 1), (5, 0)]), attention)


@pytest.mark.parametrize("attention", KERNELS)
def test_generation_matches_the_dequantize_route(attention):
    """A 2-bit plan with streamed heads: greedy generation through several commits (prefill 48, 40 new
    tokens, groups of 32) gives the same tokens and scores on every fused kernel as on the dequantize
    route, a batch of two."""
    model = tiny_llama(head_dim=16)
    g = Geometry(2, 2, 16, ("full", "full"), "llama")
    plan = with_quantizer(uniform_plan(g, 2, group_size=32, residual_length=0, sink_length=1),
                          residual_bits=8, recent_length=2, stream_window=8)
    generate_like_dequantize(model, streamed(plan, [(0, 0), (1, 1)]), attention)


def test_plan_checks():
    """Bits 0 must cover a head's keys and values in every modality, in a full-attention layer or a
    sliding one whose window holds the head's copies, with a stream window and without heavy-hitter
    copies; a version-7 file may not say it."""
    plan = with_quantizer(uniform_plan(GEOM, 2, group_size=32), stream_window=4)
    table = plan.code_table().copy()
    table[0, 1, 0] = STREAMED
    with pytest.raises(kvplan.PlanError, match="layer 0 KV head 1: bits 0"):
        plan.with_table(table)
    with pytest.raises(kvplan.PlanError, match="quantizer.stream_window"):
        streamed(with_quantizer(plan, stream_window=0), [(0, 1)])
    with pytest.raises(kvplan.PlanError, match="heavy_length"):
        streamed(with_quantizer(plan, heavy_length=2), [(0, 1)])
    # a sliding layer streams where its window holds the copies and the tokens not committed yet
    hybrid_plan = with_quantizer(uniform_plan(HYBRID, 2, group_size=32, residual_length=8), recent_length=4)
    with pytest.raises(kvplan.PlanError, match="layer 1 is a sliding layer of window 48"):
        streamed(with_quantizer(hybrid_plan, stream_window=5), [(1, 0)])  # 8 + 32 + 4 + 5 > 48
    assert streamed(with_quantizer(hybrid_plan, stream_window=4), [(1, 0)]).code_table()[1, 0, 0, 0] == STREAMED
    ok = streamed(plan, [(1, 1)])
    again = kvplan.Plan.from_yaml(ok.to_yaml())
    assert np.array_equal(again.code_table(), ok.code_table()) and again.quantizer.stream_window == 4
    v7 = ok.to_yaml().replace(f"schema_version: {kvplan.plans.SCHEMA_VERSION}", "schema_version: 7")
    assert "schema_version: 7" in v7
    with pytest.raises(kvplan.PlanError, match="needs schema_version 8"):
        kvplan.Plan.from_yaml(v7)


def test_a_model_attending_without_kvplan_is_refused():
    """A streamed plan's cache for a model on its own attention (no kvplan.load) would attend to what the
    heads do not store: make_cache refuses it, and so does the documented explicit cache
    (``generate(cache=KVPlanCache(plan, model))``), naming the remedy."""
    model = tiny_llama(head_dim=64)
    plan = streamed(with_quantizer(uniform_plan(GEOM, 2, group_size=32, residual_length=0, sink_length=1),
                                   stream_window=4), [(0, 1)])
    for make in (lambda: make_cache(model, plan), lambda: KVPlanCache(plan, model)):
        with pytest.raises(kvplan.PlanError, match="only kvplan's attention masks"):
            make()
    kvplan.load(model, plan, attention="dequantize")
    try:
        assert make_cache(model, plan).layers[0].streamed == (1,)
        assert KVPlanCache(plan, model).layers[0].streamed == (1,)
        # switched by the user after the load: said so (the message told them to do the load they had done)
        model.set_attn_implementation("sdpa")
        with pytest.raises(kvplan.PlanError, match="this model now attends with 'sdpa' although kvplan.load put it on "
                                                   "kvplan's attention"):
            make_cache(model, plan)
    finally:
        kvplan.unload(model)


def test_the_harness_scores_a_streamed_plan_alike_on_every_route():
    """The search's harness (kvplan.evaluation.evaluate) on the dequantize route (kvplan's attention with the
    mask, installed by attention_route for this plan) and on a fused kernel: the same KL, in one process
    and in two, and larger than the same plan without streamed heads."""
    from kvplan.evaluation import Sample, evaluate, prepare_samples

    model = tiny_llama(head_dim=64)
    g = torch.Generator().manual_seed(1)
    samples = []
    for i, n in enumerate((100, 130)):
        ids = torch.randint(5, 256, (n + 6,), generator=g).tolist()
        samples.append(Sample(ids[:n], ["text"] * n, ids[n:], meta={"id": f"s{i}"}))
    prepared = prepare_samples(model, samples, progress=False)
    base = with_quantizer(uniform_plan(GEOM, 4, group_size=32, residual_length=0, sink_length=1),
                          recent_length=2, stream_window=8)
    plan = streamed(base, [(0, 0), (1, 1)])
    kl = {route: evaluate(model, plan, prepared, attention=route, progress=False)["kl"]["mean"]
          for route in ("dequantize", "chunked")}
    assert kl["dequantize"] == pytest.approx(kl["chunked"], rel=1e-4)
    assert evaluate(model, plan, prepared, attention="chunked", progress=False, processes=2)["kl"]["mean"] == \
        pytest.approx(kl["chunked"], rel=1e-6)
    assert kl["chunked"] > evaluate(model, base, prepared, attention="chunked", progress=False)["kl"]["mean"]


@pytest.mark.parametrize("masked", [float("-inf"), torch.finfo(torch.float32).min])
def test_an_additive_mask_keeps_its_masked_positions(masked):
    """The streamed heads' mask built over a forward's additive mask: what it masked (-inf, or the dtype's
    most negative number as transformers writes it) stays masked for every head, and the streamed heads'
    query heads (KV head 1 of 2: query heads 2 and 3) also lose positions [1, 3)."""
    from types import SimpleNamespace

    from kvplan.runtime.fused import _hide

    layer = SimpleNamespace(streamed=(1,), owner=SimpleNamespace(geometry=SimpleNamespace(num_kv_heads=2)))
    additive = torch.zeros(1, 1, 2, 6)
    additive[..., 5] = masked
    got = _hide(layer, additive, 1, 4, 2, 6, 1, 3, "cpu")[0, :, 0]
    want = torch.tensor([[1, 1, 1, 1, 1, 0]] * 2 + [[1, 0, 0, 1, 1, 0]] * 2, dtype=torch.bool)
    assert torch.equal(got, want)


def test_a_mark_nobody_read_never_reaches_a_later_tensor(monkeypatch):
    """A cache updated outside a forward (as the bytes test above does) leaves its marks unread; a later
    tensor that reuses the freed id must not pick them up (it did: a streamed layer's stale mark masked an
    unrelated prefill now and then in the whole suite). Every tensor gets one id here, the worst case of
    id reuse: with a streamed cache's marks left unread, a plain plan's logits are those without them (on
    the chunked route, whose prefill runs kvplan's attention function; the dequantize route runs SDPA
    itself for a plan without streamed heads or heavy copies)."""
    from kvplan.runtime import fused

    attention = "chunked"
    for name in ("_PENDING", "_OBSERVED", "_STREAMED"):
        monkeypatch.setattr(fused, name, fused.TensorMarks(key=lambda tensor: 0))
    model = tiny_llama(head_dim=64)
    ids = torch.randint(3, 256, (1, 76), generator=torch.Generator().manual_seed(3))
    plain = uniform_plan(GEOM, 4, group_size=32, residual_length=0)

    def logits():
        kvplan.load(model, plain, attention=attention)
        try:
            with torch.no_grad():
                cache = make_cache(model, plain, ids[:, :70])
                model(input_ids=ids[:, :70], cache=cache)
                return model(input_ids=ids[:, 70:], cache=cache).logits
        finally:
            kvplan.unload(model)

    want = logits()
    stale = KVPlanCache(streamed(with_quantizer(uniform_plan(GEOM, 2, group_size=32, residual_length=8),
                                                stream_window=4), [(0, 0), (1, 1)]), GEOM)
    g = torch.Generator().manual_seed(0)
    kept = [stale.update(torch.randn(1, 2, n, 64, generator=g), torch.randn(1, 2, n, 64, generator=g), i)
            for n in (48, 1) for i in range(2)]  # read by no attention call; the second has committed tokens
    assert len(fused._STREAMED) == 1  # the stale mark is there, under the id every tensor gets
    got = logits()
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert len(fused._STREAMED) == 1 and kept  # still there, never read


def test_marks_go_with_their_tensor_or_layer():
    import gc

    from kvplan.runtime.fused import TensorMarks

    class Layer:
        pass

    marks, layer = TensorMarks(), Layer()
    t, u = torch.zeros(2), torch.zeros(2)
    marks.put(t, layer)
    assert marks.pop(u) is None and marks.pop(t) is layer and marks.pop(t) is None
    marks.put(t, layer)
    del t
    gc.collect()
    assert len(marks) == 0
    marks.put(u, layer)
    del layer
    gc.collect()
    assert len(marks) == 0
