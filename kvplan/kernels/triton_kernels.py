"""Triton kernels: quantize / dequantize in the reference layout, and fused decode attention.

Every op here has the same signature and output as its PyTorch reference
(:mod:`kvplan.kernels.reference` for quantize / dequantize,
:mod:`kvplan.kernels.attention_reference` for decode attention); see ``reference.py``
for the exact byte layout. This module imports Triton at import time, so it is only
imported lazily by the dispatcher (``kvplan.kernels.triton_available``), never by
``import kvplan``.

On a machine without a GPU the kernels run (slowly) under Triton's interpreter with
``TRITON_INTERPRET=1`` set before Triton is imported, on CPU tensors; that is how the
tests check them against the references.

Shared packing scheme (all bit widths, one code path): a row of ``D`` codes is a little-endian
bit stream, code ``j`` at bit ``j * bits``. It is handled as ``U`` pack units of
``CPU`` codes (``codes_per_unit``) in ``UB`` bytes (``unit_bytes``): a unit is a ≤24-bit
integer ``word = sum_j code_j << (j * bits)`` whose bytes are ``(word >> 8k) & 0xFF``.
In registers a unit's bytes are held in a power-of-two lane ``UBP`` (1, or 4 for the
3-bit three-byte unit, the 4th lane masked off).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .formats import ScaleRangeError
from .qtypes import FULL_PRECISION_BITS, STREAMED, channel_group_size, packed_row_bytes, qtype

__all__ = [
    "block_partial_attention",
    "dequantize",
    "feedback_codes",
    "packed_decode_attention",
    "quantize",
]

_FP16_MAX = tl.constexpr(65504.0)
_LOG2E = 1.4426950408889634


# ============================================================================ device helpers
@triton.jit
def _rint(v):
    """Round half to even, like ``torch.round`` (exact for |v| < 2**23; codes are clamped before)."""
    f = tl.floor(v)
    diff = v - f  # exact in fp32
    f_is_odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (diff > 0.5) | ((diff == 0.5) & f_is_odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def _to_bf16_rne(x):
    """fp32 → bf16, round to nearest even, by bit arithmetic.

    Equivalent to ``x.to(tl.bfloat16)`` on GPU; Triton's CPU interpreter truncates instead,
    so this keeps the interpreter bitwise equal to ``torch`` too (NaN payloads aside).
    """
    u = x.to(tl.uint32, bitcast=True)
    u = u + 0x7FFF + ((u >> 16) & 1)
    return (u >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _pack_store(
    row_ptrs,  # [R] uint8 pointers: start of each row's packed bytes
    codes,  # [R, BLOCK_C] int32 codes in [0, 2**BITS)
    u0,  # first pack unit of this tile inside the row
    n_units,  # pack units per row (ceil(D / CPU))
    row_ok,  # [R] bool
    BITS: tl.constexpr,
    CPU: tl.constexpr,
    UB: tl.constexpr,
    UBP: tl.constexpr,
    R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Pack ``codes [R, BLOCK_C]`` and store ``U = BLOCK_C // CPU`` units of ``UB`` bytes per row."""
    U: tl.constexpr = BLOCK_C // CPU
    c3 = tl.reshape(codes, (R, U, CPU))
    shifts = tl.arange(0, CPU) * BITS
    word = tl.sum(c3 << shifts[None, None, :], axis=2)  # [R, U], bit fields do not overlap
    k = tl.arange(0, UBP)
    byts = (word[:, :, None] >> (k * 8)[None, None, :]) & 0xFF  # [R, U, UBP]
    u = u0 + tl.arange(0, U)
    offs = u[None, :, None] * UB + k[None, None, :]
    mask = row_ok[:, None, None] & (u < n_units)[None, :, None] & (k < UB)[None, None, :]
    tl.store(row_ptrs[:, None, None] + offs, byts.to(tl.uint8), mask=mask)


@triton.jit
def _unpack_load(
    row_ptrs,  # [R] uint8 pointers
    u0,
    n_units,
    row_ok,  # [R] bool
    BITS: tl.constexpr,
    CPU: tl.constexpr,
    UB: tl.constexpr,
    UBP: tl.constexpr,
    R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Load ``U = BLOCK_C // CPU`` pack units per row and unpack them to int32 codes ``[R, BLOCK_C]``."""
    U: tl.constexpr = BLOCK_C // CPU
    QMAX: tl.constexpr = (1 << BITS) - 1
    u = u0 + tl.arange(0, U)
    k = tl.arange(0, UBP)
    mask = row_ok[:, None, None] & (u < n_units)[None, :, None] & (k < UB)[None, None, :]
    byts = tl.load(row_ptrs[:, None, None] + (u[None, :, None] * UB + k[None, None, :]), mask=mask, other=0)
    word = tl.sum(byts.to(tl.int32) << (k * 8)[None, None, :], axis=2)  # [R, U]
    shifts = tl.arange(0, CPU) * BITS
    codes = (word[:, :, None] >> shifts[None, None, :]) & QMAX  # [R, U, CPU]
    return tl.reshape(codes, (R, BLOCK_C))


@triton.jit
def _scale_zero(mn, mx, QMAX: tl.constexpr):
    """fp16 scale / zero from fp32 group min / max, rounded exactly like the reference."""
    scale16 = tl.math.div_rn(mx - mn, QMAX * 1.0).to(tl.float16)
    zero16 = mn.to(tl.float16)
    return scale16, zero16


@triton.jit
def _encode(x, s, z, QMAX: tl.constexpr):
    """int32 codes ``clamp(round((x - z) / s))`` in fp32; ``s == 0`` gives code 0."""
    safe = tl.where(s > 0, s, 1.0)
    v = tl.math.div_rn(x - z, safe)
    v = tl.minimum(tl.maximum(v, -1.0), QMAX + 1.0)  # same result after the clamp below; keeps _rint exact
    q = _rint(v)
    q = tl.where(s > 0, q, 0.0)
    q = tl.minimum(tl.maximum(q, 0.0), QMAX * 1.0)
    return q.to(tl.int32)


# ============================================================================ quantize kernels
@triton.jit
def _token_tile(X, T, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's ``[BLOCK_T, BLOCK_D]`` tile of ``X [B, h, T, D]`` in fp32 (grid ``(cdiv(T, BLOCK_T),
    B * h)``), with its head-row ``bh``, token indices ``t`` (and ``t < T``), channels ``d`` and mask."""
    bh = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    t_ok = t < T
    m2 = t_ok[:, None] & (d < D)[None, :]
    x = tl.load(X + bh * T * D + t[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
    return bh, t, t_ok, d, m2, x


@triton.jit
def _quantize_token_kernel(
    X,  # [B, h, T, D] contiguous, fp16 / bf16 / fp32
    P,  # uint8 [B, h, T, RB] contiguous, RB = packed_row_bytes(D, BITS)
    S,  # fp16 [B, h, T, NG] contiguous, NG = D // G
    Z,  # fp16 [B, h, T, NG]
    FLAG,  # int32 [1]: set to 1 when a group leaves the fp16 range
    T,
    D: tl.constexpr,
    RB: tl.constexpr,
    NG: tl.constexpr,
    G_BLOCK: tl.constexpr,  # group length in registers: G (power of two) or BLOCK_D when G == D
    BITS: tl.constexpr,
    CPU: tl.constexpr,
    UB: tl.constexpr,
    UBP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Per-token groups (``axis="token"``): groups of ``G = min(group_size, D)`` channels.

    Layout: ``x [B, h, T, D]`` → codes ``uint8 [B, h, T, RB]``, scale / zero ``fp16 [B, h, T, D // G]``.
    Grid: ``(cdiv(T, BLOCK_T), B * h)``; program ``(i, bh)`` quantizes tokens
    ``[i * BLOCK_T, (i + 1) * BLOCK_T)`` of head-row ``bh``, a ``[BLOCK_T, BLOCK_D]`` tile
    viewed as ``[BLOCK_T, BLOCK_D // G_BLOCK, G_BLOCK]`` for the group reductions.
    """
    QMAX: tl.constexpr = (1 << BITS) - 1
    NGB: tl.constexpr = BLOCK_D // G_BLOCK
    bh, t, t_ok, d, m2, x = _token_tile(X, T, D, BLOCK_T, BLOCK_D)

    x3 = tl.reshape(x, (BLOCK_T, NGB, G_BLOCK))
    m3 = tl.reshape(m2, (BLOCK_T, NGB, G_BLOCK))
    mn = tl.min(tl.where(m3, x3, float("inf")), axis=2)  # [BLOCK_T, NGB]
    mx = tl.max(tl.where(m3, x3, float("-inf")), axis=2)
    gi = tl.arange(0, NGB)
    g_ok = t_ok[:, None] & (gi < NG)[None, :]
    over = g_ok & ((mn < -_FP16_MAX) | (mx > _FP16_MAX))
    tl.atomic_max(FLAG, tl.max(tl.max(over.to(tl.int32), axis=1), axis=0))

    s16, z16 = _scale_zero(mn, mx, QMAX)
    so = bh * T * NG + t[:, None] * NG + gi[None, :]
    tl.store(S + so, s16, mask=g_ok)
    tl.store(Z + so, z16, mask=g_ok)

    codes = _encode(x3, s16.to(tl.float32)[:, :, None], z16.to(tl.float32)[:, :, None], QMAX)
    codes = tl.reshape(codes, (BLOCK_T, BLOCK_D))
    row_ptrs = P + bh * T * RB + t.to(tl.int64) * RB
    _pack_store(row_ptrs, codes, 0, (D + CPU - 1) // CPU, t_ok, BITS, CPU, UB, UBP, BLOCK_T, BLOCK_D)


@triton.jit
def _quantize_token_any_group_kernel(
    X,  # [B, h, T, D] contiguous, fp16 / bf16 / fp32
    P,  # uint8 [B, h, T, RB]
    S,  # fp16 [B, h, T, NG], NG = D // G
    Z,  # fp16 [B, h, T, NG]
    FLAG,  # int32 [1]
    T,
    D: tl.constexpr,
    RB: tl.constexpr,
    NG: tl.constexpr,
    G: tl.constexpr,  # channels per group, any divisor of D (20 at head_dim 80 and group 32)
    BITS: tl.constexpr,
    CPU: tl.constexpr,
    UB: tl.constexpr,
    UBP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """:func:`_quantize_token_kernel` for a group length that is not a power of two (a tile cannot be
    viewed as ``[BLOCK_T, groups, G]``): each of the ``NG`` groups is reduced over the ``[BLOCK_T, BLOCK_D]``
    tile under its channel mask, and its scale / zero spread back to its channels. Same values."""
    QMAX: tl.constexpr = (1 << BITS) - 1
    bh, t, t_ok, d, m2, x = _token_tile(X, T, D, BLOCK_T, BLOCK_D)
    s_full = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    z_full = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    over = tl.zeros((BLOCK_T,), dtype=tl.int32)
    for j in tl.static_range(NG):
        in_group = (d >= j * G) & (d < (j + 1) * G)  # [BLOCK_D]
        mj = m2 & in_group[None, :]
        mn = tl.min(tl.where(mj, x, float("inf")), axis=1)  # [BLOCK_T]
        mx = tl.max(tl.where(mj, x, float("-inf")), axis=1)
        over = tl.maximum(over, (t_ok & ((mn < -_FP16_MAX) | (mx > _FP16_MAX))).to(tl.int32))
        s16, z16 = _scale_zero(mn, mx, QMAX)
        so = bh * T * NG + t * NG + j
        tl.store(S + so, s16, mask=t_ok)
        tl.store(Z + so, z16, mask=t_ok)
        s_full = tl.where(in_group[None, :], s16.to(tl.float32)[:, None], s_full)
        z_full = tl.where(in_group[None, :], z16.to(tl.float32)[:, None], z_full)
    tl.atomic_max(FLAG, tl.max(over, axis=0))
    codes = _encode(x, s_full, z_full, QMAX)
    row_ptrs = P + bh * T * RB + t.to(tl.int64) * RB
    _pack_store(row_ptrs, codes, 0, (D + CPU - 1) // CPU, t_ok, BITS, CPU, UB, UBP, BLOCK_T, BLOCK_D)


@triton.jit
def _quantize_channel_kernel(
    X,  # [B, h, T, D] contiguous
    P,  # uint8 [B, h, T, RB]
    S,  # fp16 [B, h, NGT, D], NGT = ceil((start_offset + T) / GS)
    Z,  # fp16 [B, h, NGT, D]
    FLAG,  # int32 [1]
    T,
    NGT,
    OFF,  # start_offset: position of token 0 inside its group
    D: tl.constexpr,
    RB: tl.constexpr,
    GS: tl.constexpr,
    BITS: tl.constexpr,
    CPU: tl.constexpr,
    UB: tl.constexpr,
    UBP: tl.constexpr,
    BLOCK_DC: tl.constexpr,
):
    """Per-channel groups along T (``axis="channel"``, KIVI keys), aligned to absolute positions.

    Layout: ``x [B, h, T, D]`` → codes ``uint8 [B, h, T, RB]``, scale / zero ``fp16 [B, h, NGT, D]``;
    group ``n`` holds tokens ``[n * GS - OFF, (n + 1) * GS - OFF) ∩ [0, T)``.
    Grid: ``(NGT, cdiv(D, BLOCK_DC), B * h)``; program ``(n, c, bh)`` reduces a
    ``[GS, BLOCK_DC]`` tile (channels ``[c * BLOCK_DC, (c + 1) * BLOCK_DC)``) over tokens and packs
    its ``BLOCK_DC // CPU`` pack units of every row (``BLOCK_DC`` is a multiple of ``CPU``).
    """
    QMAX: tl.constexpr = (1 << BITS) - 1
    n = tl.program_id(0)
    pid_c = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    t = n * GS - OFF + tl.arange(0, GS)
    d = pid_c * BLOCK_DC + tl.arange(0, BLOCK_DC)
    t_ok = (t >= 0) & (t < T)
    d_ok = d < D
    m2 = t_ok[:, None] & d_ok[None, :]
    x = tl.load(X + bh * T * D + t[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
    mn = tl.min(tl.where(m2, x, float("inf")), axis=0)  # [BLOCK_DC]
    mx = tl.max(tl.where(m2, x, float("-inf")), axis=0)
    over = d_ok & ((mn < -_FP16_MAX) | (mx > _FP16_MAX))
    tl.atomic_max(FLAG, tl.max(over.to(tl.int32), axis=0))

    s16, z16 = _scale_zero(mn, mx, QMAX)
    so = bh * NGT * D + n * D + d
    tl.store(S + so, s16, mask=d_ok)
    tl.store(Z + so, z16, mask=d_ok)

    codes = _encode(x, s16.to(tl.float32)[None, :], z16.to(tl.float32)[None, :], QMAX)
    row_ptrs = P + bh * T * RB + t.to(tl.int64) * RB
    u0 = pid_c * (BLOCK_DC // CPU)
    _pack_store(row_ptrs, codes, u0, (D + CPU - 1) // CPU, t_ok, BITS, CPU, UB, UBP, GS, BLOCK_DC)


# ============================================================================ dequantize kernel
@triton.jit
def _e4m3_to_f32(b):
    """fp32 value of non-negative float8 e4m3fn bytes (int32): ``(8 + m) 2^(e - 10)``, subnormals
    ``m 2^-9`` (scales are never negative or NaN: the encoder refuses them)."""
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    return tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.math.exp2((e - 10).to(tl.float32)))


@triton.jit
def _load_dequant_tile(
    C,  # codes of one head: uint8 [T, RB] rows (stride sc_t), or the fp tensor [T, D] when BITS == 16
    S,  # scales of the head: [T, NG] (token axis) or [NGT, D] (channel axis), row stride ss_g; fp16, or
    #     the bytes of float8 e4m3fn scales (uint8) when E4M3
    Z,  # zero-points, laid out like S (fp16); unused when not ZERO (symmetric formats)
    LV,  # fp32 level units L [2**BITS] of a codebook (decode: zero + scale * L[code]); unused when not LEVELS
    sc_t,
    ss_g,
    t,  # [R] token indices inside the block
    t_ok,  # [R] bool
    OFF,  # channel axis: start_offset
    D: tl.constexpr,
    BITS: tl.constexpr,
    CHANNEL: tl.constexpr,
    GS: tl.constexpr,  # channel axis: tokens per group
    G: tl.constexpr,  # token axis: channels per group
    R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ZERO: tl.constexpr = True,
    E4M3: tl.constexpr = False,
    LEVELS: tl.constexpr = False,
):
    """Dequantized fp32 tile ``[R, BLOCK_D]`` (zeros outside ``t_ok`` / ``d < D``): ``code * scale +
    zero`` in the v1 format, ``zero + scale * L[code]`` for the formats of
    :mod:`kvplan.kernels.formats` (``ZERO`` false: no zero-point; ``E4M3``: fp8 scales;
    ``LEVELS``: a codebook, or the uniform symmetric levels, gathered from ``LV``)."""
    d = tl.arange(0, BLOCK_D)
    m2 = t_ok[:, None] & (d < D)[None, :]
    if BITS == 16:
        x = tl.load(C + t[:, None].to(tl.int64) * sc_t + d[None, :], mask=m2, other=0.0).to(tl.float32)
    else:
        CPU: tl.constexpr = 8 if BITS == 3 else 8 // BITS
        UB: tl.constexpr = 3 if BITS == 3 else 1
        UBP: tl.constexpr = 4 if BITS == 3 else 1
        codes = _unpack_load(C + t.to(tl.int64) * sc_t, 0, (D + CPU - 1) // CPU, t_ok, BITS, CPU, UB, UBP, R, BLOCK_D)
        if CHANNEL:
            so = ((t + OFF) // GS)[:, None].to(tl.int64) * ss_g + d[None, :]
        else:
            so = t[:, None].to(tl.int64) * ss_g + (d // G)[None, :]
        if E4M3:
            s = _e4m3_to_f32(tl.load(S + so, mask=m2, other=0).to(tl.int32))
        else:
            s = tl.load(S + so, mask=m2, other=0.0).to(tl.float32)
        if LEVELS:
            lv = tl.load(LV + codes, mask=m2, other=0.0)
        else:
            lv = codes.to(tl.float32)
        if ZERO:
            z = tl.load(Z + so, mask=m2, other=0.0).to(tl.float32)
            x = tl.where(m2, lv * s + z, 0.0)
        else:
            x = tl.where(m2, lv * s, 0.0)
    return x


@triton.jit
def _dequantize_kernel(
    P,  # uint8 [B, h, T, RB] contiguous
    S,  # fp16 (or e4m3 bytes) [B, h, T, NG] (token) or [B, h, NGT, D] (channel), contiguous
    Z,
    LV,  # fp32 [2**BITS] level units (LEVELS)
    OUT,  # [B, h, T, D] contiguous, output dtype
    T,
    NS_ROWS,  # rows of S per head (T or NGT)
    OFF,
    D: tl.constexpr,
    RB: tl.constexpr,
    NS_COLS: tl.constexpr,  # NG or D
    BITS: tl.constexpr,
    CHANNEL: tl.constexpr,
    GS: tl.constexpr,
    G: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ZERO: tl.constexpr,
    E4M3: tl.constexpr,
    LEVELS: tl.constexpr,
):
    """``code * scale + zero`` (or ``zero + scale * L[code]``, see :func:`_load_dequant_tile`) in
    fp32, stored in ``OUT``'s dtype (round to nearest even).

    Layout: codes ``uint8 [B, h, T, RB]`` → ``[B, h, T, D]``. Grid: ``(cdiv(T, BLOCK_T), B * h)``;
    program ``(i, bh)`` writes a ``[BLOCK_T, BLOCK_D]`` tile of tokens ``[i * BLOCK_T, ...)``.
    """
    pid_t = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    x = _load_dequant_tile(
        P + bh * T * RB, S + bh * NS_ROWS * NS_COLS, Z + bh * NS_ROWS * NS_COLS, LV, RB, NS_COLS,
        t, t_ok, OFF, D, BITS, CHANNEL, GS, G, BLOCK_T, BLOCK_D, ZERO, E4M3, LEVELS,
    )
    d = tl.arange(0, BLOCK_D)
    m2 = t_ok[:, None] & (d < D)[None, :]
    if OUT_BF16:
        x = _to_bf16_rne(x)
    tl.store(OUT + bh * T * D + t[:, None].to(tl.int64) * D + d[None, :], x, mask=m2)


# ============================================================================ host wrappers
def _unit_params(bits: int) -> tuple[int, int, int]:
    qt = qtype(bits)
    ubp = 1 if qt.unit_bytes == 1 else 4
    return qt.codes_per_unit, qt.unit_bytes, ubp


def _token_group(group_size: int, D: int) -> tuple[int, int | None]:
    """(G, G_BLOCK): channels per token-axis group, and its power-of-two extent in registers (``None``:
    a group that is neither a power of two nor the whole head_dim, reduced under channel masks)."""
    g = channel_group_size(group_size, D)
    if g & (g - 1) == 0:
        return g, g
    if g == D:
        return g, triton.next_power_of_2(D)
    return g, None


def quantize(
    x: torch.Tensor, bits: int, group_size: int, axis: str, start_offset: int = 0, *, check_range: bool = True,
    range_flag: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x [B, h, T, D]`` to ``(packed uint8 codes, scale fp16, zero fp16)``.

    Same signature, layout and values as :func:`kvplan.kernels.reference.quantize`
    (scales / zeros bitwise equal, codes equal up to fp32 rounding of ``(x - z) / s``).
    ``check_range`` raises like the reference when a group leaves the fp16 range: that reads a
    device flag back, the one host synchronisation of this call. With ``range_flag`` (an int32
    ``[1]`` device tensor) the kernel raises that flag instead (to 1, never back to 0) and
    nothing is read back here: the caller checks it once for many calls (the cache does so
    once per commit); ``check_range=False`` skips the check.
    """
    qtype(bits)  # validates bits
    if x.dim() != 4:
        raise ValueError(f"expected x [B, h, T, D], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {x.dtype}")
    x = x.contiguous()
    B, h, T, D = x.shape
    cpu_, ub, ubp = _unit_params(bits)
    rb = packed_row_bytes(D, bits)
    packed = torch.empty(B, h, T, rb, dtype=torch.uint8, device=x.device)
    flag = torch.zeros(1, dtype=torch.int32, device=x.device) if range_flag is None else range_flag
    block_d = max(triton.next_power_of_2(D), 8)
    if axis == "token":
        g, g_block = _token_group(group_size, D)
        ng = D // g
        scale = torch.empty(B, h, T, ng, dtype=torch.float16, device=x.device)
        zero = torch.empty_like(scale)
        if T and B * h:
            block_t = max(1, min(triton.next_power_of_2(T), max(1, 4096 // block_d)))
            grid = (triton.cdiv(T, block_t), B * h)
            if g_block is None:  # e.g. groups of 20 at head_dim 80
                _quantize_token_any_group_kernel[grid](
                    x, packed, scale, zero, flag, T,
                    D=D, RB=rb, NG=ng, G=g, BITS=bits, CPU=cpu_, UB=ub, UBP=ubp, BLOCK_T=block_t, BLOCK_D=block_d,
                )
            else:
                _quantize_token_kernel[grid](
                    x, packed, scale, zero, flag, T,
                    D=D, RB=rb, NG=ng, G_BLOCK=min(g_block, block_d), BITS=bits, CPU=cpu_, UB=ub, UBP=ubp,
                    BLOCK_T=block_t, BLOCK_D=block_d,
                )
    elif axis == "channel":
        if not 0 <= start_offset < group_size:
            raise ValueError(f"start_offset {start_offset} outside [0, {group_size})")
        if group_size & (group_size - 1):
            raise ValueError(f"channel-axis group_size {group_size} must be a power of two")
        n_groups = -(-(start_offset + T) // group_size)
        scale = torch.empty(B, h, n_groups, D, dtype=torch.float16, device=x.device)
        zero = torch.empty_like(scale)
        if T and B * h:
            block_dc = min(block_d, max(8, 8192 // group_size))
            grid = (n_groups, triton.cdiv(D, block_dc), B * h)
            _quantize_channel_kernel[grid](
                x, packed, scale, zero, flag, T, n_groups, start_offset,
                D=D, RB=rb, GS=group_size, BITS=bits, CPU=cpu_, UB=ub, UBP=ubp, BLOCK_DC=block_dc,
            )
    else:
        raise ValueError(f"unknown quantization axis {axis!r}; expected 'token' or 'channel'")
    if range_flag is None and check_range and T and bool(flag.item()):  # host sync (see the docstring)
        xf = x.float()
        raise ScaleRangeError(
            "KV values exceed the fp16 range of the stored scales/zero-points "
            f"(min {xf.min().item():.4g}, max {xf.max().item():.4g}); cannot quantize this block"
        )
    return packed, scale, zero


def dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    group_size: int,
    axis: str,
    head_dim: int,
    start_offset: int = 0,
    dtype: torch.dtype = torch.float16,
    fmt=None,
) -> torch.Tensor:
    """Unpack and dequantize to ``[B, h, T, D]`` in ``dtype``; see :func:`kvplan.kernels.reference.dequantize`
    (``fmt``: a slot format of :mod:`kvplan.kernels.formats`; default v1)."""
    qtype(bits)
    packed = packed.contiguous()
    legacy = fmt is None or fmt.legacy
    has_zero = zero is not None
    scale, zero, levels = _format_tensors(None if legacy else fmt, scale.contiguous(),
                                          None if zero is None else zero.contiguous(), packed.device)
    B, h, T, rb = packed.shape
    D = head_dim
    if rb != packed_row_bytes(D, bits):
        raise ValueError(f"packed rows have {rb} bytes, expected {packed_row_bytes(D, bits)} for D={D}, bits={bits}")
    out = torch.empty(B, h, T, D, dtype=dtype, device=packed.device)
    if axis == "token":
        g, _ = _token_group(group_size, D)
        channel, gs, ns_rows, ns_cols = False, group_size, T, D // g
    elif axis == "channel":
        g, channel, gs, ns_rows, ns_cols = D, True, group_size, scale.shape[2], D
    else:
        raise ValueError(f"unknown quantization axis {axis!r}")
    if T == 0 or B * h == 0:
        return out
    block_d = max(triton.next_power_of_2(D), 8)
    block_t = max(1, min(triton.next_power_of_2(T), max(1, 4096 // block_d)))
    grid = (triton.cdiv(T, block_t), B * h)
    _dequantize_kernel[grid](
        packed, scale, zero, levels, out, T, ns_rows, start_offset,
        D=D, RB=rb, NS_COLS=ns_cols, BITS=bits, CHANNEL=channel, GS=gs, G=g, OUT_BF16=dtype == torch.bfloat16,
        BLOCK_T=block_t, BLOCK_D=block_d, ZERO=has_zero, E4M3=scale.dtype == torch.uint8,
        LEVELS=not legacy and fmt.level_units() is not None,
        enable_fp_fusion=False,  # keep code * scale + zero as two roundings, like the reference
    )
    return out


# ============================================================================ error-feedback codes
@triton.jit
def _feedback_codes_kernel(
    X,  # fp32 [B, h, T, D] contiguous: the values, in the channels' own order
    S,  # fp32 [B, h, T, D]: each value's scale
    Z,  # fp32 [B, h, T, D]: each value's zero-point (not read without HAS_ZERO)
    ORDER,  # int64 [h, D]: coding position k -> channel
    LEVELS,  # fp32 [2**BITS]: level units (code c reads LEVELS[c] * s (+ z))
    MIDS,  # fp32 [N_MIDS]: midpoints between consecutive levels
    FACTOR,  # fp32 [h, D, D]: upper Cholesky factor of the permuted inverse metric
    OUT,  # uint8 [B, h, T, D]: codes, in the channels' own order
    T,
    H: tl.constexpr,
    D: tl.constexpr,
    N_MIDS: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Codes chosen coordinate by coordinate with the rounding error pushed onward (the loop of
    :func:`kvplan.kernels.feedback._torch_codes`, same arithmetic in the same order).

    Grid ``(cdiv(T, BLOCK_T), B * h)``: program ``(i, bh)`` codes tokens ``[i * BLOCK_T, (i + 1) *
    BLOCK_T)`` of head-row ``bh``, holding them as a ``[BLOCK_T, BLOCK_D]`` tile whose column ``k`` is
    coding position ``k`` (channel ``ORDER[head, k]``); step ``d`` reads column ``d``, picks its level
    (the number of midpoints below ``(x - z) / s``, as ``torch.bucketize``), and subtracts
    ``FACTOR[head, d, k] * err`` from every column ``k > d``.
    """
    pid_t = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    head = bh % H
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    k = tl.arange(0, BLOCK_D)
    k_ok = k < D
    t_ok = t < T
    m2 = t_ok[:, None] & k_ok[None, :]
    ch = tl.load(ORDER + head * D + k, mask=k_ok, other=0)  # [BLOCK_D] channel of coding position k
    off = bh * T * D + t[:, None].to(tl.int64) * D + ch[None, :]
    x = tl.load(X + off, mask=m2, other=0.0)  # [BLOCK_T, BLOCK_D], columns in coding order
    s = tl.load(S + off, mask=m2, other=0.0)
    if HAS_ZERO:
        z = tl.load(Z + off, mask=m2, other=0.0)
    mi = tl.arange(0, BLOCK_M)
    mids = tl.load(MIDS + mi, mask=mi < N_MIDS, other=float("inf"))  # [BLOCK_M], padding never below
    codes = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.int32)
    fbase = FACTOR + head * D * D
    for d in range(D):
        col = (k == d)[None, :]  # [1, BLOCK_D]
        xd = tl.sum(tl.where(col, x, 0.0), axis=1)  # [BLOCK_T]: exactly column d
        sd = tl.sum(tl.where(col, s, 0.0), axis=1)
        safe = tl.where(sd > 0, sd, 1.0)
        if HAS_ZERO:
            zd = tl.sum(tl.where(col, z, 0.0), axis=1)
            u = xd - zd
        else:
            u = xd
        v = tl.math.div_rn(u, safe)
        c = tl.sum((mids[None, :] < v[:, None]).to(tl.int32), axis=1)  # [BLOCK_T]
        codes = tl.where(col, c[:, None], codes)
        lev = tl.load(LEVELS + c)
        if HAS_ZERO:
            read = lev * sd + zd
        else:
            read = lev * sd
        diag = tl.load(fbase + d * D + d)
        err = tl.math.div_rn(xd - read, diag)  # [BLOCK_T]
        push = tl.load(fbase + d * D + k, mask=k_ok & (k > d), other=0.0)  # [BLOCK_D]
        x = tl.where((k > d)[None, :], x - push[None, :] * err[:, None], x)
    codes = tl.where(s > 0, codes, 0)
    tl.store(OUT + off, codes.to(tl.uint8), mask=m2)


def feedback_codes(x: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, order: torch.Tensor,
                   levels: torch.Tensor, mids: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[B, h, T, D]`` of ``x [B, h, T, D]`` under per-value scales ``s`` and zero-points
    ``z`` (or ``None``), chosen by error feedback under ``(factor [h, D, D], order [h, D])`` of
    :func:`kvplan.kernels.feedback.feedback_factors`; the same codes as the PyTorch loop
    (:func:`kvplan.kernels.feedback.torch_feedback_codes`, same arguments), which is the test oracle."""
    B, h, T, D = x.shape
    x, s = x.float().contiguous(), s.float().contiguous()
    has_zero = z is not None
    z = z.float().contiguous() if has_zero else s  # without zero-points: a placeholder the kernel does not read
    out = torch.empty(B, h, T, D, dtype=torch.uint8, device=x.device)
    if T == 0 or B * h == 0:
        return out
    n_mids = mids.numel()
    block_d = max(triton.next_power_of_2(D), 8)
    # four [BLOCK_T, BLOCK_D] fp32 / int32 tiles live for the whole loop: 1024 values each
    block_t = max(1, min(triton.next_power_of_2(T), max(1, 1024 // block_d)))
    grid = (triton.cdiv(T, block_t), B * h)
    _feedback_codes_kernel[grid](
        x, s, z, order.to(torch.int64).contiguous(), levels.float().contiguous(), mids.float().contiguous(),
        factor.float().contiguous(), out, T,
        H=h, D=D, N_MIDS=n_mids, HAS_ZERO=has_zero, BLOCK_T=block_t, BLOCK_D=block_d,
        BLOCK_M=max(triton.next_power_of_2(n_mids), 2),
        enable_fp_fusion=False,  # level * scale + zero and x - push * err as two roundings, like the loop
    )
    return out


# ============================================================================ fused decode attention
@triton.jit
def _block_partial_attn_kernel(
    Q, sq_b, sq_h, sq_t,  # q [B, Hq, Tq, D] (last dim contiguous)
    KC, KS, KZ, skc_b, skc_h, skc_t, sks_b, sks_h, sks_g,  # K source of one segment / head group
    VC, VS, VZ, svc_b, svc_h, svc_t, svs_b, svs_h, svs_g,  # V source (its own head group)
    KLV, VLV,  # fp32 level units of the K / V slot formats (see _load_dequant_tile)
    HMAP,  # int32 [n_heads, 3]: (kv head, local head in K source, local head in V source)
    KA, KB, KCOS, KSIN,  # pre-RoPE keys: fp32 [D, D] H and H·P_rot-half; fp32 cos / sin [T_SEG + max shift, HALF]
    KSHIFT,  # int64 [B]: row b reads token t's angles at table row t + KSHIFT[b] (HAS_SHIFT: a left-padded batch)
    ZC, ZS, ZZ, szc_b, szc_h, szc_t, szs_b, szs_h, szs_g,  # key correction codes ẑ [B, h, T, r] (channel axis)
    QU, squ_b, squ_h, squ_m,  # fp32 q·U [B, h_K, M, RP] per local K head (rows as in the query tile)
    MASK, sm_b, sm_h, sm_q, sm_t,  # additive fp32 mask [B, Hq, Tq, T_total] (broadcast dims: stride 0)
    MO, LO, AO,  # partials: m, l fp32 [B, Hkv, M, S_total]; acc fp32 [B, Hkv, M, S_total, D]
    so_b, so_h, so_m, sa_b, sa_h, sa_m, sa_s,
    T_SEG,  # tokens of this segment
    TOK_BASE,  # index of the segment's first token in the mask's last dim
    SPLIT_LEN,  # tokens per program
    SLOT_BASE,  # first split slot of this segment in the partial buffers
    K_OFF, V_OFF, Z_OFF,  # channel-axis start offsets (keys, values, correction codes)
    qk_scale,  # sm_scale * log2(e)
    N_REP: tl.constexpr, TQ: tl.constexpr, D: tl.constexpr,
    K_BITS: tl.constexpr, K_CHANNEL: tl.constexpr, K_GS: tl.constexpr, K_G: tl.constexpr,
    V_BITS: tl.constexpr, V_CHANNEL: tl.constexpr, V_GS: tl.constexpr, V_G: tl.constexpr,
    K_ZERO: tl.constexpr, K_E4M3: tl.constexpr, K_LEVELS: tl.constexpr,  # K slot format (kernels.formats)
    V_ZERO: tl.constexpr, V_E4M3: tl.constexpr, V_LEVELS: tl.constexpr,
    K_ROPE: tl.constexpr, HALF: tl.constexpr,  # keys in the pre-RoPE frame; rotary pairs (i, i + HALF)
    HAS_SHIFT: tl.constexpr,
    K_CORR: tl.constexpr, Z_BITS: tl.constexpr, R_DIM: tl.constexpr, RP: tl.constexpr,  # key correction
    HAS_MASK: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Split-softmax partials of decode attention over one (K source, V source) pair.

    A *source* is a quantized PackedBlock (codes ``uint8 [B, h, T, RB]`` + fp16 scale / zero,
    token or channel axis) or a full-precision tensor ``[B, h, T, D]`` (``BITS == 16``: a
    16-bit PackedBlock or the residual). Keys and values are dequantized tile by tile in
    registers; nothing dequantized is written to memory.

    The codec's transforms (see :func:`packed_decode_attention` for which run where):
    ``K_ROPE``: a key tile ``ŷ [BLOCK_N, D]`` is brought to the attended frame in registers,
    ``x = ŷ·KA`` and ``x_rh = ŷ·KB`` (two tile products; ``KA = H`` or ``I``, ``KB = KA·P`` with
    ``P`` the rotate-half signed permutation), then ``k = x·cos + x_rh·sin`` with the cos / sin
    of the tile's cache indices, shifted by ``KSHIFT[b]`` in a left-padded batch (channels past
    ``2 * HALF`` get cos 1, sin 0). ``K_CORR``: the
    correction code tile ``ẑ [BLOCK_N, RP]`` is dequantized too and ``(q U)·ẑ`` (``QU``, ``r``
    numbers per row) is added to the scores.

    GQA packing: the ``M = N_REP * TQ`` query rows that share KV head ``kvh`` form one tile;
    row ``m`` is query head ``kvh * N_REP + m // TQ``, query position ``m % TQ``.
    Grid: ``(n_splits, n_heads, B)``; program ``(s, i, b)`` handles KV head ``HMAP[i, 0]``,
    tokens ``[s * SPLIT_LEN, min((s + 1) * SPLIT_LEN, T_SEG))`` of the segment in chunks of
    ``BLOCK_N``, with an online softmax in the log2 domain, and writes the running max
    ``m``, sum ``l`` and unnormalized ``acc`` to slot ``SLOT_BASE + s``.
    """
    pid_s = tl.program_id(0)
    pid_h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    kvh = tl.load(HMAP + pid_h * 3).to(tl.int64)
    kh = tl.load(HMAP + pid_h * 3 + 1).to(tl.int64)
    vh = tl.load(HMAP + pid_h * 3 + 2).to(tl.int64)

    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < N_REP * TQ
    hq = kvh * N_REP + rows // TQ
    tq = rows % TQ
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(
        Q + b * sq_b + hq[:, None] * sq_h + tq[:, None] * sq_t + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    ).to(tl.float32) * qk_scale
    if DOT_F32:
        q_dot = q
    else:
        q_dot = q.to(Q.dtype.element_ty)

    k_c = KC + b * skc_b + kh * skc_h
    k_s = KS + b * sks_b + kh * sks_h
    k_z = KZ + b * sks_b + kh * sks_h
    v_c = VC + b * svc_b + vh * svc_h
    v_s = VS + b * svs_b + vh * svs_h
    v_z = VZ + b * svs_b + vh * svs_h

    if K_CORR:
        rr = tl.arange(0, RP)
        qu = tl.load(QU + b * squ_b + kh * squ_h + rows[:, None] * squ_m + rr[None, :],
                     mask=row_ok[:, None] & (rr < R_DIM)[None, :], other=0.0) * qk_scale  # [BLOCK_M, RP]
        z_c = ZC + b * szc_b + kh * szc_h
        z_s = ZS + b * szs_b + kh * szs_h
        z_z = ZZ + b * szs_b + kh * szs_h
    if K_ROPE:
        # the two [D, D] matrices are loaded once per program, in the dot's dtype (fp16 / bf16:
        # 16 KB at D = 64; not measured on a GPU yet, see bench/gpu.sh, whether D = 128 spills)
        dd = d[:, None] * D + d[None, :]
        dd_ok = d_ok[:, None] & d_ok[None, :]
        ka = tl.load(KA + dd, mask=dd_ok, other=0.0)
        kb = tl.load(KB + dd, mask=dd_ok, other=0.0)
        if not DOT_F32:
            ka = ka.to(Q.dtype.element_ty)
            kb = kb.to(Q.dtype.element_ty)
        rope_d = (d < 2 * HALF)[None, :]
        if HAS_SHIFT:
            k_shift = tl.load(KSHIFT + b)
        else:
            k_shift = 0

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    t_start = pid_s * SPLIT_LEN
    t_end = tl.minimum(t_start + SPLIT_LEN, T_SEG)
    for n0 in range(t_start, t_end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        t_ok = t < t_end
        k = _load_dequant_tile(k_c, k_s, k_z, KLV, skc_t, sks_g, t, t_ok, K_OFF,
                               D, K_BITS, K_CHANNEL, K_GS, K_G, BLOCK_N, BLOCK_D,
                               K_ZERO, K_E4M3, K_LEVELS)  # [BLOCK_N, BLOCK_D]
        if K_ROPE:
            if DOT_F32:
                x = tl.dot(k, ka, input_precision="ieee")
                x_rh = tl.dot(k, kb, input_precision="ieee")
            else:
                k_lo = k.to(Q.dtype.element_ty)
                x = tl.dot(k_lo, ka)
                x_rh = tl.dot(k_lo, kb)
            cs_m = t_ok[:, None] & rope_d
            cs_o = (t[:, None].to(tl.int64) + k_shift) * HALF + (d % HALF)[None, :]
            cs = tl.load(KCOS + cs_o, mask=cs_m, other=1.0)
            sn = tl.load(KSIN + cs_o, mask=cs_m, other=0.0)
            k = x * cs + x_rh * sn
        if DOT_F32:
            s = tl.dot(q_dot, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q_dot, tl.trans(k.to(Q.dtype.element_ty)))  # [BLOCK_M, BLOCK_N] fp32
        if K_CORR:
            z = _load_dequant_tile(z_c, z_s, z_z, z_s, szc_t, szs_g, t, t_ok, Z_OFF,
                                   R_DIM, Z_BITS, True, K_GS, 1, BLOCK_N, RP)  # [BLOCK_N, RP]
            s = s + tl.sum(qu[:, None, :] * z[None, :, :], axis=2)
        if HAS_MASK:
            mk = tl.load(
                MASK + b * sm_b + hq[:, None] * sm_h + tq[:, None] * sm_q + (TOK_BASE + t)[None, :].to(tl.int64) * sm_t,
                mask=row_ok[:, None] & t_ok[None, :], other=0.0,
            )
            s = s + mk * 1.4426950408889634
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_dequant_tile(v_c, v_s, v_z, VLV, svc_t, svs_g, t, t_ok, V_OFF,
                               D, V_BITS, V_CHANNEL, V_GS, V_G, BLOCK_N, BLOCK_D,
                               V_ZERO, V_E4M3, V_LEVELS)  # [BLOCK_N, BLOCK_D]
        if DOT_F32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(Q.dtype.element_ty), v.to(Q.dtype.element_ty))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    slot = SLOT_BASE + pid_s
    o = b * so_b + kvh * so_h + rows * so_m + slot
    tl.store(MO + o, m_i, mask=row_ok)
    tl.store(LO + o, l_i, mask=row_ok)
    a = b * sa_b + kvh * sa_h + rows[:, None] * sa_m + slot * sa_s + d[None, :]
    tl.store(AO + a, acc, mask=row_ok[:, None] & d_ok[None, :])


def _format_tensors(fmt, scale, zero, device):
    """``(scale, zero, levels)`` as the kernels read them: e4m3 scales as their bytes (uint8),
    a missing zero-point and missing levels as the scale tensor (placeholders the kernel does not
    read), the level units of a codebook as fp32 on ``device``; last dims contiguous, scale and
    zero with the same strides."""
    scale = scale if scale.stride(-1) == 1 else scale.contiguous()
    if scale.dtype == torch.float8_e4m3fn:
        scale = scale.view(torch.uint8)
    if zero is None:
        zero = scale
    else:
        zero = zero if zero.stride(-1) == 1 else zero.contiguous()
        if zero.stride() != scale.stride():
            scale, zero = scale.contiguous(), zero.contiguous()
    levels = None if fmt is None else fmt.level_units(device)
    return scale, zero, scale if levels is None else levels


class _Source:
    """One side (K or V) of a launch: a PackedBlock's tensors, or a full-precision tensor.

    ``rotation`` / ``position``: the block's codec rotation (:class:`~kvplan.kernels.rotation.Rotation`)
    and the cache index of its first token; ``corr`` / ``basis``: the key correction code (a
    nested source) and ``U [h, D, r]``.
    """

    __slots__ = ("codes", "scale", "zero", "bits", "channel", "gs", "g", "off", "length", "heads", "rotation",
                 "position", "corr", "basis", "levels", "has_zero", "e4m3", "has_levels")

    def __init__(self, codes, scale, zero, bits, axis, group_size, start_offset, length, head_dim, heads,
                 rotation=None, position=0, corr=None, basis=None, fmt=None):
        self.bits = int(bits)
        self.heads = tuple(int(h) for h in heads)
        self.length = int(length)
        self.rotation, self.position, self.corr, self.basis = rotation, int(position), corr, basis
        self.has_zero, self.e4m3, self.has_levels = True, False, False
        if self.bits == STREAMED:  # a streamed head's tokens: nothing stored, no launch reads them
            self.codes = self.scale = self.zero = self.levels = codes
            self.channel, self.gs, self.g, self.off = False, 1, 1, 0
            return
        if self.bits == FULL_PRECISION_BITS:
            self.codes = codes if codes.stride(-1) == 1 else codes.contiguous()
            self.scale = self.zero = self.levels = self.codes  # unused placeholders
            self.channel, self.gs, self.g, self.off = False, 1, 1, 0
            return
        qtype(self.bits)
        self.codes = codes if codes.stride(-1) == 1 else codes.contiguous()
        self.scale, self.zero, self.levels = _format_tensors(fmt, scale, zero, codes.device)
        if fmt is not None and not fmt.legacy:
            self.has_zero = zero is not None
            self.e4m3 = fmt.spec.scale_dtype == torch.float8_e4m3fn
            self.has_levels = fmt.level_units() is not None
        if axis == "channel":
            self.channel, self.gs, self.g, self.off = True, int(group_size), 1, int(start_offset)
        elif axis == "token":
            self.channel, self.gs, self.off = False, int(group_size), 0
            self.g = channel_group_size(group_size, head_dim)
        else:
            raise ValueError(f"unknown quantization axis {axis!r}")

    @classmethod
    def from_block(cls, blk) -> "_Source":
        corr = getattr(blk, "correction", None)
        return cls(blk.codes, blk.scale, blk.zero, blk.bits, blk.axis, blk.group_size, blk.start_offset, blk.length,
                   blk.head_dim, blk.heads, getattr(blk, "rotation", None), getattr(blk, "position", 0),
                   None if corr is None else cls.from_block(corr), getattr(blk, "basis", None),
                   getattr(blk, "fmt", None))

    @classmethod
    def from_tensor(cls, x: torch.Tensor) -> "_Source":
        return cls(x, None, None, FULL_PRECISION_BITS, "token", 1, 0, x.shape[2], x.shape[3], range(x.shape[1]))

    @property
    def pre_rope(self) -> bool:
        return self.rotation is not None and self.rotation.inv_freq is not None

    @property
    def query_hadamard(self) -> bool:
        """Keys stored times ``H`` without the pre-RoPE frame: the launch takes ``q H``."""
        return self.rotation is not None and self.rotation.inv_freq is None


_DEVICE_CACHE: dict = {}


def _cached(key: tuple, make) -> torch.Tensor:
    """``make()`` once per ``key`` (small layout tensors built on the host): a decode step reuses
    the device tensors of the layouts it has seen, with no host-to-device copy."""
    t = _DEVICE_CACHE.get(key)
    if t is None:
        if len(_DEVICE_CACHE) > 4096:
            _DEVICE_CACHE.clear()
        t = _DEVICE_CACHE[key] = make()
    return t


def _device_ints(values: tuple, device) -> torch.Tensor:
    """int32 tensor of ``values`` on ``device`` (cached)."""
    return _cached(("ints", values, str(device)), lambda: torch.tensor(values, dtype=torch.int32, device=device))


def _hmap(rows: tuple, device) -> torch.Tensor:
    return _device_ints(rows, device).reshape(-1, 3)


def block_partial_attention(
    q: torch.Tensor,
    k_src: _Source,
    v_src: _Source,
    heads: list[tuple[int, int, int]],
    mask: torch.Tensor | None,
    tok_base: int,
    qk_scale: float,
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    slot_base: int,
    split_len: int,
    block_n: int = 64,
    qu: torch.Tensor | None = None,
) -> int:
    """Launch :func:`_block_partial_attn_kernel` for one K source / V source pair.

    ``q [B, Hq, Tq, D]`` (already ``q H`` when ``k_src.query_hadamard``); ``heads``: ``(kv head,
    local K head, local V head)`` for the KV heads the two sources share; ``mask``: additive fp32
    ``[B, Hq, Tq, T_total]`` (expanded, may have zero strides) or ``None``; ``partials = (m, l,
    acc)`` with m, l ``[B, Hkv, M, S_total]`` and acc ``[B, Hkv, M, S_total, D]`` (``M = n_rep *
    Tq``); ``qu``: fp32 ``q U [B, h_K, M, RP]`` when ``k_src`` carries a key correction. Writes
    slots ``[slot_base, slot_base + n_splits)``. Returns ``n_splits = cdiv(T_seg, split_len)``.
    """
    B, Hq, Tq, D = q.shape
    T_seg = k_src.length
    if T_seg != v_src.length:
        raise ValueError(f"K and V sources cover different token counts ({T_seg} vs {v_src.length})")
    n_splits = triton.cdiv(T_seg, split_len)
    if n_splits == 0 or not heads:
        return n_splits
    mo, lo, ao = partials
    Hkv = mo.shape[1]
    n_rep = Hq // Hkv
    hmap = _hmap(tuple(x for row in heads for x in row), q.device)
    has_mask = mask is not None
    mk = mask if has_mask else mo
    msb = mask.stride() if has_mask else (0, 0, 0, 0)
    block_m = max(16, triton.next_power_of_2(n_rep * Tq))
    block_d = max(16, triton.next_power_of_2(D))
    kc, vc = k_src.codes, v_src.codes
    ks, vs = k_src.scale, v_src.scale
    if k_src.pre_rope:
        rot = k_src.rotation
        ka, kb = rot.tile_matrices(D)
        kcos, ksin = rot.angles(k_src.position, T_seg + rot.max_shift)  # [T_seg + shift, HALF]: contiguous
        half = kcos.shape[-1]
        kshift = rot.row_shift
    else:
        ka = kb = kcos = ksin = mo
        half = 1
        kshift = None
    z = k_src.corr
    if z is not None:
        zc, zs, zz, z_bits, z_off, rp = z.codes, z.scale, z.zero, z.bits, z.off, qu.shape[-1]
        r_dim = k_src.basis.shape[-1]
        zcs, zss, qus = zc.stride(), zs.stride(), qu.stride()
    else:
        zc = zs = zz = qu = mo
        z_bits, z_off, r_dim, rp = 8, 0, 1, 1
        zcs, zss, qus = (0, 0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0)
    grid = (n_splits, len(heads), B)
    _block_partial_attn_kernel[grid](
        q, q.stride(0), q.stride(1), q.stride(2),
        kc, ks, k_src.zero, kc.stride(0), kc.stride(1), kc.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
        vc, vs, v_src.zero, vc.stride(0), vc.stride(1), vc.stride(2), vs.stride(0), vs.stride(1), vs.stride(2),
        k_src.levels, v_src.levels,
        hmap,
        ka, kb, kcos, ksin,
        mo if kshift is None else kshift,
        zc, zs, zz, zcs[0], zcs[1], zcs[2], zss[0], zss[1], zss[2],
        qu, qus[0], qus[1], qus[2],
        mk, msb[0], msb[1], msb[2], msb[3],
        mo, lo, ao,
        mo.stride(0), mo.stride(1), mo.stride(2), ao.stride(0), ao.stride(1), ao.stride(2), ao.stride(3),
        T_seg, tok_base, split_len, slot_base, k_src.off, v_src.off, z_off,
        qk_scale,
        N_REP=n_rep, TQ=Tq, D=D,
        K_BITS=k_src.bits, K_CHANNEL=k_src.channel, K_GS=k_src.gs, K_G=k_src.g,
        V_BITS=v_src.bits, V_CHANNEL=v_src.channel, V_GS=v_src.gs, V_G=v_src.g,
        K_ZERO=k_src.has_zero, K_E4M3=k_src.e4m3, K_LEVELS=k_src.has_levels,
        V_ZERO=v_src.has_zero, V_E4M3=v_src.e4m3, V_LEVELS=v_src.has_levels,
        K_ROPE=k_src.pre_rope, HALF=half, HAS_SHIFT=kshift is not None,
        K_CORR=z is not None, Z_BITS=z_bits, R_DIM=r_dim, RP=rp,
        HAS_MASK=has_mask, DOT_F32=_dot_in_fp32(q),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=8 if block_n * block_d >= 8192 else 4,  # two dequantized [BLOCK_N, D] fp32 tiles live at once
    )
    return n_splits


def _correction_query(q: torch.Tensor, k_src: _Source, Hkv: int) -> torch.Tensor:
    """fp32 ``q U [B, h_K, M, RP]`` for a corrected key source: per local head, its KV head's
    ``M = n_rep * Tq`` query rows times ``U [D, r]``, zero-padded to ``RP`` columns (a power of
    two that holds whole pack units of the correction code)."""
    B, Hq, Tq, D = q.shape
    heads = k_src.heads
    qg = q.float().reshape(B, Hkv, (Hq // Hkv) * Tq, D)
    if heads == tuple(range(heads[0], heads[0] + len(heads))):
        qg = qg[:, heads[0] : heads[0] + len(heads)]  # [B, h_K, M, D]
    else:
        qg = qg.index_select(1, _device_ints(heads, q.device))
    qu = torch.matmul(qg, k_src.basis)  # [B, h_K, M, r]
    r = qu.shape[-1]
    cpu_, _, _ = _unit_params(k_src.corr.bits)
    rp = max(triton.next_power_of_2(r), cpu_)
    return torch.nn.functional.pad(qu, (0, rp - r)).contiguous() if rp != r else qu.contiguous()


def _dot_in_fp32(q: torch.Tensor) -> bool:
    """fp32 queries use exact fp32 dots; fp16 / bf16 use tensor-core dots in their dtype.

    Triton's CPU interpreter (``TRITON_INTERPRET=1``) computes bf16 ``tl.dot`` wrongly, so
    there bf16 falls back to fp32 dots (numerically at least as accurate).
    """
    if q.dtype == torch.float32:
        return True
    return q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") == "1"


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def _prepare_mask(attn_mask, B, Hq, Tq, T_total):
    if attn_mask is None:
        return None
    m = attn_mask
    if m.dim() != 4 or m.shape[-1] != T_total or m.shape[-2] != Tq or m.shape[1] not in (1, Hq):
        raise ValueError(f"attn_mask must be [B, 1 or Hq, Tq, T_total] = [{B}, 1|{Hq}, {Tq}, {T_total}], got {tuple(m.shape)}")
    if m.dtype == torch.bool:
        m = torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill_(~m, float("-inf"))
    else:
        m = m.to(torch.float32)
    return m.expand(B, Hq, Tq, T_total)


def _choose_split(T_seg: int, n_progs_per_split: int, n_sms: int, block_n: int) -> int:
    """Tokens per program: enough programs to fill the GPU, at least ``4 * block_n`` tokens each."""
    want = max(1, -(-2 * n_sms // max(1, n_progs_per_split)))
    split = -(-T_seg // want)
    split = max(4 * block_n, -(-split // block_n) * block_n)
    return split


def packed_decode_attention(
    q: torch.Tensor,
    key_blocks,
    value_blocks,
    key_residual: torch.Tensor | None,
    value_residual: torch.Tensor | None,
    attn_mask: torch.Tensor | None = None,
    sm_scale: float | None = None,
    *,
    split_len: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Decode attention straight from the packed cache: ``softmax(q kᵀ · sm_scale + mask) v``.

    ``q [B, Hq, Tq, D]``; ``key_blocks`` / ``value_blocks``: per token segment (time order) a
    list of :class:`~kvplan.runtime.storage.PackedBlock` whose heads partition the KV heads
    (K and V groupings may differ); ``key_residual`` / ``value_residual``: full-precision
    ``[B, Hkv, Tr, D]`` or ``None``; ``attn_mask``: additive float or bool (True = keep)
    ``[B, 1 or Hq, Tq, T_total]`` over segment tokens then residual tokens. GQA: query head
    ``j`` uses KV head ``j // (Hq // Hkv)``. Returns ``[B, Hq, Tq, D]`` in ``q.dtype``.

    One launch of :func:`_block_partial_attn_kernel` per (K block, V block) pair of a segment
    that share heads, plus one for the residual, all writing split-softmax partials into one
    buffer; a log-sum-exp merge in torch finishes. ``split_len`` / ``block_n`` override the
    tokens per program / per inner step (tests use small values to exercise many splits).

    Every codec the plans produce runs in this kernel (nothing falls back to another kernel);
    its transforms stay off the per-token path where the algebra allows:

    - values stored times a Hadamard ``H``: their launches write split slots of their own
      (a ``[Hkv, S]`` mask), and the merge rotates the weighted sum of those slots once,
      ``sum_j p_j (v̂'_j H) = (sum_j p_j v̂'_j) H``;
    - keys times ``H`` without the pre-RoPE frame: the launch reads ``q H`` (one ``[M, D] x
      [D, D]`` product per step), ``q·(ŷ H) = (q H)·ŷ``;
    - the key correction: ``(q U)`` (``r`` numbers per query row, :func:`_correction_query`) and
      the correction code tile ``ẑ`` dequantized in registers add ``(q U)·ẑ`` to the scores;
    - keys in the pre-RoPE frame: RoPE depends on the position and does not commute with ``H``,
      so each ``[BLOCK_N, D]`` key tile is turned back in registers (two tile products with
      ``H`` and ``H P``, then cos / sin of the tile's cache indices; see the kernel). Only
      packed codes, scales, correction codes and the small cos / sin table are read.
    """
    if q.dim() != 4:
        raise ValueError(f"expected q [B, Hq, Tq, D], got {tuple(q.shape)}")
    B, Hq, Tq, D = q.shape
    if len(key_blocks) != len(value_blocks):
        raise ValueError("key_blocks and value_blocks must list the same segments")
    segs = []
    Hkv = None
    for kbs, vbs in zip(key_blocks, value_blocks):
        ks = [_Source.from_block(b) for b in kbs]
        vs = [_Source.from_block(b) for b in vbs]
        hk = sorted(h for s in ks for h in s.heads)
        hv = sorted(h for s in vs for h in s.heads)
        if hk != list(range(len(hk))) or hv != hk:
            raise ValueError(f"segment head groups must partition the KV heads (K {hk}, V {hv})")
        lengths = {s.length for s in ks + vs}
        if len(lengths) != 1:
            raise ValueError(f"blocks of one segment cover different token counts: {sorted(lengths)}")
        if Hkv is not None and Hkv != len(hk):
            raise ValueError("segments disagree on the number of KV heads")
        Hkv = len(hk)
        segs.append((ks, vs, lengths.pop()))
    if key_residual is not None and key_residual.shape[2] == 0:
        key_residual = value_residual = None
    if key_residual is not None:
        if value_residual is None or value_residual.shape != key_residual.shape:
            raise ValueError("key_residual and value_residual must have the same shape")
        if Hkv is not None and key_residual.shape[1] != Hkv:
            raise ValueError("residual and segments disagree on the number of KV heads")
        Hkv = key_residual.shape[1]
    if Hkv is None:
        raise ValueError("no keys to attend to (no segments and no residual)")
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    n_rep = Hq // Hkv
    M = n_rep * Tq
    T_total = sum(T for _, _, T in segs) + (key_residual.shape[2] if key_residual is not None else 0)
    if T_total == 0:
        raise ValueError("no keys to attend to (zero tokens)")
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    qk_scale = sm_scale * _LOG2E
    if q.stride(-1) != 1:
        q = q.contiguous()
    mask = _prepare_mask(attn_mask, B, Hq, Tq, T_total)

    bn = block_n or 64  # (tests pass 16 to run several inner steps per program)
    n_sms = _num_sms(q.device)
    plan = []  # (k_src, v_src, heads, tok_base, split)
    tok = 0
    parts = [(ks, vs, T) for ks, vs, T in segs]
    if key_residual is not None:
        parts.append(([_Source.from_tensor(key_residual)], [_Source.from_tensor(value_residual)], key_residual.shape[2]))
    slots = 0
    for ks, vs, T in parts:
        if T == 0:
            continue
        pairs = []
        for k_src in ks:
            kpos = {h: i for i, h in enumerate(k_src.heads)}
            for v_src in vs:
                heads = [(h, kpos[h], j) for j, h in enumerate(v_src.heads) if h in kpos]
                if heads:
                    pairs.append((k_src, v_src, heads))
        # Launches of one segment run one after another: size splits for the smallest one.
        split = split_len or _choose_split(T, B * min(len(p[2]) for p in pairs), n_sms, bn)
        n_splits = triton.cdiv(T, split)
        for k_src, v_src, heads in pairs:
            plan.append((k_src, v_src, heads, tok, split, slots))
        tok += T
        slots += n_splits

    mo = torch.empty(B, Hkv, M, slots, dtype=torch.float32, device=q.device)
    lo = torch.empty_like(mo)
    ao = torch.empty(B, Hkv, M, slots, D, dtype=torch.float32, device=q.device)
    q_h = None  # q H, for keys stored times H without the pre-RoPE frame (made once)
    rot_slots = []  # (kv heads, first slot, end slot) of launches over values stored times H
    hadamard = None
    for k_src, v_src, heads, tok_base, split, slot_base in plan:
        if k_src.bits == STREAMED or v_src.bits == STREAMED:  # nothing stored: these splits hold no weight
            hs, n = [h for h, _, _ in heads], triton.cdiv(k_src.length, split)
            mo[:, hs, :, slot_base:slot_base + n] = float("-inf")
            lo[:, hs, :, slot_base:slot_base + n] = 0.0
            ao[:, hs, :, slot_base:slot_base + n] = 0.0
            continue
        q_k = q
        if k_src.query_hadamard:
            if q_h is None:
                q_h = torch.matmul(q.float(), k_src.rotation.hadamard).to(q.dtype)
            q_k = q_h
        qu = _correction_query(q, k_src, Hkv) if k_src.corr is not None else None
        n = block_partial_attention(q_k, k_src, v_src, heads, mask, tok_base, qk_scale, (mo, lo, ao), slot_base,
                                    split, bn, qu)
        if v_src.rotation is not None:
            if v_src.pre_rope:
                raise ValueError("value blocks carry a Hadamard rotation only (no pre-RoPE frame)")
            hadamard = v_src.rotation.hadamard
            rot_slots.append((tuple(h for h, _, _ in heads), slot_base, slot_base + n))
    v_rot = _slot_mask(tuple(rot_slots), Hkv, slots, q.device) if rot_slots else None
    return _combine(mo, lo, ao, B, Hq, Tq, D, q.dtype, v_rot, hadamard)


def _slot_mask(rot_slots: tuple, Hkv: int, slots: int, device) -> torch.Tensor:
    """bool ``[Hkv, S]``, True at the slots of ``rot_slots`` (cached by layout)."""
    def make():
        m = torch.zeros(Hkv, slots, dtype=torch.bool)
        for heads, a, b in rot_slots:
            m[list(heads), a:b] = True
        return m.to(device)

    return _cached(("slots", rot_slots, Hkv, slots, str(device)), make)


def _combine(mo, lo, ao, B, Hq, Tq, D, dtype, v_rot=None, hadamard=None) -> torch.Tensor:
    """Log-sum-exp merge of split partials (log2 domain) → ``[B, Hq, Tq, D]``; the slots marked in
    ``v_rot [Hkv, S]`` hold values times ``hadamard``: their weighted sum is rotated once."""
    mmax = mo.amax(dim=-1, keepdim=True)
    mmax = torch.where(torch.isfinite(mmax), mmax, torch.zeros_like(mmax))
    w = torch.exp2(mo - mmax)  # [B, Hkv, M, S]; -inf → 0
    l_tot = (w * lo).sum(-1)
    if v_rot is None:
        num = (w.unsqueeze(-1) * ao).sum(-2)  # [B, Hkv, M, D]
    else:
        w_rot = w * v_rot[None, :, None, :]
        num = ((w - w_rot).unsqueeze(-1) * ao).sum(-2) + torch.matmul((w_rot.unsqueeze(-1) * ao).sum(-2), hadamard)
    out = num / l_tot.unsqueeze(-1)  # fully masked row → NaN like softmax
    return out.reshape(B, Hq, Tq, D).to(dtype)
