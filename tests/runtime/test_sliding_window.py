"""Sliding-window and hybrid-attention models (tiny random Gemma 3 and Mistral): a sliding layer
stores and counts only its window, generation matches the model's own cache, bytes match the plan."""

import warnings

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import kvplan
from kvplan import Geometry, Plan
from kvplan.models import rope_inv_freq
from kvplan.plans import QuantizerSettings, Reference, plan_bytes
from kvplan.runtime.cache import KVPlanCache
from tests.tiny_models import tiny_gemma3, tiny_llama

W = 40  # sliding window of the tiny models
G = 32


@pytest.fixture(scope="module")
def gemma():
    torch.set_num_threads(1)
    return tiny_gemma3(sliding_window=W)


@pytest.fixture(scope="module")
def mistral():
    return tiny_llama(model_type="mistral", sliding_window=W)


def mixed_plan(model, residual=4, sink=1, rotation="hadamard", pre_rope=True, seed=0) -> Plan:
    """Random 2/3/4/8/16-bit slots, group 32, fp32 storage (the tiny models run in fp32)."""
    g = Geometry.of(model)
    rng = np.random.default_rng(seed)
    table = rng.choice([2, 3, 4, 8, 16], size=(g.num_layers, g.num_kv_heads, 2, 1))
    q = QuantizerSettings(group_size=G, residual_length=residual, sink_length=sink, rotation=rotation,
                          key_pre_rope=pre_rope)
    return Plan.from_table(table, g, quantizer=q, reference=Reference(256, (("text", 1.0),), 32),
                           rope_inv_freq=rope_inv_freq(model) if pre_rope else None)


def fp_plan(model) -> Plan:
    g = Geometry.of(model)
    return Plan.from_table(np.full((g.num_layers, g.num_kv_heads, 2, 1), 16), g,
                           quantizer=QuantizerSettings(group_size=G, residual_length=4),
                           reference=Reference(256, (("text", 1.0),), 32))


def test_geometry_records_layer_types_window_and_rope_bases(gemma, mistral):
    g = Geometry.of(gemma)
    assert g.layer_types == ("sliding",) * 5 + ("full",) and g.sliding_window == W
    assert Geometry.of(mistral).layer_types == ("sliding", "sliding") and Geometry.of(mistral).sliding_window == W
    assert Geometry.of(tiny_llama()).sliding_window is None
    freqs = rope_inv_freq(gemma)  # two RoPE bases: 10k on local layers, 1M on the global one
    assert set(freqs) == {"full", "sliding"}
    rot = gemma.model.rotary_emb
    assert freqs["sliding"] == tuple(rot.sliding_attention_inv_freq.tolist())
    assert freqs["full"] == tuple(rot.full_attention_inv_freq.tolist())
    assert freqs["sliding"][1] > freqs["full"][1]
    assert isinstance(rope_inv_freq(mistral), tuple)  # one base


@pytest.mark.parametrize("attention", ["dequantize", "chunked", "native"])
@pytest.mark.parametrize("which", ["gemma", "mistral"])
def test_full_precision_plan_generates_as_dynamic_cache_past_the_window(which, attention, request):
    """All-16-bit plan: the cache frees what the window no longer needs and still generates exactly
    what the model's own DynamicCache (sliding layers of window - 1 tokens) generates."""
    model = request.getfixturevalue(which)
    ids = torch.randint(3, 250, (1, 50), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=110, min_new_tokens=110, do_sample=False, return_dict_in_generate=True,
              output_logits=True)
    ref = model.generate(input_ids=ids, **kw)
    kvplan.load(model, fp_plan(model), attention=attention)
    try:
        out = model.generate(input_ids=ids, **kw)
    finally:
        kvplan.unload(model)
    assert torch.equal(out.sequences, ref.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits)) < 1e-4
    cache = out.cache
    T = cache.get_seq_length()
    assert T == 159
    for layer, t in zip(cache.layers, Geometry.of(model).layer_types):
        if t == "sliding":  # 159 - 39 = 120 positions left the window: the 3 whole groups before them
            assert layer.dropped == 96 and layer.stored_length() == T - 96
        else:
            assert layer.dropped == 0 and layer.stored_length() == T


def _storage_bytes(layer) -> int:
    seen, n = set(), 0
    for kind in ("k", "v"):
        tensors = layer.residual[kind].tensors() + [t for seg in layer.segments[kind] for b in seg.blocks for t in b.tensors()]
        for t in tensors:
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                n += s.nbytes()
    return n


@pytest.mark.parametrize("attention", ["dequantize", "chunked", "native"])
def test_quantized_cache_bytes_are_the_plans_at_every_length(gemma, attention):
    """Prefill past the window, then one token at a time: at every length the cache's bytes are
    plans.accounting's (cache.bpv() == plan.bpv() exactly), sliding layers hold between window - 1
    and window - 1 + group - 1 positions, the memory behind them stays bounded, and the outputs are
    those of the same plan keeping every token (the freed ones are all outside the window)."""
    plan = mixed_plan(gemma)
    everything = plan.replace(geometry=Geometry(*[getattr(plan.geometry, f) for f in
                                                  ("num_layers", "num_kv_heads", "head_dim", "layer_types",
                                                   "model_type")]))
    ids = torch.randint(3, 250, (1, 45), generator=torch.Generator().manual_seed(2))
    with kvplan.runtime.attention_route(gemma, attention):
        cache = kvplan.make_cache(gemma, plan, ids)
        keep_all = KVPlanCache(everything, attention_kernel=cache.attention_kernel)
        fp = DynamicCache(config=gemma.config)
        x, storage = ids, []
        with torch.no_grad():
            for step in range(140):
                a = gemma(input_ids=x, cache=cache).logits[:, -1]
                b = gemma(input_ids=x, cache=keep_all).logits[:, -1]
                gemma(input_ids=x, cache=fp)
                # same quantized tokens in the window; the chunked kernel sums in other chunks (rounding)
                assert (a - b).abs().max().item() < (1e-4 if attention == "dequantize" else 1e-3), step
                T = cache.get_seq_length()
                assert cache.bpv() == plan.bpv(context_len=T).total, T
                parts = cache.nbytes_breakdown()
                want = plan_bytes(plan, plan.geometry, ["text"] * T, fp_bytes=4)
                assert {k: parts[k] for k in want} == want, T
                for layer in cache.layers[:5]:
                    assert W - 1 <= layer.stored_length() <= W - 1 + G - 1, T
                # tokens older than the window are freed for real, not held behind views: the memory
                # behind a sliding layer is at most the growth buffers' 1.5x of what it holds
                held = sum(sum(layer.nbytes_parts().values()) for layer in cache.layers[:5])
                storage.append(sum(_storage_bytes(layer) for layer in cache.layers[:5]) / held)
                x = a.argmax(-1, keepdim=True)
        fp_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in fp.layers)
    assert cache.nbytes() < fp_bytes
    assert max(storage) <= 1.5  # (holding the 185-token history behind views would be > 2.5x)
    assert keep_all.layers[0].dropped == 0 and cache.layers[0].dropped > 0


def test_pre_rope_keys_use_each_layer_types_frequencies(gemma):
    plan = mixed_plan(gemma)
    cache = kvplan.make_cache(gemma, plan)
    gemma(input_ids=torch.arange(3, 80)[None], cache=cache)
    rot = gemma.model.rotary_emb
    for i, t in enumerate(Geometry.of(gemma).layer_types):
        want = getattr(rot, f"{t}_attention_inv_freq")
        assert torch.equal(cache.layers[i].rotation["k"].inv_freq, want.float()), i
    # a plan whose frequencies are not the model's is deployed with a warning
    swapped = plan.replace(rope_inv_freq={"full": plan.rope_inv_freq["sliding"], "sliding": plan.rope_inv_freq["full"]})
    with pytest.warns(UserWarning, match="rope_inv_freq"):
        kvplan.make_cache(gemma, swapped)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kvplan.make_cache(gemma, plan)


def test_plan_without_a_window_deploys_with_the_models(gemma, tmp_path):
    """A plan file from before windows were recorded (sliding layer types, no model.sliding_window)
    still loads and deploys; its sliding layers follow the model's window."""
    plan = fp_plan(gemma)
    d = plan.to_dict()
    assert d["model"]["sliding_window"] == W
    del d["model"]["sliding_window"], d["model"]["fingerprint"], d["budget"]["bpv"]
    with pytest.raises(kvplan.PlanError, match="model.sliding_window: missing: the plan has sliding layers, and "
                                               f"schema_version {d['schema_version']} plans record their window"):
        Plan.from_dict(d)  # a window deleted by hand: the sliding layers' bytes would be counted without it
    d["schema_version"] = 1
    old = Plan.from_dict(d)
    assert old.geometry.sliding_window is None
    cache = kvplan.make_cache(gemma, old)
    gemma(input_ids=torch.arange(3, 120)[None], cache=cache)
    assert cache.layers[0].dropped > 0 and cache.bpv() == plan.bpv(context_len=117).total
    # a plan stating another window is refused
    other = plan.replace(geometry=Geometry(*[getattr(plan.geometry, f) for f in
                                             ("num_layers", "num_kv_heads", "head_dim", "layer_types",
                                              "model_type")], sliding_window=64))
    with pytest.raises(kvplan.PlanError, match="model.sliding_window"):
        kvplan.load(gemma, other)
