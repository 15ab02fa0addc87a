"""Left-padded batches are stored as the search stores unpadded sequences (``KVPlanCache.align_to_padding``):
every row's first real tokens are its attention sinks, the token groups start at the longest padding (the
most-padded row commits, groups and frees its tokens as it does alone), and its keys are quantized in the
pre-RoPE frame of its own positions. Without it a padded row's sink positions hold padding (its streamed
heads lose their sink, its first token is coded like any other) and its keys are turned by its padding's
angle before they are coded: on the default model's recorded plan a padded row read KL 0.15-0.16 against 0.0115 unpadded
(``bench/results/padded_batches.md``)."""

import dataclasses

import pytest
import torch

import kvplan
from kvplan import CacheError, Geometry, KVPlanCache, uniform_plan
from kvplan.models import TEXT, rope_inv_freq
from kvplan.plans import plan_bytes
from kvplan.plans._fields import SINK_AXIS
from kvplan.runtime.load import make_cache
from tests.runtime.routes import KERNELS, with_quantizer
from tests.runtime.test_streamed_heads import streamed
from tests.tiny_models import tiny_gemma3, tiny_llama

GEOM = Geometry(2, 2, 16, ("full", "full"), "llama")
GROUP = 32
ROW = 70  # prompt tokens of the padded row: two groups committed, the third filling


def _plans():
    sink = uniform_plan(GEOM, 2, group_size=GROUP, residual_length=0, sink_length=2)
    rotated = sink.replace(quantizer=dataclasses.replace(sink.quantizer, rotation="hadamard", key_pre_rope=True),
                           rope_inv_freq=rope_inv_freq(tiny_llama()))
    return {
        "no sink": with_quantizer(sink, sink_length=0),
        "sink": sink,
        "streamed heads": streamed(with_quantizer(sink, recent_length=2, stream_window=3), [(0, 1), (1, 0)]),
        "rotated keys": rotated,
        "rotated keys, streamed heads": streamed(with_quantizer(rotated, recent_length=2, stream_window=3),
                                                 [(0, 1), (1, 0)]),
    }


def _batch(pad: int):
    """A row of ``ROW`` prompt tokens left-padded by ``pad`` next to an unpadded row of ``ROW + pad``."""
    g = torch.Generator().manual_seed(3)
    row = torch.randint(3, 256, (ROW,), generator=g)
    other = torch.randint(3, 256, (ROW + pad,), generator=g)
    ids = torch.stack([torch.cat([torch.zeros(pad, dtype=torch.long), row]), other])
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    return row, ids, mask


def _generate(model, ids, mask, **kwargs):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, **kwargs)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)  # [B, 24], [B, 24, V]


def _assert_padded_row_reads_as_alone(model, plan, attention: str, pad: int = GROUP) -> None:
    """Under ``plan`` on ``attention``: the row left-padded by ``pad`` in a batch generates the tokens and
    logits it generates alone."""
    kvplan.load(model, plan, attention=attention)
    row, ids, mask = _batch(pad)
    batch_tokens, batch_logits = _generate(model, ids, mask)
    alone_tokens, alone_logits = _generate(model, row[None], torch.ones(1, row.numel(), dtype=torch.long))
    kvplan.unload(model)
    assert torch.equal(batch_tokens[0], alone_tokens[0])
    torch.testing.assert_close(batch_logits[0], alone_logits[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pad", [GROUP, 13])
@pytest.mark.parametrize("attention", [pytest.param("dequantize", id="dequantize"), *KERNELS])
@pytest.mark.parametrize("name", ["no sink", "sink", "streamed heads", "rotated keys", "rotated keys, streamed heads"])
def test_a_left_padded_row_generates_as_it_does_alone(name, attention, pad):
    """The group grid starts at the padding (a whole number of groups or not), the sinks follow it and
    the keys keep their own RoPE frame, so the padded row reads exactly what it reads alone: the same
    tokens and logits."""
    model = tiny_llama()
    _assert_padded_row_reads_as_alone(model, _plans()[name], attention, pad)


def test_sinks_move_past_the_longest_left_padding():
    """The cache holds positions [0, P + S) apart; unpadded prompts and sink-less plans keep the plan's
    sink_length; the prompt's sinks cannot be moved once tokens are written."""
    model = tiny_llama()
    plan = _plans()["sink"]
    _, ids, mask = _batch(pad=5)
    mask[1, :2] = 0  # a second, shorter padding: the longest one counts
    assert make_cache(model, plan, ids, mask).sink_length == 2 + 5
    assert make_cache(model, plan, ids, torch.ones_like(ids)).sink_length == 2
    assert make_cache(model, plan).sink_length == 2
    assert make_cache(model, with_quantizer(plan, sink_length=0), ids, mask).sink_length == 0
    cache = KVPlanCache(plan, GEOM)
    cache.layers[0].update(torch.randn(2, 2, 4, 16), torch.randn(2, 2, 4, 16))
    with pytest.raises(CacheError, match="already holds tokens"):
        cache.align_to_padding(mask)


@pytest.mark.parametrize("name", ["sink", "streamed heads"])
def test_padding_is_held_as_sinks_and_counted(name):
    """The padded positions before the sinks are stored at sink_bits, not in the slots' groups, and the
    cache's bytes count them: each row of a batch padded by P holds what the unpadded row holds (the
    plan's layout of its tokens, ``plan_bytes``) plus P positions at sink_bits (fp32 model: 32-bit
    residual accounting). A padding that is not a whole number of groups moves the group grid with it."""
    model = tiny_llama()
    plan = _plans()[name]
    q = plan.quantizer
    kvplan.load(model, plan)  # streamed heads need kvplan's attention
    for pad in (5, GROUP + 3):
        _, ids, mask = _batch(pad)
        cache = make_cache(model, plan, ids, mask)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
        assert cache.grid_origin == pad
        unpadded = sum(plan_bytes(plan, GEOM, [TEXT] * ROW, batch_size=2, fp_bytes=4).values())
        payload, scales = q.sink_format.run_bytes(SINK_AXIS, q.group_size, GEOM.head_dim, 0, pad, 4)
        padding = 2 * GEOM.num_layers * GEOM.num_kv_heads * 2 * (payload + scales)  # rows x layers x heads x K, V
        assert cache.nbytes() == unpadded + padding, pad
    kvplan.unload(model)


@pytest.mark.parametrize("pad", [GROUP, 13])
@pytest.mark.parametrize("attention", ["dequantize", "native"])
def test_a_left_padded_row_of_a_sliding_window_model_generates_as_it_does_alone(attention, pad):
    """Gemma 3's sliding layers (window 48) free the groups that leave the window, the sinks with the
    first: the padded row's reads still equal its reads alone past the window."""
    model = tiny_gemma3(sliding_window=48)
    plan = uniform_plan(Geometry.of(model), 2, group_size=GROUP, residual_length=0, sink_length=2)
    _assert_padded_row_reads_as_alone(model, plan, attention, pad)


def test_a_cache_passed_to_generate_has_its_sinks_moved_too():
    """Under kvplan.load, an empty KVPlanCache the caller passes to generate (``cache=`` or
    ``past_key_values=``) gets the sinks make_cache would give it, and the same generation."""
    model = tiny_llama()
    plan = _plans()["streamed heads"]
    kvplan.load(model, plan)
    _, ids, mask = _batch(pad=GROUP)
    made, _ = _generate(model, ids, mask)
    for keyword in ("cache", "past_key_values"):
        cache = KVPlanCache(plan, model)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, min_new_tokens=24,
                             do_sample=False, **{keyword: cache})
        assert cache.sink_length == 2 + GROUP, keyword
        assert torch.equal(out[:, ids.shape[1]:], made), keyword
    kvplan.unload(model)


@pytest.mark.parametrize("attention", [pytest.param("dequantize", id="dequantize"), *KERNELS])
def test_beam_search_on_a_left_padded_batch_keeps_each_row_in_its_frame(attention):
    """Beams repeat and reorder the rows: each keeps its own RoPE frame, so the padded row's best beam is
    the one it finds alone."""
    model = tiny_llama()
    kvplan.load(model, _plans()["rotated keys"], attention=attention)
    row, ids, mask = _batch(pad=GROUP)
    batch_tokens, _ = _generate(model, ids, mask, num_beams=3)
    alone_tokens, _ = _generate(model, row[None], torch.ones(1, row.numel(), dtype=torch.long), num_beams=3)
    kvplan.unload(model)
    assert torch.equal(batch_tokens[0], alone_tokens[0])
