"""KVPlanCache behaviour on tiny random models and synthetic states."""

import pytest
import torch
from transformers import DynamicCache

import kvplan
from kvplan import CacheError, Geometry, KVPlanCache, PlanError, baseline_plan, uniform_plan
from kvplan.kernels.qtypes import channel_group_size
from tests.runtime.routes import KERNELS, generate_like_dequantize, generated_cache, with_quantizer
from tests.tiny_models import tiny_llama

GEOM = Geometry(2, 2, 16, ("full", "full"), "llama")


def _states(n, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, n, 16, generator=g).to(dtype), torch.randn(1, 2, n, 16, generator=g).to(dtype)


def test_committed_blocks_are_never_requantized():
    cache = KVPlanCache(baseline_plan("int2", GEOM, residual_length=8))
    layer = cache.layers[0]
    layer.update(*_states(100, 0))
    seg = layer.segments["k"][0]
    codes_before = seg.blocks[0].codes.clone()
    scale_before = seg.blocks[0].scale.clone()
    first_read = layer._read("k")[:, :, :64].clone()
    for step in range(70):
        layer.update(*_states(1, step + 1))
    block = layer.segments["k"][0].blocks[0]
    assert block.length > 64
    assert torch.equal(block.codes[:, :, :64], codes_before[:, :, :64])
    assert torch.equal(block.scale[:, :, :2], scale_before[:, :, :2])
    assert torch.equal(layer._read("k")[:, :, :64], first_read)


def test_residual_and_commit_rule():
    cache = KVPlanCache(baseline_plan("int4", GEOM, residual_length=16))  # group 32
    layer = cache.layers[0]
    layer.update(*_states(47, 0))
    assert layer.committed == 0 and layer.residual["k"].shape[-2] == 47
    layer.update(*_states(1, 1))
    assert layer.committed == 32 and layer.residual["k"].shape[-2] == 16
    assert layer.get_seq_length() == 48


def test_committed_tokens_returned_full_precision_on_first_use_then_quantized():
    cache = KVPlanCache(baseline_plan("int2", GEOM, residual_length=0))
    k, v = _states(64, 3)
    out_k, out_v = cache.layers[0].update(k, v)
    assert torch.equal(out_k, k) and torch.equal(out_v, v)
    k2, _ = cache.layers[0].update(*_states(1, 4))
    assert not torch.equal(k2[:, :, :64], k)
    assert (k2[:, :, :64] - k).abs().max() < 2.0


def test_sink_tokens_kept_exactly_and_rest_quantized():
    """The first sink_length positions are stored at full precision in every head, K and V,
    across commits and arrival patterns; the others are quantized at the plan's bits."""
    plan = baseline_plan("int2", GEOM, residual_length=0, sink_length=5)  # group 32
    k, v = _states(70, 7)
    for chunks in ([70], [3, 1, 1, 30, 35]):
        cache = KVPlanCache(plan)
        layer = cache.layers[1]
        at = 0
        for n in chunks:
            layer.update(k[:, :, at : at + n], v[:, :, at : at + n])
            at += n
        assert layer.committed == 64
        rk, rv = layer._read("k"), layer._read("v")
        assert torch.equal(rk[:, :, :5], k[:, :, :5]) and torch.equal(rv[:, :, :5], v[:, :, :5])
        assert not torch.equal(rk[:, :, 5:64], k[:, :, 5:64])
        assert (rk[:, :, 5:64] - k[:, :, 5:64]).abs().max() < 2.5
        bits = layer.stored_token_bits()
        assert bits[("k", "text", 16)] == 5 * 2 and bits[("k", "text", 2)] == 59 * 2
        assert bits[("v", "text", 16)] == 5 * 2 and bits[("v", "text", 2)] == 59 * 2


def test_nan_and_inf_raise():
    cache = KVPlanCache(baseline_plan("int4", GEOM))
    k, v = _states(4, 0)
    v[0, 1, 2, 5] = float("nan")
    with pytest.raises(CacheError, match=r"layer 0: non-finite value states .*kv_head 1, new token 2, dim 5"):
        cache.layers[0].update(k, v)
    k[0, 0, 0, 0] = float("inf")
    with pytest.raises(CacheError, match="non-finite key"):
        cache.layers[1].update(k, torch.zeros_like(v))


def test_values_past_a_formats_scale_range_raise_naming_where():
    """Values whose group scale an e4m3 scale cannot hold (absmax-e4m3: 448 at most) are refused at their
    commit with a CacheError naming the layer, K/V, the KV head and positions, not a bare ValueError."""
    import dataclasses

    base = baseline_plan("int4", GEOM, residual_length=0)
    cache = KVPlanCache(base.replace(quantizer=dataclasses.replace(base.quantizer, value_scaling="absmax-e4m3")))
    k, v = _states(32, 0)
    v[0, 1, 3] = 1e4
    with pytest.raises(CacheError, match=r"layer 1, values of KV head 1 at positions 0 \.\. 31: .*absmax-e4m3"):
        cache.layers[1].update(k, v)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the deferred check is the CUDA path (no host sync per step)")
def test_cuda_nonfinite_states_raise_before_their_commit():
    cache = KVPlanCache(baseline_plan("int4", GEOM, residual_length=0))  # group 32
    layer = cache.layers[0]
    k, v = _states(4, 0)
    v[0, 1, 2, 5] = float("nan")
    layer.update(k.cuda(), v.cuda())  # read back at the next commit, not now
    with pytest.raises(CacheError, match="non-finite value states .*kv_head 1, cache position 0 \\+ 2, dim 5"):
        layer.update(*[t.cuda() for t in _states(40, 1)])  # 44 tokens: 32 are due, checked first
    assert layer.committed == 0 and not layer.segments["k"]


def test_crop_only_within_residual():
    cache = KVPlanCache(baseline_plan("int4", GEOM, residual_length=16))
    layer = cache.layers[0]
    layer.update(*_states(60, 0))  # 32 committed, 28 residual
    layer.crop(-5)
    assert layer.get_seq_length() == 55
    with pytest.raises(CacheError, match="already quantized"):
        layer.crop(-30)


def test_a_crop_that_would_leave_a_layout_the_plan_does_not_store_is_refused():
    """With residual_length 16 and groups of 32, 60 tokens hold 32 quantized and 28 unquantized. Cropping 20 was
    accepted: at 40 tokens the plan keeps all 40 unquantized (residual 16 + less than a group), but the cache still
    held 32 quantized, so its bytes and its newest tokens' precision were no longer the plan's. A crop that keeps
    the plan's layout is still taken, and the cache then holds exactly ``plan.bpv(T)``."""
    plan = baseline_plan("int4", GEOM, residual_length=16)
    cache = KVPlanCache(plan)
    for layer in cache.layers:
        layer.update(*_states(60, 0))
    with pytest.raises(CacheError, match="layer 0: cannot remove 13 tokens: at 47 tokens the plan keeps its newest "
                                         "16 unquantized.* at most 12 can be removed now"):
        cache.crop(-13)
    assert cache.get_seq_length() == 60  # nothing removed
    cache.crop(-12)
    assert cache.get_seq_length() == 48
    assert cache.bpv() == pytest.approx(plan.bpv(context_len=48, full_precision_bits=32).total, rel=1e-12)


def test_a_sliding_layer_refuses_a_crop_into_the_tokens_its_window_freed():
    """A sliding-window layer frees whole groups once they leave its window. Cropping 2 of 71 tokens (window 40,
    groups of 32, positions 0..31 freed) was accepted: at 69 tokens attention reaches back to position 30, which
    was gone, so the next token attended to fewer tokens than transformers' own cache holds, and the cache held
    more bytes than ``plan.bpv(69)``. transformers' ``DynamicSlidingWindowLayer`` refuses such a crop too."""
    model = tiny_llama(model_type="mistral", sliding_window=40)
    plan = baseline_plan("int4", Geometry.of(model), residual_length=0)
    ids = torch.randint(3, 250, (1, 70), generator=torch.Generator().manual_seed(0))
    cache = generated_cache(model, plan, ids, max_new_tokens=2)  # 71 tokens stored (the last is not fed back)
    assert cache.get_seq_length() == 71 and cache.layers[0].dropped == 32
    with pytest.raises(CacheError, match="sliding window of 40 at 69 tokens reaches back before position 32.* at "
                                         "most 0 can be removed now"):
        cache.crop(-2)
    assert cache.get_seq_length() == 71


def test_wrong_geometry_rejected():
    plan = baseline_plan("int4", Geometry(3, 2, 16, ("full",) * 3, "llama"))
    with pytest.raises(PlanError, match="model.num_layers"):
        kvplan.load(tiny_llama(), plan)


def test_batch_rows_disagreeing_on_modality_raise():
    plan = uniform_plan(GEOM, 4, modalities=("text", "visual"))
    cache = KVPlanCache(plan)
    with pytest.raises(CacheError, match="position 1"):
        cache.assign_labels([["text", "visual"], ["text", "text"]])
    # padded positions do not count
    cache.assign_labels([["text", "visual"], ["text", "text"]], attention_mask=torch.tensor([[1, 1], [1, 0]]))


def test_unknown_modality_with_multimodal_plan_raises():
    cache = KVPlanCache(uniform_plan(GEOM, 4, modalities=("text", "visual")))
    with pytest.raises(PlanError, match="'audio'"):
        cache.assign_labels(["text", "audio"])


def _prompt_batch():
    ids = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8])
    return ids, mask


def test_fp16_plan_identical_to_dynamic_cache_greedy_padded_batch():
    model = tiny_llama()
    ids, mask = _prompt_batch()
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    kvplan.load(model, "fp16")
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    assert torch.equal(out, ref)


def test_padded_batch_rows_match_single_row_runs():
    model = kvplan.load(tiny_llama(), baseline_plan("int4", GEOM, residual_length=0))
    ids, mask = _prompt_batch()
    batch = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    # row 1 has no padding: alone it must give the same tokens (storage is per row, groups never mix rows)
    single = model.generate(input_ids=ids[1:], attention_mask=mask[1:], max_new_tokens=40, do_sample=False)
    assert torch.equal(batch[1], single[0])


def test_sampled_generation_is_reproducible():
    model = kvplan.load(tiny_llama(), "int4")
    ids, mask = _prompt_batch()
    torch.manual_seed(0)
    a = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=True, top_k=20)
    torch.manual_seed(0)
    b = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=True, top_k=20)
    assert torch.equal(a, b) and a.shape == (2, 28)


def test_beam_search_fp16_matches_dynamic_cache_and_quantized_runs():
    model = tiny_llama()
    ids, mask = _prompt_batch()
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, num_beams=3, do_sample=False)
    kvplan.load(model, "fp16")
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, num_beams=3, do_sample=False)
    assert torch.equal(out, ref)
    kvplan.load(model, baseline_plan("int4", GEOM, residual_length=0))
    q = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, num_beams=3, do_sample=False,
                       return_dict_in_generate=True)
    assert q.cache.layers[0].committed > 0


def test_explicit_cache_and_unload():
    model = tiny_llama()
    ids, mask = _prompt_batch()
    cache = kvplan.make_cache(model, "int2", ids, mask)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False, cache=cache,
                         return_dict_in_generate=True)
    assert out.cache is cache and cache.nbytes() > 0
    kvplan.load(model, "int2")
    kvplan.unload(model)
    plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                           return_dict_in_generate=True)
    assert isinstance(plain.cache, DynamicCache)


def test_a_reset_cache_stores_the_next_prompt_as_a_fresh_one():
    """A cache used for a left-padded batch, then reset, stores the next (unpadded) prompt as a fresh
    cache does: the last prompt's padding (sinks, group grid), labels and paused commits go with its tokens."""
    model = tiny_llama()
    plan = uniform_plan(Geometry.of(model), 2, group_size=32, residual_length=0, sink_length=1)
    ids = torch.randint(5, 200, (2, 50), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :20] = 0
    cache = kvplan.make_cache(model, plan, ids, mask)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, cache=cache)
    assert (cache.grid_origin, cache.sink_length) == (20, 21)
    cache.pause_commits()
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.row_padding is None and not cache.commits_paused
    prompt = ids[:, 20:]
    runs = [model.generate(input_ids=prompt, cache=c, max_new_tokens=40, do_sample=False, output_scores=True,
                           return_dict_in_generate=True) for c in (cache, kvplan.make_cache(model, plan, prompt))]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    for a, b in zip(runs[0].scores, runs[1].scores):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert cache.layers[0].committed == 64 and cache.nbytes() == runs[1].cache.nbytes()

    labelled = KVPlanCache(uniform_plan(GEOM, 4, modalities=("text", "visual")))
    labelled.assign_labels(["visual"] * 3)
    labelled.reset()
    assert labelled.labels_for(0, 3) == ["text"] * 3
    labelled.align_to_padding(torch.tensor([[0, 1], [1, 1]]))
    labelled.align_to_padding(torch.ones(2, 2))  # a later unpadded prompt on the empty cache: no padding
    assert labelled.row_padding is None


@pytest.mark.parametrize("attention", KERNELS)
def test_a_head_dim_the_group_does_not_divide(attention):
    """head_dim 80 (phi-2's) under the built-in int2 plan (group 32; values, the 8-bit sink and residual in
    per-token groups): each token's 80 channels are coded in groups of 20, the largest divisor of 80 up to
    32; every route reads what the dequantize route reads, and the cache holds plan.bpv(T)."""
    assert (channel_group_size(32, 80), channel_group_size(64, 96), channel_group_size(32, 128)) == (20, 48, 32)
    model = tiny_llama(head_dim=80)
    plan = with_quantizer(baseline_plan("int2", Geometry.of(model), residual_length=0), residual_bits=8,
                          sink_length=1, sink_bits=8)
    out, _ = generate_like_dequantize(model, plan, attention, max_new_tokens=30)
    T = out.sequences.shape[1] - 1  # the last token is sampled, never written
    assert out.cache.layers[0].committed == 64
    assert out.cache.bpv() == plan.bpv(context_len=T, full_precision_bits=32).total


@pytest.mark.parametrize("model_type,window", [("mistral", 8), ("qwen2", None)])
def test_other_architectures_fp16_identical(model_type, window):
    model = tiny_llama(model_type=model_type, sliding_window=window)
    ids, mask = _prompt_batch()
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    kvplan.load(model, "fp16")
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False), ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_models(dtype):
    model = tiny_llama().to(dtype)
    ids, mask = _prompt_batch()
    kvplan.load(model, baseline_plan("k4v2", GEOM, residual_length=0))
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                         return_dict_in_generate=True)
    assert out.cache.layers[0].residual["k"].dtype == dtype
    assert out.cache.grid_origin == 3  # the first row's left padding: groups start there
    assert out.cache.layers[0].committed == 3 + 32
    assert out.cache.bpv() < 16


def _held_storage(cache) -> tuple[int, int]:
    """``(bytes the cache counts, bytes of the storages its tensors keep alive)``."""
    storages: dict[int, int] = {}

    def visit(t):
        if torch.is_tensor(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    for layer in cache.layers:
        for kind in "kv":
            holders = [layer.residual[kind], layer.recent[kind]] + [b for s in layer.segments[kind] for b in s.blocks]
            if layer.stream_copies:
                holders.append(layer.stream_copies[kind])
            for holder in holders:
                holder.map_tensors(visit)
    storages.pop(0, None)  # empty tensors
    return cache.nbytes(), sum(storages.values())


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_the_cache_keeps_alive_no_more_than_it_counts(kv_heads):
    """An empty recent-copy store was a zero-length view of the prompt's states, and a 16-bit sink block of
    a one-KV-head model a view of the residual: the whole prompt's full-precision K/V stayed alive behind
    them, uncounted (8.5x nbytes at 2000 tokens)."""
    model = tiny_llama(num_kv_heads=kv_heads, head_dim=64)
    plan = uniform_plan(Geometry.of(model), 2, 2, residual_length=32, sink_length=4)  # no recent copies
    ids = torch.randint(3, 250, (1, 600), generator=torch.Generator().manual_seed(0))
    counted, held = _held_storage(generated_cache(model, plan, ids, 3))
    assert counted <= held <= 1.5 * counted  # codes in capacity buffers grow by 1.5x at most


@pytest.mark.parametrize("attention", ["dequantize", "chunked", "native"])
def test_a_forward_with_gradients_on_runs_as_without(attention):
    """A manual decode loop without torch.no_grad (a model's default) failed in the kernels with a raw
    "functions with out=... arguments don't support automatic differentiation"."""
    model = tiny_llama(head_dim=64)
    ids = torch.randint(3, 250, (1, 200), generator=torch.Generator().manual_seed(0))
    logits = {}
    kvplan.load(model, "int4", attention=attention)
    try:
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                cache = kvplan.make_cache(model, model.kvplan_plan, ids)
                first = model(input_ids=ids, cache=cache).logits[:, -1:]
                logits[grad] = model(input_ids=first.argmax(-1), cache=cache).logits.detach()
    finally:
        kvplan.unload(model)
    assert torch.equal(logits[True], logits[False])
