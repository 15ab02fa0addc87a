"""Tiny random VLMs generate through a plan with different bits for visual and text tokens."""

import skimage.data as skimage_data
import torch

import kvplan
from kvplan.models import labels_from_input_ids
from tests.tiny_models import (llava_onevision_inputs, qwen2_5_vl_inputs, tiny_llava_onevision,
                               tiny_qwen2_5_vl)

TEXT_BITS = {"k": 8, "v": 4}
VISUAL_BITS = {"k": 3, "v": 2}


def _modality_plan(model, residual_length=0):
    g = kvplan.Geometry.of(model)
    plan = kvplan.uniform_plan(g, 16, modalities=("text", "visual"), residual_length=residual_length)
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


def test_generate_labels_the_prompt_whatever_keyword_carries_it():
    """generate's first parameter is named ``inputs``: ``inputs=ids`` labels the image tokens as
    ``input_ids=ids`` does (it used to store them at the text bits, silently)."""
    model = tiny_llava_onevision()
    inputs = llava_onevision_inputs(model, skimage_data.astronaut())
    kvplan.load(model, _modality_plan(model))
    ids = inputs.pop("input_ids")
    out = model.generate(inputs=ids, **inputs, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    _check_stored_bits(model, inputs, out)


def test_a_reset_cache_passed_to_generate_labels_its_next_prompt():
    """A cache of the caller's, emptied by ``reset()`` (which clears its labels), is labelled from the
    next prompt's ids as a cache ``kvplan.load`` makes is."""
    model = tiny_llava_onevision()
    inputs = llava_onevision_inputs(model, skimage_data.astronaut())
    kvplan.load(model, _modality_plan(model))
    cache = kvplan.make_cache(model, model.kvplan_plan, inputs["input_ids"])
    model.generate(**inputs, cache=cache, max_new_tokens=2, do_sample=False)
    cache.reset()
    out = model.generate(**inputs, cache=cache, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    assert out.cache is cache
    _check_stored_bits(model, inputs, out)


def test_a_conversations_next_turn_labels_its_new_image():
    """Continuing with the previous turn's cache (``past_key_values=out.cache``): the new turn's image
    tokens are labelled visual, and the cache's bpv is the plan's for the conversation's labels."""
    model = tiny_llava_onevision()
    plan = _modality_plan(model)
    kvplan.load(model, plan)
    first = llava_onevision_inputs(model, skimage_data.astronaut(), text_before=tuple(range(3, 40)),
                                   text_after=tuple(range(40, 60)))
    out = model.generate(**first, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    second = llava_onevision_inputs(model, skimage_data.coffee(), text_before=(7, 8, 9),
                                    text_after=tuple(range(10, 40)))
    ids = torch.cat([out.sequences, second["input_ids"]], 1)
    out2 = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=second["pixel_values"],
                          image_sizes=second["image_sizes"], past_key_values=out.cache, max_new_tokens=4,
                          do_sample=False, return_dict_in_generate=True)
    cache = out2.cache
    n = cache.get_seq_length()
    labels = labels_from_input_ids(out2.sequences[:, :n], model.config)[0]
    assert labels.count("visual") == 2 * labels_from_input_ids(first["input_ids"], model.config)[0].count("visual")
    assert cache.labels_for(0, n) == labels
    assert cache.bpv() == plan.bpv(cache.geometry, n, labels, full_precision_bits=32).total


def test_a_conversation_rewound_by_crop_labels_the_new_image_at_the_cropped_positions():
    """``cache.crop`` kept the removed positions' labels: a new turn written over them took those labels
    (a new image stored at the text bits), and the cache's bpv was not the plan's."""
    model = tiny_llava_onevision()
    plan = _modality_plan(model, residual_length=64)
    kvplan.load(model, plan)
    first = llava_onevision_inputs(model, skimage_data.astronaut(), text_before=(3, 4, 5),
                                   text_after=tuple(range(10, 50)))
    out = model.generate(**first, max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
    keep = 3 + labels_from_input_ids(first["input_ids"], model.config)[0].count("visual")  # text + image 1
    out.cache.crop(-(out.cache.get_seq_length() - keep))  # question 1 and the reply, still in the residual
    second = llava_onevision_inputs(model, skimage_data.coffee(), text_before=(), text_after=tuple(range(60, 160)))
    ids = torch.cat([first["input_ids"][:, :keep], second["input_ids"]], 1)
    out2 = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=second["pixel_values"],
                          image_sizes=second["image_sizes"], past_key_values=out.cache, max_new_tokens=1,
                          do_sample=False, return_dict_in_generate=True)
    cache = out2.cache
    n = cache.get_seq_length()
    labels = labels_from_input_ids(ids, model.config)[0][:n]
    assert cache.labels_for(0, n) == labels and labels[keep:].count("visual") > 0
    committed = cache.layers[0].committed
    assert committed > keep and cache.token_bits(0, "k")[0] == [
        VISUAL_BITS["k"] if lab == "visual" else TEXT_BITS["k"] for lab in labels[:committed]]
    assert cache.bpv() == plan.bpv(cache.geometry, n, labels, full_precision_bits=32).total


def test_generate_without_token_ids_refuses_a_plan_with_modalities():
    """Only ``inputs_embeds``: nothing tells the image tokens from the text ones, so a plan with visual
    bits is refused in one line rather than storing every token at the text bits."""
    import pytest

    from kvplan.errors import PlanError

    model = tiny_llava_onevision()
    inputs = llava_onevision_inputs(model, skimage_data.astronaut())
    kvplan.load(model, _modality_plan(model))
    embeds = model.get_input_embeddings()(inputs["input_ids"])
    with pytest.raises(PlanError, match="no input_ids .* cannot be told apart"):
        model.generate(inputs_embeds=embeds, attention_mask=inputs["attention_mask"], max_new_tokens=2)


def test_an_unlabelled_cache_refuses_a_multi_modality_prompt():
    """``make_cache(model, plan)`` without ids, passed to a plain ``generate`` (no kvplan.load to label
    the prompt): the image tokens would be stored at the text bits, silently; refused in one line."""
    import pytest

    from kvplan.errors import CacheError

    model = tiny_llava_onevision()
    inputs = llava_onevision_inputs(model, skimage_data.astronaut())
    cache = kvplan.make_cache(model, _modality_plan(model))
    with pytest.raises(CacheError, match="prompt reached a cache with no modality labels"):
        model.generate(**inputs, cache=cache, max_new_tokens=2, do_sample=False)
    labelled = kvplan.make_cache(model, _modality_plan(model))
    labelled.assign_labels(labels_from_input_ids(inputs["input_ids"], model.config))
    out = model.generate(**inputs, cache=labelled, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    _check_stored_bits(model, inputs, out)
