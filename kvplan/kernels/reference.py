"""PyTorch reference implementation of the KV quantizer (CPU and any device).

Layout contract (the Triton kernels in ``triton_kernels.py`` produce exactly this):

* input block ``x``: ``[B, h, T, D]`` in fp16 / bf16 / fp32.
* codes: asymmetric min-max, ``code = round((x - zero) / scale)`` clamped to
  ``[0, 2**bits - 1]``, computed in fp32 from the *fp16-rounded* scale and zero so
  that dequantization ``code * scale + zero`` uses exactly what is stored.
  A constant group (max == min) has scale 0, codes 0, and dequantizes to ``zero``.
* packed codes: ``uint8 [B, h, T, packed_row_bytes(D, bits)]``; within a row, code
  ``j`` of a pack unit sits at bit offset ``j * bits`` (little-endian across the
  unit's bytes). 8-bit: one code per byte; 4-bit: two; 2-bit: four; 3-bit: eight
  codes in three bytes.
* ``axis="token"``: groups of ``g = min(group_size, D)`` consecutive channels of one
  token. scale, zero: ``fp16 [B, h, T, D // g]``.
* ``axis="channel"`` (KIVI keys): groups of tokens along T, aligned to absolute
  positions: the block's first token sits at ``start_offset`` inside its group of
  ``group_size`` tokens, so the first and last groups may be partial.
  scale, zero: ``fp16 [B, h, n_groups, D]`` with
  ``n_groups = ceil((start_offset + T) / group_size)``.

That is the v1 format. Other formats of the registry (:mod:`kvplan.kernels.formats`: e4m3
scales, symmetric groups without a zero-point, codebooks) keep the same code packing and the
same scale / zero shapes, with their own dtypes (``zero`` is ``None`` when symmetric); they
decode as ``zero + scale * L[code]``. The Triton decode kernels read every format; the Triton encode
kernels write the v1 format only (the others are encoded by this module, on any device).
"""

from __future__ import annotations

import torch

from .formats import Format, ScaleRangeError, store_scale
from .qtypes import channel_group_size, qtype

_FP16_MAX = 65504.0


# ----------------------------------------------------------------------------- packing
def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``uint8`` codes ``[..., n]`` into ``uint8 [..., packed_row_bytes(n, bits)]``."""
    qt = qtype(bits)
    n = codes.shape[-1]
    units = -(-n // qt.codes_per_unit)
    pad = units * qt.codes_per_unit - n
    if bits == 8:
        return codes.to(torch.uint8)
    if qt.unit_bytes == 1:  # 2 and 4 bits: OR the shifted codes of each byte in uint8 (3-4x faster than int32)
        c = codes.to(torch.uint8)
        if pad:
            c = torch.nn.functional.pad(c, (0, pad))
        c = c.reshape(*codes.shape[:-1], units, qt.codes_per_unit)
        out = c[..., 0].clone()
        for j in range(1, qt.codes_per_unit):
            out |= c[..., j] << (j * bits)
        return out
    c = codes.to(torch.int32)
    if pad:
        c = torch.nn.functional.pad(c, (0, pad))
    c = c.reshape(*codes.shape[:-1], units, qt.codes_per_unit)
    shifts = torch.arange(qt.codes_per_unit, device=codes.device, dtype=torch.int32) * bits
    word = (c << shifts).sum(dim=-1)  # [..., units], at most 24 bits used
    byte_shifts = torch.arange(qt.unit_bytes, device=codes.device, dtype=torch.int32) * 8
    out = (word.unsqueeze(-1) >> byte_shifts) & 0xFF  # [..., units, unit_bytes]
    return out.reshape(*codes.shape[:-1], units * qt.unit_bytes).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``uint8 [..., bytes]`` to ``uint8 [..., n]``."""
    qt = qtype(bits)
    if bits == 8:
        return packed[..., :n]
    if qt.unit_bytes == 1:  # 2 and 4 bits: byte-local shifts in uint8, no widening
        # one uint8 pass per code position of a byte; the top code needs no mask
        top = qt.codes_per_unit - 1
        parts = [(packed >> (j * bits)) & qt.qmax for j in range(top)] + [packed >> (top * bits)]
        return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], -1)[..., :n]
    units = packed.shape[-1] // qt.unit_bytes
    b = packed.to(torch.int32).reshape(*packed.shape[:-1], units, qt.unit_bytes)
    byte_shifts = torch.arange(qt.unit_bytes, device=packed.device, dtype=torch.int32) * 8
    word = (b << byte_shifts).sum(dim=-1)  # [..., units]
    shifts = torch.arange(qt.codes_per_unit, device=packed.device, dtype=torch.int32) * bits
    codes = (word.unsqueeze(-1) >> shifts) & qt.qmax  # [..., units, codes_per_unit]
    return codes.reshape(*packed.shape[:-1], units * qt.codes_per_unit)[..., :n].to(torch.uint8)


_BYTE_CODES: dict = {}


def _byte_codes(bits: int, device) -> torch.Tensor:
    """fp32 ``[256, codes_per_byte]``: the codes packed in each byte value (1-byte pack units)."""
    key = (bits, str(device))
    if key not in _BYTE_CODES:
        qt = qtype(bits)
        b = torch.arange(256, dtype=torch.int32)
        table = torch.stack([(b >> (j * bits)) & qt.qmax for j in range(qt.codes_per_unit)], dim=-1)
        _BYTE_CODES[key] = table.float().to(device)
    return _BYTE_CODES[key]


_BYTE_LEVELS: dict = {}


def _byte_levels(fmt: Format, device) -> torch.Tensor:
    """fp32 ``[256, 4]``: the 2-bit levels of ``fmt`` of the four codes packed in each byte value
    (keyed on the format itself: no read of the level tensor, so no host sync, on the decode path)."""
    key = (fmt, str(device))
    if key not in _BYTE_LEVELS:
        _BYTE_LEVELS[key] = fmt.level_units(device)[_byte_codes(2, device).long()]
    return _BYTE_LEVELS[key]


# ----------------------------------------------------------------------------- scales
def _scale_zero(mn: torch.Tensor, mx: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 scale and zero-point from fp32 group min / max."""
    if bool((mn < -_FP16_MAX).any() or (mx > _FP16_MAX).any()):
        raise ScaleRangeError(
            "KV values exceed the fp16 range of the stored scales/zero-points "
            f"(min {mn.min().item():.4g}, max {mx.max().item():.4g}); cannot quantize this block"
        )
    scale = ((mx - mn) / qmax).to(torch.float16)
    zero = mn.to(torch.float16)
    return scale, zero


def _encode(x: torch.Tensor, scale16: torch.Tensor, zero16: torch.Tensor, qmax: int) -> torch.Tensor:
    s = scale16.float()
    z = zero16.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round((x - z) / safe)
    q = torch.where(s > 0, q, torch.zeros_like(q))
    return q.clamp_(0, qmax).to(torch.uint8)


# ----------------------------------------------------------------------------- quantize
def quantize(
    x: torch.Tensor, bits: int, group_size: int, axis: str, start_offset: int = 0, fmt: Format | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize ``x [B, h, T, D]``; returns ``(packed codes, scale, zero)``.

    See the module docstring for the layout. ``fmt`` (:class:`~kvplan.kernels.formats.Format`,
    default: the v1 format at ``bits``) sets the scale / zero dtypes (``zero`` is ``None`` for a
    symmetric scaling) and the codebook.
    """
    if fmt is not None and not fmt.legacy:
        return _quantize_format(x, fmt, group_size, axis, start_offset)
    qt = qtype(bits)
    B, h, T, D = x.shape
    xf = x.float()
    scale, zero = group_scales(xf, bits, group_size, axis, start_offset)
    if axis == "token":
        g = channel_group_size(group_size, D)
        xg = xf.reshape(B, h, T, D // g, g)
        codes = _encode(xg, scale.unsqueeze(-1), zero.unsqueeze(-1), qt.qmax).reshape(B, h, T, D)
    else:
        s_tok = _expand_groups(scale, group_size, start_offset, T)
        z_tok = _expand_groups(zero, group_size, start_offset, T)
        codes = _encode(xf, s_tok, z_tok, qt.qmax)
    return pack_codes(codes, bits), scale, zero


def group_scales(x: torch.Tensor, bits: int, group_size: int, axis: str, start_offset: int = 0,
                 fmt: Format | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``(scale, zero)`` :func:`quantize` stores for ``x [B, h, T, D]`` (``[B, h, T, D/g]`` on
    the token axis, ``[B, h, n_groups, D]`` on the channel axis; ``zero`` None for a symmetric
    format), without coding the values."""
    xf = x.float()
    if fmt is None or fmt.legacy:
        lo, hi = _group_stats(xf, group_size, axis, start_offset, False)
        return _scale_zero(lo, hi, qtype(bits).qmax)  # fp16 scale and zero-point
    lo, hi = _group_stats(xf, group_size, axis, start_offset, fmt.spec.symmetric)
    if fmt.spec.symmetric:
        return store_scale(hi, fmt), None
    if bool((lo < -_FP16_MAX).any() or (hi > _FP16_MAX).any()):
        raise ScaleRangeError("KV values exceed the fp16 range of the stored zero-points "
                              f"(min {lo.min().item():.4g}, max {hi.max().item():.4g}); cannot quantize this block")
    zero = lo.to(fmt.spec.zero_dtype)
    return store_scale((hi - zero.float()) / ((1 << fmt.bits) - 1), fmt), zero


def _group_stats(xf: torch.Tensor, group_size: int, axis: str, start_offset: int, symmetric: bool):
    """Per-group ``(lo, hi)`` (min-max) or ``(None, max |x|)`` (absmax): ``[B, h, T, D/g]`` on the
    token axis, ``[B, h, n_groups, D]`` on the channel axis."""
    B, h, T, D = xf.shape
    if axis == "token":
        g = channel_group_size(group_size, D)
        xg = xf.reshape(B, h, T, D // g, g)
        if symmetric:
            return None, xg.abs().amax(dim=-1)
        return xg.amin(dim=-1), xg.amax(dim=-1)
    if axis != "channel":
        raise ValueError(f"unknown quantization axis {axis!r}; expected 'token' or 'channel'")
    if not 0 <= start_offset < group_size:
        raise ValueError(f"start_offset {start_offset} outside [0, {group_size})")
    n_groups = -(-(start_offset + T) // group_size)
    back = n_groups * group_size - start_offset - T
    if symmetric:
        a = torch.nn.functional.pad(xf.abs(), (0, 0, start_offset, back), value=0.0)
        return None, a.reshape(B, h, n_groups, group_size, D).amax(dim=3)
    lo = torch.nn.functional.pad(xf, (0, 0, start_offset, back), value=float("inf"))
    hi = torch.nn.functional.pad(xf, (0, 0, start_offset, back), value=float("-inf"))
    return (lo.reshape(B, h, n_groups, group_size, D).amin(dim=3),
            hi.reshape(B, h, n_groups, group_size, D).amax(dim=3))


def _per_value(t: torch.Tensor, group_size: int, axis: str, start_offset: int, shape) -> torch.Tensor:
    """A per-group tensor broadcast to the values ``[B, h, T, D]`` (token axis: ``[..., D/g, 1]``
    against ``[..., D/g, g]`` groups, flattened back)."""
    B, h, T, D = shape
    if axis == "token":
        g = channel_group_size(group_size, D)
        return t.unsqueeze(-1).expand(B, h, T, D // g, g).reshape(B, h, T, D)
    return _expand_groups(t, group_size, start_offset, T)


def _quantize_format(x: torch.Tensor, fmt: Format, group_size: int, axis: str, start_offset: int):
    """:func:`quantize` for a non-v1 format: scales in the format's dtype, codes to the nearest level."""
    qmax = (1 << fmt.bits) - 1
    xf = x.float()
    sym = fmt.spec.symmetric
    scale, zero = group_scales(xf, fmt.bits, group_size, axis, start_offset, fmt)
    s = _per_value(scale.float(), group_size, axis, start_offset, xf.shape)
    u = xf if sym else xf - _per_value(zero.float(), group_size, axis, start_offset, xf.shape)
    u = u / torch.where(s > 0, s, torch.ones_like(s))  # [B, h, T, D] in level units
    L = fmt.level_units(x.device)
    if L is None:  # uniform min-max levels L[c] = c
        codes = torch.round(u).clamp_(0, qmax)
    else:
        mids = (L[1:] + L[:-1]) / 2
        if fmt.bits <= 4:
            # nearest level = number of midpoints below u (torch.bucketize's count, 3-6x faster at <= 15
            # midpoints; 0-d tensor operands, no host sync on CUDA); a value on a midpoint goes to the
            # lower level, as bucketize puts it
            codes = (u > mids[0]).to(torch.uint8)
            for j in range(1, mids.shape[0]):
                codes += u > mids[j]
        else:
            codes = torch.bucketize(u, mids)
    codes = codes.to(torch.uint8).masked_fill_(s <= 0, 0)
    return pack_codes(codes, fmt.bits), scale, zero


def _expand_groups(t: torch.Tensor, group_size: int, start_offset: int, T: int) -> torch.Tensor:
    """``[B, h, n_groups, D]`` per-group tensor to ``[B, h, T, D]`` per token."""
    return t.repeat_interleave(group_size, dim=2)[:, :, start_offset : start_offset + T]


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
    fmt: Format | None = None,
) -> torch.Tensor:
    """Unpack and dequantize back to ``[B, h, T, D]`` in ``dtype``."""
    B, h, T = packed.shape[:3]
    out = torch.empty(B, h, T, head_dim, dtype=torch.float32, device=packed.device)
    dequantize_into(out, packed, scale, zero, bits, group_size, axis, head_dim, start_offset, fmt)
    return out if dtype == torch.float32 else out.to(dtype)


def dequantize_into(
    out: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    group_size: int,
    axis: str,
    head_dim: int,
    start_offset: int = 0,
    fmt: Format | None = None,
) -> torch.Tensor:
    """:func:`dequantize` written into ``out [B, h, T, D]`` (any float dtype); returns ``out``.

    ``out`` may be a view into a larger buffer (e.g. a token range of a ``[B, H, T_all, D]``
    cache read) as long as its last dimension is contiguous. The arithmetic is the same as
    :func:`dequantize` (fp32 ``code * scale + zero``, then rounded to ``out.dtype``); an fp32
    ``out`` is filled in place: codes are unpacked straight into it and the affine map runs
    in place, so no full-size temporaries are made. ``fmt``: see :func:`quantize`; a codebook
    costs nothing extra at 2 bits (the byte table holds levels instead of codes) and one gather
    otherwise; a symmetric scaling (``zero is None``) skips the zero-point pass.
    """
    if axis not in ("token", "channel"):
        raise ValueError(f"unknown quantization axis {axis!r}")
    if out.dtype != torch.float32 or out.stride(-1) != 1:
        tmp = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        dequantize_into(tmp, packed, scale, zero, bits, group_size, axis, head_dim, start_offset, fmt)
        return out.copy_(tmp)
    B, h, T, D = out.shape
    levels = None if fmt is None else fmt.level_units(out.device)
    if bits == 2 and D % 4 == 0 and out.is_contiguous():
        # 2 bits: one table lookup per byte writes its four codes (or levels) as floats straight into
        # out (1.3-1.5x faster than the shift passes below on one CPU thread; at 4 bits it is slower)
        idx = packed.to(torch.int32).reshape(-1)
        table = _byte_codes(bits, out.device) if levels is None else _byte_levels(fmt, out.device)
        torch.index_select(table, 0, idx, out=out.view(-1, 4))
    elif levels is not None:
        codes = unpack_codes(packed, bits, D).reshape(-1).to(torch.int32)
        if out.is_contiguous():
            torch.index_select(levels, 0, codes, out=out.view(-1))
        else:
            out.copy_(levels[codes].view(out.shape))
    else:
        # uint8 codes (interleaved in uint8, cheap), then one contiguous uint8 -> float conversion:
        # ~17% faster at 2 bits than converting each code position into a stride-4 column of out
        out.copy_(unpack_codes(packed, bits, D))
    if axis == "token":
        g = channel_group_size(group_size, D)
        o = out.unflatten(-1, (D // g, g))
        # two in-place passes with one broadcast operand each run vectorized; a single addcmul
        # broadcasting both scale and zero along the innermost dim does not
        o.mul_(scale.float().unsqueeze(-1))
        if zero is not None:
            o.add_(zero.float().unsqueeze(-1))
        return out
    # channel axis: a partial first group, whole groups, a partial last group; each part is one
    # broadcast addcmul on a view of out (no per-token expansion of the scales)
    sf = scale.float()  # [B, h, n_groups, D]
    zf = None if zero is None else zero.float()

    def affine(o, g0, g1, unsqueeze):
        s_, z_ = sf[:, :, g0:g1], None if zf is None else zf[:, :, g0:g1]
        if unsqueeze:
            s_, z_ = s_.unsqueeze(3), None if z_ is None else z_.unsqueeze(3)
        if z_ is None:
            o.mul_(s_)
        elif levels is not None:  # two roundings, as the Triton kernel: addcmul fuses them (integer codes
            o.mul_(s_).add_(z_)  # times an fp16 scale are exact either way, codebook levels are not)
        else:
            torch.addcmul(z_, o, s_, out=o)

    t0 = gi = 0
    if start_offset:
        n = min(T, group_size - start_offset)
        affine(out[:, :, :n], 0, 1, False)
        t0, gi = n, 1
    n_whole = (T - t0) // group_size
    if n_whole:
        affine(out[:, :, t0 : t0 + n_whole * group_size].unflatten(2, (n_whole, group_size)), gi, gi + n_whole, True)
        t0, gi = t0 + n_whole * group_size, gi + n_whole
    if t0 < T:
        affine(out[:, :, t0:], gi, gi + 1, False)
    return out
