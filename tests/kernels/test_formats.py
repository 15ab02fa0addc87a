"""The slot-format registry (kvplan.kernels.formats): encode / decode, bytes, codebooks."""

from __future__ import annotations

import pytest
import torch

from kvplan.kernels import dequantize, quantize
from kvplan.kernels.formats import SCALINGS, Format, default_codebook, lloyd_max_levels
from kvplan.kernels.reference import unpack_codes
from kvplan.plans.accounting import run_bytes

FORMATS = [Format(b, sc, lv) for b in (2, 3, 4, 8) for sc in SCALINGS
           for lv in ((None, default_codebook(b, sc, 32)) if b <= 4 else (None,))]


def _x(shape=(2, 3, 45, 64), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., :2] *= 6  # outlier channels
    return x


def _levels_in_value_units(fmt, scale, zero, axis, shape, group_size, offset):
    """All ``2**bits`` decodable values of every element: ``[B, h, T, D, 2**bits]``."""
    L = fmt.level_units()
    if L is None:
        L = torch.arange(1 << fmt.bits, dtype=torch.float32)
    B, h, T, D = shape
    if axis == "token":
        g = min(group_size, D)
        s = scale.float().repeat_interleave(g, dim=-1)
        z = None if zero is None else zero.float().repeat_interleave(g, dim=-1)
    else:
        s = scale.float().repeat_interleave(group_size, dim=2)[:, :, offset: offset + T]
        z = None if zero is None else zero.float().repeat_interleave(group_size, dim=2)[:, :, offset: offset + T]
    vals = s.unsqueeze(-1) * L
    return vals if z is None else vals + z.unsqueeze(-1)


@pytest.mark.parametrize("axis,offset", [("token", 0), ("channel", 0), ("channel", 7)])
@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
def test_encode_picks_the_nearest_level_and_decode_reads_it(fmt, axis, offset):
    """Every code is the level nearest to its value (ties aside) among the group's levels, and the
    decode returns exactly ``zero + scale * L[code]`` in the format's stored dtypes."""
    x = _x()
    codes, scale, zero = quantize(x, fmt.bits, 32, axis, offset, fmt=fmt)
    assert scale.dtype == fmt.spec.scale_dtype
    assert (zero is None) == fmt.spec.symmetric and (zero is None or zero.dtype == fmt.spec.zero_dtype)
    y = dequantize(codes, scale, zero, fmt.bits, 32, axis, 64, offset, torch.float32, fmt=fmt)
    vals = _levels_in_value_units(fmt, scale, zero, axis, x.shape, 32, offset)  # [..., 2**bits]
    c = unpack_codes(codes, fmt.bits, 64).long()
    torch.testing.assert_close(y, vals.gather(-1, c.unsqueeze(-1)).squeeze(-1), rtol=1e-6, atol=1e-6)
    best = (vals - x.unsqueeze(-1)).abs().min(-1).values
    got = (y - x).abs()
    assert torch.all(got <= best + 1e-4 * (1 + x.abs()))


@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
def test_bytes_held_equal_the_format_accounting(fmt, axis):
    x = _x((1, 1, 45, 64))
    codes, scale, zero = quantize(x, fmt.bits, 32, axis, 5 if axis == "channel" else 0, fmt=fmt)
    held = scale.nbytes + (0 if zero is None else zero.nbytes)
    payload, scales = run_bytes(fmt.bits, axis, 32, 64, 5, 45, 2, fmt)
    assert (payload, scales) == (codes.nbytes, held)


def test_v1_format_is_unchanged_and_symmetric_e4m3_costs_a_quarter():
    x = _x()
    v1 = quantize(x, 2, 32, "token")
    same = quantize(x, 2, 32, "token", fmt=Format(2))
    assert all(torch.equal(a, b) for a, b in zip(v1, same))
    assert run_bytes(2, "token", 32, 64, 0, 10, 2, Format(2, "absmax-e4m3"))[1] * 4 == run_bytes(2, "token", 32, 64,
                                                                                                 0, 10, 2)[1]


def test_lloyd_codebook_beats_uniform_levels_on_gaussian_groups():
    """The codebooks earn their place: lower MSE than uniform levels at the same bits and bytes."""
    x = torch.randn(4, 2, 256, 64, generator=torch.Generator().manual_seed(1))
    for bits in (2, 3):
        for sc in SCALINGS:
            mse = {}
            for lv in (None, default_codebook(bits, sc, 64)):
                f = Format(bits, sc, lv)
                y = dequantize(*quantize(x, bits, 64, "token", fmt=f), bits, 64, "token", 64, 0, torch.float32, fmt=f)
                mse[lv is None] = float(((y - x) ** 2).mean())
            assert mse[False] < 0.8 * mse[True], (bits, sc, mse)


def test_codebooks_are_deterministic_and_mirror_symmetric():
    a = lloyd_max_levels(2, True, 64)
    assert a == lloyd_max_levels.__wrapped__(2, True, 64)
    assert all(abs(u + v) < 2e-3 for u, v in zip(a, reversed(a)))
    b = lloyd_max_levels(3, False, 128)
    assert all(abs(u + v - 1) < 2e-3 for u, v in zip(b, reversed(b)))


def test_scale_past_e4m3_range_is_refused():
    x = torch.full((1, 1, 4, 64), 1000.0)
    x[..., 0] = -1000.0
    with pytest.raises(ValueError, match="absmax-e4m3 range"):
        quantize(x, 2, 32, "token", fmt=Format(2, "absmax-e4m3"))


@pytest.mark.parametrize("levels,msg", [((0.1, 0.2, 0.3), "needs 4 levels"), ((0.1, 0.3, 0.2, 0.9), "increasing"),
                                        ((-0.2, 0.1, 0.5, 0.9), r"lie in \[0, 1\]")])
def test_bad_codebooks_are_refused(levels, msg):
    with pytest.raises(ValueError, match=msg):
        Format(2, "minmax-fp16", levels)


def test_constant_groups_decode_exactly():
    """A group whose values are all equal decodes to that value: min-max formats exactly (scale 0,
    the zero-point holds it), absmax formats up to the e4m3 rounding of the scale times the top level."""
    rows = torch.zeros(1, 1, 32, 64)
    rows[..., 5:9, :] = 0.75  # token-axis groups (one token's channels) are constant
    flat = torch.full((1, 1, 32, 64), 0.75)  # channel-axis groups (tokens of one channel) are constant
    for f in FORMATS:
        for axis, x in (("token", rows), ("channel", flat)):
            y = dequantize(*quantize(x, f.bits, 32, axis, fmt=f), f.bits, 32, axis, 64, 0, torch.float32, fmt=f)
            if not f.spec.symmetric:
                assert torch.equal(y, x), (f.name, axis)
            elif f.levels is None:  # uniform symmetric levels reach +-1: the scale's e4m3 rounding only
                torch.testing.assert_close(y, x, rtol=1 / 16, atol=0)


def test_codebooks_reproduce_the_recorded_default_plan():
    """The levels are plan constants: the fit must give the recorded plan's codebooks to the digit
    (its values: absmax scaling, per-token groups of head_dim 64)."""
    import pathlib

    import yaml

    recorded = pathlib.Path(__file__).parents[2] / "bench" / "results" / "search-2.5bpv.yaml"
    books = yaml.safe_load(recorded.read_text())["quantizer"]["codebooks"]["v"]
    assert set(books) == {2, 3, 4}
    for bits, levels in books.items():
        assert lloyd_max_levels.__wrapped__(bits, True, 64) == tuple(levels), bits
