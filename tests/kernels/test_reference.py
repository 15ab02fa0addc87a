"""PyTorch reference quantizer: packing, edge cases, error bounds."""

import pytest
import torch

from kvplan.kernels import packed_row_bytes, reference
from kvplan.kernels.qtypes import qtype

BITS = [2, 3, 4, 8]


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", [1, 7, 8, 64, 128, 130])
def test_pack_unpack_exact(bits, n):
    codes = torch.randint(0, 1 << bits, (2, 3, 5, n), dtype=torch.uint8)
    packed = reference.pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == packed_row_bytes(n, bits)
    assert torch.equal(reference.unpack_codes(packed, bits, n), codes)


def test_packing_is_dense():
    assert packed_row_bytes(64, 2) == 16  # four codes per byte
    assert packed_row_bytes(64, 3) == 24  # 3 bits, no padding to 4
    assert packed_row_bytes(64, 4) == 32
    assert packed_row_bytes(64, 8) == 64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("axis,offset", [("token", 0), ("channel", 0), ("channel", 13)])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("bits", BITS)
def test_error_within_half_step(bits, group, axis, offset, dtype):
    torch.manual_seed(bits * 1000 + group)
    x = (torch.randn(2, 3, 37, 64) * 3).to(dtype)
    packed, scale, zero = reference.quantize(x, bits, group, axis, offset)
    assert scale.dtype == torch.float16 and zero.dtype == torch.float16
    y = reference.dequantize(packed, scale, zero, bits, group, axis, 64, offset, torch.float32)
    if axis == "token":
        step = scale.float().repeat_interleave(min(group, 64), dim=-1)
    else:
        step = scale.float().repeat_interleave(group, dim=2)[:, :, offset:offset + 37]
    # half a step, plus fp16 rounding of zero-point and scale
    tol = step / 2 + x.float().abs() * 2e-3 + 1e-3
    assert bool(((x.float() - y).abs() <= tol).all())


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("axis", ["token", "channel"])
def test_constant_and_zero_groups(bits, axis):
    x = torch.full((1, 2, 40, 64), 0.75)
    packed, scale, zero = reference.quantize(x, bits, 32, axis)
    assert bool((scale == 0).all())
    y = reference.dequantize(packed, scale, zero, bits, 32, axis, 64, 0, torch.float32)
    assert torch.equal(y, x)
    z = torch.zeros(1, 1, 3, 64, dtype=torch.bfloat16)
    p2, s2, z2 = reference.quantize(z, bits, 32, axis)
    assert torch.equal(reference.dequantize(p2, s2, z2, bits, 32, axis, 64, 0, torch.bfloat16), z)


def test_extremes_hit_code_range():
    x = torch.linspace(-1, 1, 64).reshape(1, 1, 1, 64)
    for bits in BITS:
        packed, _, _ = reference.quantize(x, bits, 64, "token")
        codes = reference.unpack_codes(packed, bits, 64)
        assert codes.min().item() == 0 and codes.max().item() == qtype(bits).qmax


def test_fp16_overflow_is_a_clear_error():
    x = torch.tensor([[[[1e6] + [0.0] * 63]]])
    with pytest.raises(ValueError, match="fp16 range"):
        reference.quantize(x, 4, 32, "token")


def test_bad_axis_and_bits():
    x = torch.zeros(1, 1, 4, 64)
    with pytest.raises(ValueError, match="axis"):
        reference.quantize(x, 4, 32, "head")
    with pytest.raises(ValueError, match="unsupported bit width 5"):
        reference.quantize(x, 5, 32, "token")
