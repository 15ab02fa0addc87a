"""kvplan.load with decode attention from the packed cache: the chunked PyTorch kernel, and
the fused Triton kernel (CPU: Triton interpreter)."""

import dataclasses

import pytest
import torch

import kvplan
from kvplan import Geometry, baseline_plan, uniform_plan
from tests.tiny_models import llava_onevision_inputs, tiny_llama, tiny_llava_onevision


from tests.runtime.routes import KERNELS


def _mixed_plan(geometry):
    plan = uniform_plan(geometry, 4, 2, residual_length=8)
    table = plan.table()
    table[:, 0, 0, :] = 8  # head 0 keys at 8 bits, others 4: mixed bits within a layer
    table[1, 1, 1, :] = 16
    return plan.with_table(table)


@pytest.mark.parametrize("attention", KERNELS)
@pytest.mark.parametrize("sink_length", [0, 3])
def test_fused_attention_matches_dequantize_path(sink_length, attention):
    model = tiny_llama()
    ids = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9] * 6, [10, 11, 12, 13, 14, 15, 16, 17] * 6])
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    plan = _mixed_plan(Geometry.of(model))
    plan = plan.replace(quantizer=dataclasses.replace(plan.quantizer, sink_length=sink_length))
    kvplan.load(model, plan, attention="dequantize")
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                         output_scores=True, return_dict_in_generate=True)
    kvplan.load(model, plan, attention=attention)
    assert model.config._attn_implementation == "kvplan_packed"
    calls = []
    kernel = model._kvplan_attention_kernel
    model._kvplan_attention_kernel = lambda *a: calls.append(1) or kernel(*a)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                         output_scores=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    assert out.cache.nbytes_breakdown() == ref.cache.nbytes_breakdown()
    assert len(calls) >= 19 * 2  # every decode step after the first commit, in both layers
    kvplan.unload(model)
    assert model.config._attn_implementation != "kvplan_packed"


@pytest.mark.parametrize("attention", KERNELS)
def test_vlm_vision_tower_keeps_its_attention(attention):
    model = tiny_llava_onevision()
    before = model.config.vision_config._attn_implementation
    kvplan.load(model, baseline_plan("int4", Geometry.of(model), residual_length=0,
                                     modalities=("text", "visual")), attention=attention)
    assert model.config.text_config._attn_implementation == "kvplan_packed"
    assert model.config.vision_config._attn_implementation == before
    from skimage import data

    inputs = llava_onevision_inputs(model, data.astronaut())
    out = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 5
