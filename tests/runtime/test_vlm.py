"""Tiny random VLMs generate through a plan with different bits for visual and text tokens."""

import skimage.data as skimage_data
import torch

import kvplan
from kvplan.models import labels_from_input_ids
from tests.tiny_models import (llava_onevision_inputs, qwen2_5_vl_inputs, tiny_llava_onevision,
                               tiny_qwen2_5_vl)

TEXT_BITS = {"k": 8, "v": 4}
VISUAL_BITS = {"k": 3, "v": 2}


def _modality_plan(model):
    g = kvplan.Geometry.of(model)
    plan = kvplan.uniform_plan(g, 16, modalities=("text", "visual"), residual_length=0)
    table = plan.table()
    for k, kind in enumerate("kv"):
        table[:, :, k, 0] = TEXT_BITS[kind]
        table[:, :, k, 1] = VISUAL_BITS[kind]
    return plan.with_table(table)


def _check_stored_bits(model, inputs, out):
    cache = out.cache
    assert isinstance(cache, kvplan.KVPlanCache)
    labels = labels_from_input_ids(out.sequences, model.config)[0]
    n_visual = labels.count("visual")
    assert n_visual > 0
    total = out.sequences.shape[1] - 1  # the last generated token is never written to the cache
    committed = cache.layers[0].committed
    assert committed > 0
    want_visual = sum(1 for lab in labels[:committed] if lab == "visual")
    assert want_visual > 0
    for layer in range(len(cache.layers)):
        for kind in "kv":
            per_head = cache.token_bits(layer, kind)
            for head_bits in per_head:
                assert len(head_bits) == committed
                expected = [VISUAL_BITS[kind] if lab == "visual" else TEXT_BITS[kind] for lab in labels[:committed]]
                assert head_bits == expected
    counts = cache.stored_token_bits()
    n_layers, n_heads = len(cache.layers), cache.geometry.num_kv_heads
    assert counts[("k", "visual", VISUAL_BITS["k"])] == want_visual * n_layers * n_heads
    assert counts[("v", "text", TEXT_BITS["v"])] == (committed - want_visual) * n_layers * n_heads
    assert cache.get_seq_length() == total


def test_llava_onevision_visual_tokens_stored_at_visual_bits():
    model = tiny_llava_onevision()
    inputs = llava_onevision_inputs(model, skimage_data.astronaut())
    kvplan.load(model, _modality_plan(model))
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    _check_stored_bits(model, inputs, out)


def test_qwen2_5_vl_visual_tokens_stored_at_visual_bits():
    model = tiny_qwen2_5_vl()
    inputs = qwen2_5_vl_inputs(skimage_data.coffee(), side=48)
    kvplan.load(model, _modality_plan(model))
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    _check_stored_bits(model, inputs, out)


def test_vlm_fp16_plan_matches_dynamic_cache():
    model = tiny_llava_onevision()
    inputs = llava_onevision_inputs(model, skimage_data.astronaut())
    ref = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    kvplan.load(model, "fp16")
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, ref)
