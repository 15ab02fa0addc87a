"""quantizer.recent_length: the newest committed tokens keep their residual form, which reads use."""

import pytest
import torch

from kvplan import Geometry, KVPlanCache, baseline_plan, uniform_plan
from kvplan.kernels import reference
from tests.runtime.routes import KERNELS, generate_like_dequantize, prefill_then_decode, random_kv, with_quantizer
from tests.tiny_models import tiny_llama

GEOM = Geometry(2, 2, 16, ("full", "full"), "llama")
HYBRID = Geometry(2, 2, 64, ("full", "sliding"), "llama", 48)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("recent", [5, 12, 40])
def test_bytes_equal_the_plan_at_every_length(bits, recent):
    """Prefill then token by token, on a full and a sliding-window layer with a sink and a residual
    window: the cache holds exactly plan.bpv(T) (fp32 storage) after every step, and the copies are
    the newest min(recent, committed - sink) committed tokens."""
    plan = with_quantizer(uniform_plan(HYBRID, 2, group_size=32, residual_length=8, sink_length=1),
                          residual_bits=bits, recent_length=recent)
    cache = KVPlanCache(plan, HYBRID)
    for T in prefill_then_decode(cache, 70):
        assert cache.bpv() == plan.bpv(context_len=T, full_precision_bits=32).total, (bits, T)
        full = cache.layers[0]
        want = min(recent, full.committed - 1) if full.committed else 0
        assert full.recent["k"].length == full.recent["v"].length == want, T
    assert cache.layers[1].dropped > 0  # the sliding layer freed groups with copies in front of them


def test_reads_use_the_copies_and_the_slot_codes_stay_the_same():
    """After a commit the newest 6 committed tokens read as their 8-bit residual codes, older ones as
    their slot codes, which are exactly those of the plan without copies."""
    base = with_quantizer(baseline_plan("int2", GEOM, residual_length=0), residual_bits=8)  # group 32
    plan = with_quantizer(base, recent_length=6)
    reads = {}
    for name, p in (("copies", plan), ("none", base)):
        layer = KVPlanCache(p).layers[0]
        k, v = random_kv(20, 1)
        layer.update(k, v)  # 20 wait, coded per token after this forward
        k2, v2 = random_kv(12, 2)
        layer.update(k2, v2)  # 32: the group commits
        assert layer.committed == 32
        reads[name] = (layer, layer._read("k"), torch.cat([k, k2], dim=-2))
    layer, got, written = reads["copies"]
    nlayer, plain, _ = reads["none"]
    assert torch.equal(layer.segments["k"][0].blocks[0].codes, nlayer.segments["k"][0].blocks[0].codes)
    assert torch.equal(got[:, :, :26], plain[:, :, :26])
    # the copies: tokens 26..31 as per-token 8-bit codes (tokens 26..31 of the first 20 were coded after
    # their forward; 20..31 were coded at the end of the commit step)
    c, s, z = reference.quantize(written[:, :, 20:], 8, 32, "token")
    want = reference.dequantize(c, s, z, 8, 32, "token", 16, dtype=torch.float32)[:, :, 6:]
    assert torch.equal(got[:, :, 26:], want)
    assert (got[:, :, 26:] - written[:, :, 26:]).abs().max() < (plain[:, :, 26:] - written[:, :, 26:]).abs().max()
    # K and V x 2 heads x 6 copies x (codes + fp16 scale and zero)
    assert layer.nbytes_parts()["residual"] == 2 * 2 * 6 * (16 + 4)


@pytest.mark.parametrize("attention", KERNELS)
def test_fused_kernels_read_the_copies_like_the_dequantize_route(attention):
    """Greedy generation on a tiny Llama: the packed kernels (the segments up to the copies, then the
    copies and the residual dense) give the dequantize route's tokens and scores, with a sink,
    Hadamard-rotated blocks, and copies that cross commits."""
    model = tiny_llama()
    g = Geometry.of(model)
    plan = with_quantizer(uniform_plan(g, 2, group_size=32, residual_length=0, sink_length=1), residual_bits=8,
                 recent_length=10, rotation="hadamard")
    generate_like_dequantize(model, plan, attention, max_new_tokens=40)
