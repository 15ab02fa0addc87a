"""quantizer.sink_bits: attention-sink positions held as 8-bit per-token codes in the slots' rotated frame."""

import dataclasses

import pytest
import torch

from kvplan import Geometry, KVPlanCache, uniform_plan
from kvplan.kernels import reference
from kvplan.models.rope import rope_inv_freq
from tests.runtime.routes import KERNELS, generate_like_dequantize, prefill_then_decode, random_kv, with_quantizer
from tests.tiny_models import tiny_llama

HYBRID = Geometry(2, 2, 64, ("full", "sliding"), "llama", 48)


@pytest.mark.parametrize("sink", [1, 4, 40])
@pytest.mark.parametrize("recent", [0, 6])
def test_bytes_equal_the_plan_at_every_length(sink, recent):
    """Prefill then token by token on a full and a sliding-window layer (whose window frees the sink):
    the cache holds exactly plan.bpv(T) (fp32 storage) after every step; a sink position costs a
    per-token 8-bit code, a quarter of what it costs as written."""
    plan = with_quantizer(uniform_plan(HYBRID, 2, group_size=32, residual_length=8, sink_length=sink),
                          residual_bits=8, recent_length=recent, sink_bits=8)
    cache = KVPlanCache(plan, HYBRID)
    for T in prefill_then_decode(cache, 70):
        assert cache.bpv() == plan.bpv(context_len=T, full_precision_bits=32).total, (sink, T)
    assert cache.layers[1].dropped > 0  # the sliding layer freed its sink with its first group


@pytest.mark.parametrize("sink", [1, 4])
def test_a_coded_sink_position_costs_its_8bit_code(sink):
    """At 256 tokens (224 committed) each sink position of each layer, KV head and kind costs 64 one-byte
    codes plus an fp16 scale and zero per 32 channels instead of 64 fp32 values."""
    geom = Geometry(2, 2, 64, ("full", "full"), "llama")
    plan = with_quantizer(uniform_plan(geom, 2, group_size=32, residual_length=8, sink_length=sink), sink_bits=8)
    assert plan.quantizer.sink_token_bytes(64, 4) == 64 + 2 * 4
    saved = (with_quantizer(plan, sink_bits=16).bpv(context_len=256, full_precision_bits=32).total
             - plan.bpv(context_len=256, full_precision_bits=32).total)
    assert saved == pytest.approx(8 * sink * (64 * 4 - 72) / (64 * 256))


@pytest.mark.parametrize("slot_bits", [8, 16])
def test_a_sink_beside_slots_of_the_same_bits_stays_its_own_block(slot_bits):
    """8-bit (or 16-bit) slots after an 8-bit (16-bit) sink: the sink's token-axis block is never merged
    with the keys' channel-axis blocks that follow it; every position reads back from its own format and
    the bytes are the plan's."""
    plan = with_quantizer(uniform_plan(HYBRID, slot_bits, group_size=32, residual_length=0, sink_length=2),
                          sink_bits=min(slot_bits, 8), rotation="hadamard")
    cache = KVPlanCache(plan, HYBRID)
    k, v = random_kv(70, 5, D=64)
    for layer in cache.layers:
        layer.update(k, v)
        layer.update(*random_kv(30, 6, D=64))  # a second commit appends to the slots' segment
    layer = cache.layers[0]  # the full layer (the sliding one freed its sink)
    assert layer.committed == 96
    axes = [(seg.start, seg.length, seg.blocks[0].axis) for seg in layer.segments["k"]]
    assert axes == [(0, 2, "token"), (2, 94, "channel")]
    assert cache.bpv() == plan.bpv(context_len=100, full_precision_bits=32).total
    got = layer._read("k")
    assert (got[:, :, :70] - k).abs().max() < 0.05 * k.abs().max()


def test_sink_reads_back_as_its_rotated_8bit_code():
    """The sink tokens are coded per token after the slots' Hadamard rotation and read back through its
    inverse: within 8-bit rounding of what was written, and exactly the reference codec's read."""
    model = tiny_llama()
    g = Geometry.of(model)
    plan = with_quantizer(uniform_plan(g, 2, group_size=32, residual_length=0, sink_length=3), sink_bits=8,
                 rotation="hadamard")
    layer = KVPlanCache(plan, g).layers[0]
    k, v = random_kv(64, 3, D=g.head_dim)
    layer.update(k[:, : g.num_kv_heads], v[:, : g.num_kv_heads])
    assert layer.committed == 64
    block = layer.segments["v"][0].blocks[0]
    assert (block.bits, block.axis, block.length) == (8, "token", 3)
    x = v[:, : g.num_kv_heads, :3]
    rot = layer.rotation["v"]
    c, s, z = reference.quantize(rot.forward(x, 0), 8, 32, "token")
    want = rot.inverse(reference.dequantize(c, s, z, 8, 32, "token", g.head_dim, dtype=torch.float32), 0)
    got = layer._read("v")[:, :, :3]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert (got - x).abs().max() < 0.02 * x.abs().max()
    assert not torch.equal(got, x)


@pytest.mark.parametrize("attention", KERNELS)
def test_fused_kernels_read_coded_sinks_like_the_dequantize_route(attention):
    """Greedy generation on a tiny Llama: every kernel reads the token-axis 8-bit sink blocks (keys in
    the pre-RoPE Hadamard frame) as the dequantize route does, with recent copies beside them."""
    model = tiny_llama()
    g = Geometry.of(model)
    base = uniform_plan(g, 2, group_size=32, residual_length=0, sink_length=4)
    q = dataclasses.replace(base.quantizer, residual_bits=8, recent_length=6, sink_bits=8, rotation="hadamard",
                            key_pre_rope=True)
    plan = base.replace(quantizer=q, rope_inv_freq=rope_inv_freq(model))
    generate_like_dequantize(model, plan, attention, max_new_tokens=40)


@pytest.mark.parametrize("attention", KERNELS)
@pytest.mark.parametrize("value_bits, sink_bits", [(16, 16), (8, 8)])
def test_values_stored_like_the_sink_stay_their_own_segment_on_every_kernel(attention, value_bits, sink_bits):
    """Token-axis values at the sink's bits and format used to merge into the sink's segment while the
    channel-axis keys did not: keys and values then listed different segments, and the Triton kernel,
    which reads them pair by pair, refused the cache ('must list the same segments')."""
    model = tiny_llama(head_dim=64)
    plan = with_quantizer(uniform_plan(Geometry.of(model), 2, value_bits, group_size=32, residual_length=8,
                                       sink_length=1), sink_bits=sink_bits)
    out, _ = generate_like_dequantize(model, plan, attention, max_new_tokens=8)
    layer = out.cache.layers[0]
    assert [(s.start, s.length) for s in layer.segments["v"]] == [(s.start, s.length) for s in layer.segments["k"]]
    assert layer.segments["v"][0].length == 1  # the sink, alone
