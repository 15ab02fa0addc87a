"""Triton kernels against the PyTorch references.

Without a GPU the kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by
``conftest.py`` before anything imports Triton) on CPU tensors; the grid below is sized for
that (a few tens of seconds on 2 cores). With a CUDA GPU and ``TRITON_INTERPRET`` unset the
same tests run compiled on CUDA tensors, and the ``gpu``-marked large shapes run too.

Tolerances:
* quantize: scale / zero ``torch.equal``; codes within one step, at most 0.1% differ
  (in practice they are equal: both sides divide with IEEE round-to-nearest);
* pack → unpack and dequantize: ``torch.equal``;
* fused decode attention vs softmax attention over the dequantized cache (fp32 reference):
  fp32 atol 1e-4 / rtol 1e-4, fp16 atol 1e-2 / rtol 1e-2, bf16 atol 3e-2 / rtol 2e-2.

Oracles are pure PyTorch only: quantize / dequantize against ``kernels.reference``; attention
blocks are encoded on the CPU by the reference quantizer and the reference attention reads those
CPU blocks (``attention_cases.make_cache`` / ``on_device``), the kernel reads their device copies.
The shared attention cases include Hadamard, pre-RoPE (full and half rotary) and corrected blocks
on mixed bits, 16-bit slots and padded batches, with fp32 / fp16 / bf16 queries.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import triton  # noqa: F401  (the test extra installs it: a missing Triton fails here, not skips)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("no CUDA GPU and TRITON_INTERPRET is not 1: Triton kernels cannot run", allow_module_level=True)

from kvplan.kernels import reference  # noqa: E402
from kvplan.kernels import triton_kernels as tk  # noqa: E402
from kvplan.kernels.attention_reference import reference_decode_attention  # noqa: E402
from kvplan.kernels.qtypes import channel_group_size, packed_row_bytes  # noqa: E402
from tests.kernels import attention_cases  # noqa: E402
from tests.kernels.attention_cases import ATTN_CASES, ATTN_TOL, case_cache, on_device  # noqa: E402
from kvplan.kernels.formats import SCALINGS, Format, default_codebook  # noqa: E402

if INTERPRET:
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tk._dequantize_kernel, InterpretedFunction):
        pytest.skip(
            "kvplan.kernels.triton_kernels was imported before TRITON_INTERPRET=1 was set; "
            "run the kernel tests in their own process",
            allow_module_level=True,
        )

DEVICE = torch.device("cpu" if INTERPRET else "cuda")
gpu = pytest.mark.skipif(
    INTERPRET or not torch.cuda.is_available(), reason="large shapes: needs a CUDA GPU with compiled Triton"
)

BITS = [2, 3, 4, 8]
GROUPS = [32, 64, 128]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _rand(shape, dtype, seed, scale=1.0):
    return attention_cases.rand(shape, dtype, seed, scale).to(DEVICE)


def _to(t):
    return None if t is None else t.to(DEVICE)


def _check_quantize(x, bits, group_size, axis, start_offset=0):
    D = x.shape[-1]
    packed, scale, zero = tk.quantize(x, bits, group_size, axis, start_offset)
    r_packed, r_scale, r_zero = reference.quantize(x, bits, group_size, axis, start_offset)
    assert packed.dtype == torch.uint8 and packed.shape == r_packed.shape
    assert packed.shape[-1] == packed_row_bytes(D, bits)
    assert scale.dtype == torch.float16 and zero.dtype == torch.float16
    assert scale.shape == r_scale.shape and zero.shape == r_zero.shape
    assert torch.equal(scale, r_scale), "scales differ"
    assert torch.equal(zero, r_zero), "zero-points differ"
    codes = reference.unpack_codes(packed, bits, D).int()
    r_codes = reference.unpack_codes(r_packed, bits, D).int()
    if codes.numel():
        assert (codes - r_codes).abs().max().item() <= 1
        assert (codes != r_codes).float().mean().item() <= 1e-3
    # Padding bits of a partial 3-bit unit, if any, must be zero like the reference's.
    if torch.equal(codes, r_codes):
        assert torch.equal(packed, r_packed)
    return packed, scale, zero


# ----------------------------------------------------------------------------- quantize
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("group_size", GROUPS, ids=[f"g{g}" for g in GROUPS])
@pytest.mark.parametrize("bits", BITS, ids=[f"int{b}" for b in BITS])
def test_quantize_grid(bits, group_size, axis, dtype):
    """All bits × group sizes × axes × dtypes; odd T, channel groups with a nonzero offset."""
    x = _rand((1, 2, 37, 64), dtype, seed=bits * 1000 + group_size)
    offset = 0 if axis == "token" else (group_size // 2 + 3)
    _check_quantize(x, bits, group_size, axis, offset)


SHAPES = {
    "T5-D64-H1": (1, 1, 5, 64),  # shorter than any group
    "T37-D128-H3-B2": (2, 3, 37, 128),
    "T1-D128-H8": (1, 8, 1, 128),
    "T150-D64-H2": (1, 2, 150, 64),
}


AXIS_OFFSETS = [("token", 0), ("channel", 0), ("channel", 1), ("channel", 29)]


@pytest.mark.parametrize(("axis", "offset"), AXIS_OFFSETS, ids=[f"{a}-off{o}" for a, o in AXIS_OFFSETS])
@pytest.mark.parametrize("bits", [3, 4], ids=["int3", "int4"])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_quantize_shapes(shape, bits, axis, offset):
    _check_quantize(_rand(shape, torch.float16, seed=sum(shape) + offset), bits, 32, axis, offset)


@pytest.mark.parametrize(("D", "group_size"), [(80, 32), (96, 64), (112, 32), (48, 32)])
@pytest.mark.parametrize("bits", [2, 3, 8], ids=["int2", "int3", "int8"])
def test_token_groups_that_are_not_a_power_of_two(D, group_size, bits):
    """Per-token groups of 20, 48, 28 or 24 channels (head_dim 80 / 96 / 112 / 48): Triton's quantize and
    dequantize refused them, so a CUDA model of such a head_dim could not store values, sinks or the coded
    residual under the default plans; the reference, accounting and attention kernels take them."""
    x = _rand((2, 3, 19, D), torch.float16, seed=D + bits)
    x[0, 1, 4] = 0.5  # one token whose groups are constant
    packed, scale, zero = _check_quantize(x, bits, group_size, "token")
    assert scale.shape == (2, 3, 19, D // channel_group_size(group_size, D))
    ref = reference.dequantize(packed, scale, zero, bits, group_size, "token", D, 0, torch.float32)
    assert torch.equal(tk.dequantize(packed, scale, zero, bits, group_size, "token", D, 0, torch.float32), ref)


def test_quantize_t_shorter_than_group_spanning_two_groups():
    # 5 tokens starting at position 126 of a 128-group: groups [126,128) and [128,131).
    x = _rand((1, 2, 5, 64), torch.float32, seed=7)
    _, scale, _ = _check_quantize(x, 2, 128, "channel", 126)
    assert scale.shape == (1, 2, 2, 64)


@pytest.mark.parametrize("axis", ["token", "channel"])
def test_quantize_constant_groups(axis):
    x = torch.full((1, 2, 40, 64), 0.375, dtype=torch.float16, device=DEVICE)
    x[0, 1, :, 32:] = -2.5
    packed, scale, zero = _check_quantize(x, 4, 32, axis, 3 if axis == "channel" else 0)
    assert torch.count_nonzero(scale) == 0 and torch.count_nonzero(packed) == 0


def test_quantize_half_steps_round_to_even():
    # Group min 0, max 3 at 2 bits: scale 1, so x = 0.5, 1.5, 2.5 sit exactly on half steps.
    row = torch.tensor([0.0, 3.0, 0.5, 1.5, 2.5, 1.0, 2.0, 0.49] * 4, dtype=torch.float32)
    x = row.reshape(1, 1, 1, 32).to(DEVICE)
    packed, _, _ = tk.quantize(x, 2, 32, "token")
    codes = reference.unpack_codes(packed, 2, 32)[0, 0, 0, :8].tolist()
    assert codes == [0, 3, 0, 2, 2, 1, 2, 0]
    _check_quantize(x, 2, 32, "token")


def test_quantize_fp16_range_error():
    x = _rand((1, 1, 8, 64), torch.float32, seed=3)
    x[0, 0, 2, 5] = 70000.0
    with pytest.raises(ValueError, match="fp16 range"):
        reference.quantize(x, 4, 32, "token")
    with pytest.raises(ValueError, match="fp16 range"):
        tk.quantize(x, 4, 32, "token")
    with pytest.raises(ValueError, match="fp16 range"):
        tk.quantize(x, 4, 32, "channel")


def test_quantize_bad_arguments():
    x = _rand((1, 1, 8, 64), torch.float16, seed=4)
    with pytest.raises(ValueError):
        tk.quantize(x, 5, 32, "token")
    with pytest.raises(ValueError):
        tk.quantize(x, 4, 32, "diagonal")
    with pytest.raises(ValueError):
        tk.quantize(x, 4, 32, "channel", 32)


# ----------------------------------------------------------------------------- pack / unpack
@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("bits", BITS, ids=[f"int{b}" for b in BITS])
def test_pack_unpack_exact(bits, axis):
    """Known codes survive Triton pack (quantize) → reference unpack and reference pack → Triton unpack."""
    qmax = (1 << bits) - 1
    g = torch.Generator().manual_seed(bits)
    T, D = 64, 64
    codes = torch.randint(0, qmax + 1, (1, 2, T, D), generator=g)
    # Make every group contain 0 and qmax, so scale == 1 and zero == 0 exactly.
    if axis == "token":
        codes[..., 0::32] = 0
        codes[..., 1::32] = qmax
    else:
        codes[:, :, 0::32, :] = 0
        codes[:, :, 1::32, :] = qmax
    codes = codes.to(torch.uint8)
    x = codes.float().to(DEVICE)
    packed, scale, zero = tk.quantize(x, bits, 32, axis)
    assert torch.all(scale == 1) and torch.all(zero == 0)
    r_packed = reference.pack_codes(codes, bits)
    assert torch.equal(packed.cpu(), r_packed)
    assert torch.equal(reference.unpack_codes(packed.cpu(), bits, D), codes)
    # Triton unpack path: dequantize with scale 1, zero 0 returns the codes.
    out = tk.dequantize(r_packed.to(DEVICE), scale, zero, bits, 32, axis, D, 0, torch.float32)
    assert torch.equal(out.cpu(), codes.float())


# ----------------------------------------------------------------------------- dequantize
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("group_size", [32, 128], ids=["g32", "g128"])
@pytest.mark.parametrize("bits", BITS, ids=[f"int{b}" for b in BITS])
def test_dequantize_matches_reference(bits, group_size, axis, dtype):
    shape = (1, 3, 37, 128) if group_size == 128 else (2, 1, 37, 64)
    x = _rand(shape, dtype, seed=bits + group_size)
    offset = 0 if axis == "token" else 5
    packed, scale, zero = reference.quantize(x, bits, group_size, axis, offset)
    ref = reference.dequantize(packed, scale, zero, bits, group_size, axis, shape[-1], offset, dtype)
    out = tk.dequantize(packed, scale, zero, bits, group_size, axis, shape[-1], offset, dtype)
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.equal(out, ref)


FORMATS = [Format(b, sc, lv) for b in (2, 3) for sc in SCALINGS for lv in (None, default_codebook(b, sc, 32))
           if (sc, lv) != ("minmax-fp16", None)] + [Format(8, "absmax-e4m3"), Format(4, "minmax-e4m3")]


@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
def test_dequantize_formats_match_reference(fmt, axis):
    """The registry's formats (e4m3 scales read from their bytes, no zero-point, codebook levels)
    decode exactly as the PyTorch reference decodes them."""
    shape = (2, 3, 37, 64)
    x = _rand(shape, torch.float32, seed=fmt.bits)
    offset = 0 if axis == "token" else 5
    packed, scale, zero = reference.quantize(x.cpu(), fmt.bits, 32, axis, offset, fmt=fmt)
    ref = reference.dequantize(packed, scale, zero, fmt.bits, 32, axis, 64, offset, torch.float32, fmt=fmt)
    for dtype in (torch.float32, torch.float16):
        out = tk.dequantize(_to(packed), _to(scale), _to(zero), fmt.bits, 32, axis, 64, offset, dtype, fmt=fmt)
        assert torch.equal(out.cpu(), ref.to(dtype))


# ----------------------------------------------------------------------------- fused attention
@pytest.mark.parametrize("case", list(ATTN_CASES.values()), ids=list(ATTN_CASES))
def test_packed_decode_attention(case):
    """The fused kernel on device copies of reference-encoded blocks against the reference
    attention over the CPU blocks (no Triton op on the oracle's side)."""
    q, kb, vb, kr, vr, mask = case_cache(case, B=2, seed=case[4] + case[2])
    dtype, tol = q.dtype, ATTN_TOL[q.dtype]
    dev = (_to(q), on_device(kb, DEVICE), on_device(vb, DEVICE), _to(kr), _to(vr), _to(mask))
    ref = reference_decode_attention(q, kb, vb, kr, vr, mask)
    # Small splits / steps so that one segment spans several programs and inner iterations.
    out = tk.packed_decode_attention(*dev, split_len=16, block_n=16)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float().cpu(), ref.float(), atol=tol[0], rtol=tol[1])
    # Default split heuristic and explicit sm_scale.
    out2 = tk.packed_decode_attention(*dev, sm_scale=0.1)
    ref2 = reference_decode_attention(q, kb, vb, kr, vr, mask, sm_scale=0.1)
    torch.testing.assert_close(out2.float().cpu(), ref2.float(), atol=tol[0], rtol=tol[1])


def test_packed_decode_attention_rejects_bad_heads():
    kb, vb, kr, vr, _ = attention_cases.make_cache(1, 2, 64, torch.float32,
                                                   [(8, [((0,), 4, "token")], [((0,), 4, "token")])], 2, 0)
    q = _rand((1, 2, 1, 64), torch.float32, seed=1)
    with pytest.raises(ValueError):
        tk.packed_decode_attention(q, on_device(kb, DEVICE), on_device(vb, DEVICE), _to(kr), _to(vr))


# ----------------------------------------------------------------------------- error-feedback codes
FEEDBACK_CASES = [  # (format, bits, axis, head_dim): v1 min-max, codebook + absmax-e4m3, fp8 min-max, 8-bit
    pytest.param(None, 2, "channel", 64, id="v1-int2-channel"),
    pytest.param(Format(2, "absmax-e4m3", default_codebook(2, "absmax-e4m3", 64)), 2, "token", 64, id="lloyd2-absmax"),
    pytest.param(Format(4, "minmax-e4m3"), 4, "channel", 64, id="int4-minmax-e4m3"),
    pytest.param(None, 8, "token", 64, id="v1-int8-token"),
    pytest.param(None, 3, "token", 96, id="v1-int3-token-D96"),  # head_dim not a power of two
]


def _feedback_inputs(fmt, bits, axis, D, T):
    """Values with zero-scale groups (a constant channel, an all-zero token), their per-value scales,
    zero-points and levels, and the factors of a skewed metric (as ``tests/kernels/test_feedback.py``)."""
    from kvplan.kernels.feedback import feedback_factors, loop_inputs
    from tests.kernels.test_feedback import _skewed_metric

    x = torch.randn(1, 3, T, D, generator=torch.Generator().manual_seed(D + bits)) * 3
    x[:, 1, :, 5] = 0.7
    x[:, 2, 7, :] = 0.0
    offset = 5 if axis == "channel" else 0
    scale, zero = reference.group_scales(x, bits, 32, axis, offset, fmt)
    s, z, levels, mids = loop_inputs(scale, zero, bits, 32, axis, offset, x.shape, fmt)
    factor, order = feedback_factors(_skewed_metric(3, D, 5))
    return x, s, z, order, levels, mids, factor


@pytest.mark.parametrize("fmt,bits,axis,D", FEEDBACK_CASES)
def test_feedback_codes_match_the_torch_loop(fmt, bits, axis, D):
    """The Triton coding loop picks the PyTorch loop's codes bit for bit (zero-scale groups included),
    so a plan's values are stored alike on CUDA and on the CPU."""
    from kvplan.kernels.feedback import torch_feedback_codes

    args = _feedback_inputs(fmt, bits, axis, D, T=20)
    want = torch_feedback_codes(*args)
    got = tk.feedback_codes(*(_to(a) for a in args))
    assert got.dtype == torch.uint8 and got.shape == want.shape
    assert torch.equal(got.cpu(), want)
    nearest = torch_feedback_codes(*args[:6], torch.eye(D).expand(3, D, D).contiguous())  # nothing pushed onward
    assert not torch.equal(want, nearest)  # the case exercises the feedback, not just the rounding


def test_import_kvplan_does_not_import_triton_kernels():
    # (Recent torch imports triton itself, so check for our kernel module, not for triton.)
    code = (
        "import sys, kvplan, kvplan.kernels, kvplan.runtime.storage, kvplan.kernels.attention_reference;"
        "assert 'kvplan.kernels.triton_kernels' not in sys.modules, 'triton_kernels imported'"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# ----------------------------------------------------------------------------- large shapes (GPU)
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("bits", BITS, ids=[f"int{b}" for b in BITS])
def test_quantize_large_gpu(bits, axis):
    x = _rand((4, 8, 4099, 128), torch.float16, seed=bits)
    packed, scale, zero = _check_quantize(x, bits, 128, axis, 0 if axis == "token" else 77)
    ref = reference.dequantize(packed, scale, zero, bits, 128, axis, 128, 0 if axis == "token" else 77)
    out = tk.dequantize(packed, scale, zero, bits, 128, axis, 128, 0 if axis == "token" else 77)
    assert torch.equal(out, ref)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["", "H+rope+corr"], ids=["plain", "searched-codec"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_packed_decode_attention_large_gpu(dtype, codec):
    Hkv, D, B = 4, 128, 4
    segments = [
        (8192, [((0, 1), 4, "channel"), ((2, 3), 2, "channel")], [((0, 1, 2, 3), 4, "token")]),
        (4096, [((0, 1, 2, 3), 4, "channel")], [((0, 2), 2, "token"), ((1, 3), 8, "token")]),
    ]
    kb, vb, kr, vr, T_total = attention_cases.make_cache(B, Hkv, D, dtype, segments, 100, seed=5, codec=codec)
    q = attention_cases.rand((B, 28, 1, D), dtype, seed=6, scale=0.5)
    mask = attention_cases.mask("pad-bool", B, 28, 1, T_total)
    ref = reference_decode_attention(q, kb, vb, kr, vr, mask)
    out = tk.packed_decode_attention(_to(q), on_device(kb, DEVICE), on_device(vb, DEVICE), _to(kr), _to(vr), _to(mask))
    torch.testing.assert_close(out.float().cpu(), ref.float(), atol=ATTN_TOL[dtype][0], rtol=ATTN_TOL[dtype][1])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fmt,bits,axis,D", FEEDBACK_CASES)
def test_quantize_with_feedback_large_gpu(fmt, bits, axis, D):
    """The cache's encoder on CUDA (Triton scales for v1, the Triton coding loop) stores what the
    CPU encoder stores: same scales / zero-points, codes bit for bit."""
    from kvplan.kernels.feedback import quantize_with_feedback

    x, _, _, order, _, _, factor = _feedback_inputs(fmt, bits, axis, D, T=700)
    cpu = quantize_with_feedback(x, bits, 32, axis, 5 if axis == "channel" else 0, factor, order, fmt=fmt)
    dev = quantize_with_feedback(_to(x), bits, 32, axis, 5 if axis == "channel" else 0, _to(factor), _to(order),
                                 fmt=fmt)
    for a, b in zip(dev, cpu):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a.cpu(), b)
