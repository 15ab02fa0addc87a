"""The fast read path (dequantize straight into one output buffer) equals the plain one."""

import pytest
import torch

from kvplan import Geometry, KVPlanCache, baseline_plan, uniform_plan
from kvplan.kernels import reference

GEOM = Geometry(2, 4, 16, ("full", "full"), "llama")


def _slow_read(layer, kind):
    """The straightforward read: decode every block, place its heads, concatenate the residual."""
    parts = []
    res = layer.residual[kind].read()
    for seg in layer.segments[kind]:
        out = torch.empty(res.shape[0], res.shape[1], seg.length, res.shape[-1], dtype=layer.dtype)
        for block in seg.blocks:
            out[:, list(block.heads)] = block.decode(layer.dtype)
        parts.append(out)
    parts.append(res)
    return torch.cat(parts, dim=-2)


def _mixed_plan(heads_bits):
    plan = uniform_plan(GEOM, 4, 4, residual_length=16)
    table = plan.table()
    for h, (kb, vb) in enumerate(heads_bits):
        table[:, h, 0, :] = kb
        table[:, h, 1, :] = vb
    return plan.with_table(table)


PLANS = {
    "int4": lambda: baseline_plan("int4", GEOM, residual_length=16),
    "int2-g64": lambda: baseline_plan("int2-g64", GEOM, residual_length=16),
    "k4v2": lambda: baseline_plan("k4v2", GEOM, residual_length=16),
    "int8-token-keys": lambda: uniform_plan(GEOM, 8, 3, residual_length=16, key_axis="token"),
    # heads {0, 2} and {1, 3} share settings: non-contiguous head groups; 16 = full precision slots
    "mixed-noncontiguous": lambda: _mixed_plan([(4, 2), (2, 16), (4, 2), (2, 16)]),
    "mixed-contiguous": lambda: _mixed_plan([(4, 4), (4, 4), (3, 2), (8, 8)]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("batch", [1, 3], ids=["b1", "b3"])
@pytest.mark.parametrize("name", list(PLANS))
def test_fast_read_equals_slow_read(name, batch, dtype):
    cache = KVPlanCache(PLANS[name]())
    layer = cache.layers[1]
    g = torch.Generator().manual_seed(0)
    layer.update(torch.randn(batch, 4, 77, 16, generator=g).to(dtype), torch.randn(batch, 4, 77, 16, generator=g).to(dtype))
    for step in range(40):  # several commits on top of the prefill's
        k, v = layer.update(torch.randn(batch, 4, 1, 16, generator=g).to(dtype),
                            torch.randn(batch, 4, 1, 16, generator=g).to(dtype))
    assert layer.committed >= 64
    for kind, got in (("k", k), ("v", v)):
        assert got.dtype == dtype and got.shape == (batch, 4, 117, 16)
        assert torch.equal(layer._read(kind), _slow_read(layer, kind))


def test_segments_of_two_modalities_and_an_unaligned_start():
    geom = Geometry(1, 2, 16, ("full",), "llava")
    plan = uniform_plan(geom, 4, 2, residual_length=0, modalities=("text", "visual"))
    table = plan.table()
    table[0, :, :, 1] = 2  # visual tokens at 2 bits
    cache = KVPlanCache(plan.with_table(table))
    cache.assign_labels(["text"] * 40 + ["visual"] * 50 + ["text"] * 30)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(1)
    layer.update(torch.randn(2, 2, 120, 16, generator=g), torch.randn(2, 2, 120, 16, generator=g))
    k, v = layer.update(torch.randn(2, 2, 1, 16, generator=g), torch.randn(2, 2, 1, 16, generator=g))
    assert len(layer.segments["k"]) >= 3
    assert any(b.start_offset for s in layer.segments["k"] for b in s.blocks)  # channel groups cut mid-group
    assert torch.equal(k, _slow_read(layer, "k")) and torch.equal(v, _slow_read(layer, "v"))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("axis,offset", [("token", 0), ("channel", 0), ("channel", 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_dequantize_into_a_strided_view(bits, axis, offset, dtype):
    x = torch.randn(2, 3, 70, 64, generator=torch.Generator().manual_seed(bits))
    packed, scale, zero = reference.quantize(x, bits, 32, axis, offset)
    want = reference.dequantize(packed, scale, zero, bits, 32, axis, 64, offset, dtype)
    buf = torch.full((2, 5, 100, 64), float("nan"), dtype=dtype)
    view = buf[:, 1:4, 10:80]
    assert not view.is_contiguous()
    got = reference.dequantize_into(view, packed, scale, zero, bits, 32, axis, 64, offset)
    assert got is view and torch.equal(view, want)
    assert buf[:, 0].isnan().all() and buf[:, 4].isnan().all()
    assert buf[:, :, :10].isnan().all() and buf[:, :, 80:].isnan().all()


def test_finite_check_locates_nan_after_cheap_sum():
    from kvplan import CacheError

    cache = KVPlanCache(baseline_plan("int4", GEOM))
    k = torch.full((1, 4, 3, 16), 60000.0, dtype=torch.float16)  # the fp16 sum overflows, values are finite
    cache.layers[0].update(k, k.clone())
    k2 = torch.zeros(1, 4, 2, 16)
    k2[0, 3, 1, 7] = float("-inf")
    with pytest.raises(CacheError, match="kv_head 3, new token 1, dim 7"):
        cache.layers[1].update(k2, torch.zeros_like(k2))
