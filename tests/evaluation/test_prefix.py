"""Replaying the full-precision layers before a plan's first quantized layer
(kvplan.evaluation.prefix): the same numbers as running the whole model, for every layer."""

import multiprocessing as mp

import numpy as np
import pytest
import torch

from kvplan import Plan
from kvplan.evaluation import Sample, evaluate, prepare_samples
from kvplan.evaluation.prefix import decoder_layers, first_quantized_layer
from kvplan.models.geometry import Geometry
from kvplan.models.rope import rope_inv_freq
from kvplan.plans import CORRECTED, KeyBasis, QuantizerSettings
from tests.tiny_models import tiny_gemma3, tiny_llama, tiny_llava_onevision, tiny_qwen2_5_vl


def _prepared(model, lengths=(100, 130, 96), eval_tokens=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, n in enumerate(lengths):
        ids = torch.randint(5, model.config.vocab_size, (n + eval_tokens,), generator=g).tolist()
        samples.append(Sample(ids[:n], ["text"] * n, ids[n:], meta={"id": f"s{i}"}))
    return prepare_samples(model, samples, progress=False)


def _unit_plans(model, quantizer, key_basis=None):
    """One plan per (layer, kind) at 2 bits (3 with a corrected key), the rest at 16; deepest first."""
    g = Geometry.of(model)
    plans = []
    for layer in reversed(range(g.num_layers)):
        for k in range(2):
            t = np.full((g.num_layers, g.num_kv_heads, 2, 1), 16, dtype=np.int64)
            t[layer, :, k] = 2 + (CORRECTED if key_basis is not None and k == 0 else 0)
            plans.append(Plan.from_table(t, g, quantizer=quantizer, key_basis=key_basis,
                                         rope_inv_freq=rope_inv_freq(model) if quantizer.key_pre_rope else None))
    return plans


def _attention_calls(layers):
    calls = [0] * len(layers)
    hooks = [layer.self_attn.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
             for i, layer in enumerate(layers)]
    return calls, hooks


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_replayed_prefix_gives_the_whole_forwards_numbers(arch):
    model = tiny_llama(num_layers=4) if arch == "llama" else tiny_gemma3(num_layers=6, sliding_window=40)
    prepared = _prepared(model)
    q = QuantizerSettings(group_size=32, residual_length=16, sink_length=4)
    layers = decoder_layers(model)
    recorded = 0  # layers recorded so far (the first, deepest plan records every layer before it)
    for plan in _unit_plans(model, q):
        whole = evaluate(model, plan, prepared, progress=False, expect_quantized=())
        calls, hooks = _attention_calls(layers)
        try:
            replayed = evaluate(model, plan, prepared, progress=False, expect_quantized=(), reuse_prefix=True)
        finally:
            for h in hooks:
                h.remove()
        assert replayed == whole  # every metric and cache statistic, exactly
        skipped = min(first_quantized_layer(plan), recorded)
        assert calls == [0] * skipped + [len(prepared)] * (len(layers) - skipped), (plan, calls)
        recorded = max(recorded, first_quantized_layer(plan))
    assert recorded == len(layers) - 1
    assert all(layer.forward.__func__ is type(layer).forward for layer in layers)  # nothing left patched


def test_codec_settings_start_a_new_record():
    """Rotation, pre-RoPE keys and a corrected key basis, then other settings: each set is
    recorded anew (the numbers stay the whole forward's)."""
    model = tiny_llama(num_layers=3, head_dim=16)
    prepared = _prepared(model, lengths=(110, 90))
    g = Geometry.of(model)
    basis = np.linalg.qr(np.random.default_rng(0).normal(size=(g.num_layers, g.num_kv_heads, 16, 16)))[0][..., :2]
    settings = [
        (QuantizerSettings(group_size=32, residual_length=8, rotation="hadamard", key_pre_rope=True,
                           key_correction_rank=2), KeyBasis(basis)),
        (QuantizerSettings(group_size=64, residual_length=0), None),
    ]
    for q, b in settings:
        for plan in _unit_plans(model, q, b):
            assert evaluate(model, plan, prepared, progress=False, expect_quantized=(), reuse_prefix=True) == \
                evaluate(model, plan, prepared, progress=False, expect_quantized=())


def test_multiple_choice_samples_run_the_whole_model():
    model = tiny_llama(num_layers=3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 256, (112,), generator=g).tolist()
    sample = Sample(ids[:96], ["text"] * 96, ids[96:102], question_ids=ids[102:106], options=[ids[106:108], ids[108:112]],
                    answer=0)
    prepared = prepare_samples(model, [sample], progress=False)
    calls, hooks = _attention_calls(decoder_layers(model))
    try:
        for plan in _unit_plans(model, QuantizerSettings(group_size=32, residual_length=0)):
            assert evaluate(model, plan, prepared, progress=False, expect_quantized=(), reuse_prefix=True) == \
                evaluate(model, plan, prepared, progress=False, expect_quantized=())
    finally:
        for h in hooks:
            h.remove()
    assert min(calls) > 0 and prepared[0].replay is None


@pytest.mark.skipif("fork" not in mp.get_all_start_methods(), reason="needs the fork start method")
def test_replay_in_sample_processes():
    from kvplan.evaluation.parallel import SampleProcesses

    model = tiny_llama(num_layers=4)
    prepared = _prepared(model, lengths=(100, 130, 96, 110))
    pool = SampleProcesses(model, prepared, 2)
    try:
        for plan in _unit_plans(model, QuantizerSettings(group_size=32, residual_length=16)):
            assert evaluate(model, plan, prepared, progress=False, expect_quantized=(), reuse_prefix=True,
                            processes=pool) == evaluate(model, plan, prepared, progress=False, expect_quantized=())
    finally:
        pool.close()


@pytest.mark.parametrize("build", [lambda: tiny_llama(num_layers=3), lambda: tiny_gemma3(num_layers=6),
                                   tiny_qwen2_5_vl, tiny_llava_onevision])
def test_decoder_layers_of_each_architecture(build):
    model = build()
    layers = decoder_layers(model)
    assert layers is not None and len(layers) == Geometry.of(model).num_layers
    assert [layer.self_attn.layer_idx for layer in layers] == list(range(len(layers)))


def test_no_replay_where_layers_share_caches():
    model = tiny_llama(num_layers=3)
    model.config.num_kv_shared_layers = 1  # as Gemma 3n: later layers read an earlier layer's cache
    assert decoder_layers(model) is None
