"""quantizer.residual_bits: the newest uncommitted tokens held as per-token codes after their first forward."""

import pytest
import torch

import kvplan
from kvplan import Geometry, KVPlanCache, baseline_plan, uniform_plan
from kvplan.kernels import reference
from tests.runtime.routes import prefill_then_decode, random_kv, with_quantizer
from tests.tiny_models import tiny_llama

GEOM = Geometry(2, 2, 16, ("full", "full"), "llama")
HYBRID = Geometry(2, 2, 64, ("full", "sliding"), "llama", 48)


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_bytes_equal_the_plan_at_every_length(bits):
    """Prefill then token by token, on a full and a sliding-window layer with a sink and a residual
    window: the cache holds exactly plan.bpv(T) (fp32 storage) after every step."""
    plan = with_quantizer(uniform_plan(HYBRID, 2, group_size=32, residual_length=8, sink_length=1), residual_bits=bits)
    cache = KVPlanCache(plan, HYBRID)
    for T in prefill_then_decode(cache, 60):
        assert cache.bpv() == plan.bpv(context_len=T, full_precision_bits=32).total, (bits, T)
    if bits < 16:  # 97 tokens, 64 committed: 33 wait, all coded (the last step's forward is over)
        res = cache.layers[0].residual["k"]
        assert res.length == 33 and res.sealed.length == 33 and res.fresh.shape[-2] == 0


def test_first_use_full_precision_then_the_per_token_code():
    cache = KVPlanCache(with_quantizer(baseline_plan("int2", GEOM, residual_length=0), residual_bits=8))  # group 32
    layer = cache.layers[0]
    k, v = random_kv(20, 1)
    out_k, out_v = layer.update(k, v)
    assert torch.equal(out_k, k) and torch.equal(out_v, v)  # their own forward: as written
    k2, v2 = layer.update(*random_kv(1, 2))
    codes, scale, zero = reference.quantize(k, 8, 32, "token")  # per token, groups of min(32, D) channels
    want = reference.dequantize(codes, scale, zero, 8, 32, "token", 16, dtype=torch.float32)
    assert torch.equal(k2[:, :, :20], want) and not torch.equal(k2[:, :, :20], k)
    assert (k2[:, :, :20] - k).abs().max() < 0.05


def test_a_commit_encodes_the_coded_tokens_and_never_recodes_a_group():
    cache = KVPlanCache(with_quantizer(baseline_plan("int4", GEOM, residual_length=0), residual_bits=8))  # group 32
    layer = cache.layers[0]
    layer.update(*random_kv(20, 3))
    for step in range(11):  # tokens 20..30 wait, coded
        layer.update(*random_kv(1, 10 + step))
    waiting = layer._read("k").clone()  # the 31 tokens as the cache reads them: their 8-bit codes
    k31, v31 = random_kv(1, 99)
    layer.update(k31, v31)  # the group of 32 fills and commits in this step
    assert layer.committed == 32 and layer.residual["k"].length == 0
    block = layer.segments["k"][0].blocks[0]
    codes, scale, zero = reference.quantize(torch.cat([waiting, k31], dim=-2), 4, 32, "channel")
    assert torch.equal(block.codes, codes) and torch.equal(block.scale, scale) and torch.equal(block.zero, zero)
    for step in range(40):  # later commits append; the first group is never coded again
        layer.update(*random_kv(1, 50 + step))
    assert layer.committed == 64
    assert torch.equal(layer.segments["k"][0].blocks[0].codes[:, :, :32], codes)


def test_crop_and_batch_ops_reach_the_coded_tokens():
    cache = KVPlanCache(with_quantizer(baseline_plan("int4", GEOM, residual_length=16), residual_bits=8))
    layer = cache.layers[0]
    layer.update(*random_kv(40, 0))
    layer.update(*random_kv(3, 1))  # 43 < 16 + 32: nothing committed, all 43 wait, coded
    res = layer.residual["k"]
    assert layer.committed == 0 and res.length == 43 and res.sealed.length == 43
    before = layer._read("k").clone()
    layer.crop(-5)
    assert layer.get_seq_length() == 38 and torch.equal(layer._read("k"), before[:, :, :38])
    layer.batch_repeat_interleave(3)
    again = layer._read("k")
    assert again.shape[0] == 3 and all(torch.equal(again[i], before[0, :, :38]) for i in range(3))
    nbytes = layer.nbytes_parts()["residual"]
    assert nbytes == 2 * 3 * 2 * 38 * (16 + 4)  # K and V x batch 3 x 2 heads x 38 tokens x (codes + fp16 scale, zero)


@pytest.mark.parametrize("attention", ["auto", "dequantize"])
def test_generate_holds_the_plans_bpv_and_stays_close_to_full_precision_residual(attention):
    """Greedy decoding on a tiny Llama through kvplan.load: the cache holds plan.bpv(T); the 8-bit
    residual's logits stay within a small distance of the full-precision residual's."""
    model = tiny_llama()
    ids = torch.randint(0, 100, (1, 45), generator=torch.Generator().manual_seed(0))
    plan16 = baseline_plan("int4", GEOM, residual_length=0)  # group 32: 13 tokens wait after the prompt
    plan8 = with_quantizer(plan16, residual_bits=8)
    outs = {}
    for name, plan in (("16", plan16), ("8", plan8)):
        kvplan.load(model, plan, attention=attention)
        out = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, return_dict_in_generate=True,
                             output_scores=True)
        T = out.cache.get_seq_length()
        assert out.cache.bpv() == plan.bpv(context_len=T, full_precision_bits=32).total
        outs[name] = (out, torch.stack(out.scores))
        kvplan.unload(model)
    assert outs["8"][0].cache.nbytes() < outs["16"][0].cache.nbytes()
    diff = (outs["8"][1] - outs["16"][1]).abs().max()
    assert 0 < diff < 0.05 * outs["16"][1].abs().max()
