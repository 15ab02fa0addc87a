"""Error-feedback encoding (GPTQ / OBQ-style) of slot codes: same format, same bytes, better codes.

Rounding each coordinate of a KV vector to its nearest level ignores what reads the vector. The
error of a key is seen through queries (logit error ``qᵀ e``), the error of a value through the
output projection (``W_o e``): both are quadratic forms ``eᵀ M e`` with a per-head metric ``M
[D, D]`` (the plan's ``feedback_metric``, in the slots' stored frame). Encoding coordinates one by
one and pushing each one's rounding error onto the coordinates not yet coded, along ``M⁻¹``
(Frantar et al., GPTQ; its Cholesky form), lowers ``eᵀ M e`` at the same bits.

Only the encoder changes: the scales / zero-points are the format's, computed from the vector as
written (so the byte count and every decode route stay as they are); the codes are the ones
error feedback picks among that format's levels. Coordinates are coded in decreasing order of
``diag(M)`` (GPTQ's act-order). The scales are the format's (:func:`kvplan.kernels.reference.
group_scales`, or Triton's v1 encoder :func:`kvplan.kernels.quantize` on CUDA); the codes come from
a loop over the coordinates: on the CPU the native C loop (``kvp_feedback_codes`` in
``kernels/native/attention_cpu.c``: eight tokens at once, one per SIMD lane) when the native kernels
build here (as the decode attention, :func:`kvplan.kernels.native_unavailable`), on CUDA the Triton
kernel (:func:`kvplan.kernels.triton_kernels.feedback_codes`: one program per block of tokens of a
head, the loop in registers; checked under Triton's interpreter, not yet compiled on a GPU). Both give
the same codes bit for bit as the loop in PyTorch
(:func:`torch_feedback_codes`, the loop in :func:`_torch_codes`: D steps of tensor ops per block), which
runs where neither is available and is their test oracle. Cost: ``bench/results/feedback_cost.md``.
"""

from __future__ import annotations

import ctypes

import torch

from . import native_unavailable, quantize, triton_available
from .formats import Format
from .reference import _per_value, group_scales, pack_codes


def feedback_factors(metric: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head ``(U, order)`` from metrics ``[h, D, D]`` (symmetric positive definite):
    ``order [h, D]`` codes coordinates by decreasing diagonal, ``U [h, D, D]`` fp32 is the upper
    Cholesky factor of the inverse of the metric permuted to that order."""
    m = metric.double()
    order = torch.argsort(-torch.diagonal(m, dim1=-2, dim2=-1), dim=-1, stable=True)  # [h, D]
    m = torch.gather(torch.gather(m, -2, order.unsqueeze(-1).expand_as(m)), -1, order.unsqueeze(-2).expand_as(m))
    factor = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(m)), upper=True)
    return factor.float(), order


def quantize_with_feedback(x: torch.Tensor, bits: int, group_size: int, axis: str, start_offset: int,
                           factor: torch.Tensor, order: torch.Tensor, range_flag: torch.Tensor | None = None,
                           fmt: Format | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`kvplan.kernels.quantize` of ``x [B, h, T, D]`` (in the stored frame) with codes chosen
    by error feedback under ``(factor, order)`` of :func:`feedback_factors` (one per head of
    ``x``); same ``(packed codes, scale, zero)`` layout and scales."""
    if x.is_cuda and (fmt is None or fmt.legacy):  # the device's v1 encoder (Triton: raises range_flag, no sync)
        _, scale, zero = quantize(x, bits, group_size, axis, start_offset, range_flag, fmt)
    else:  # the reference's scales (every device encodes other formats so), without its nearest-level codes
        scale, zero = group_scales(x, bits, group_size, axis, start_offset, fmt)
    s, z, levels, mids = loop_inputs(scale, zero, bits, group_size, axis, start_offset, x.shape, fmt)
    if x.device.type == "cpu" and native_unavailable(x.shape[-1]) is None:
        codes = _native_codes(x.float(), s, z, order, levels, mids, factor)
    elif x.is_cuda and triton_available():
        from .triton_kernels import feedback_codes

        codes = feedback_codes(x, s, z, order, levels, mids, factor)
    else:
        codes = torch_feedback_codes(x, s, z, order, levels, mids, factor)
    return pack_codes(codes, bits), scale, zero


def loop_inputs(scale: torch.Tensor, zero: torch.Tensor | None, bits: int, group_size: int, axis: str,
                start_offset: int, shape: torch.Size, fmt: Format | None = None):
    """What the coding loop reads besides the values: ``(s, z, levels, mids)``, the scale and
    zero-point (or ``None``) of every value (fp32 ``[B, h, T, D]``), the format's level units (code
    ``c`` reads ``levels[c] * s (+ z)``) and the midpoints between them."""
    levels = None if fmt is None or fmt.legacy else fmt.level_units(scale.device)
    if levels is None:  # uniform min-max levels: code c reads c * scale + zero
        levels = torch.arange(1 << bits, dtype=torch.float32, device=scale.device)
    mids = (levels[1:] + levels[:-1]) / 2
    s = _per_value(scale.float(), group_size, axis, start_offset, shape)  # [B, h, T, D]
    z = None if zero is None else _per_value(zero.float(), group_size, axis, start_offset, shape)
    return s, z, levels, mids


def torch_feedback_codes(x, s, z, order, levels, mids, factor) -> torch.Tensor:
    """The coding loop in PyTorch on ``x, s, z [B, h, T, D]`` (values, their scales and zero-points, as
    :func:`loop_inputs` gives them) in the channels' own order: uint8 codes ``[B, h, T, D]``. The
    native and Triton loops' test oracle."""
    B, h, T, D = x.shape
    idx = order.view(1, h, 1, D).expand(B, h, T, D)

    def coordinate_major(t: torch.Tensor) -> torch.Tensor:  # [B, h, T, D] -> [D, B, h, T] in coding order
        return torch.gather(t, -1, idx).permute(3, 0, 1, 2).contiguous()

    codes = _torch_codes(coordinate_major(x.float()), coordinate_major(s),
                         None if z is None else coordinate_major(z), levels, mids, factor)
    return torch.empty(B, h, T, D, dtype=torch.uint8, device=x.device).scatter_(-1, idx, codes.permute(1, 2, 3, 0))


def _native_codes(x, s, z, order, levels, mids, factor) -> torch.Tensor:
    """The coding loop in C on ``x, s, z [B, h, T, D]`` (values, their scales and zero-points) in the
    channels' own order: uint8 codes ``[B, h, T, D]`` (see :func:`_torch_codes`)."""
    from .native_build import native_library

    B, h, T, D = x.shape
    x, s = x.contiguous(), s.contiguous()
    z = None if z is None else z.contiguous()
    f = factor.float().contiguous()
    o = order.to(torch.int64).contiguous()
    lv, md = levels.float().contiguous(), mids.float().contiguous()
    codes = torch.empty(x.shape, dtype=torch.uint8)

    def ptr(t):
        return ctypes.c_void_p(t.data_ptr()) if t is not None else None

    native_library().kvp_feedback_codes(D, B * h * T, h, T, ptr(x), ptr(s), ptr(z), ptr(o), ptr(lv), ptr(md),
                                        md.numel(), ptr(f), ptr(codes))
    return codes


def _torch_codes(xs, s, z, levels, mids, factor) -> torch.Tensor:
    """The coding loop in PyTorch: uint8 codes ``[D, B, h, T]`` of ``xs [D, B, h, T]`` (coding order,
    consumed), scales ``s`` and zero-points ``z`` per value, under ``factor [h, D, D]``."""
    D, _, h, _ = xs.shape
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.empty(xs.shape, dtype=torch.long, device=xs.device)
    diag = torch.diagonal(factor, dim1=-2, dim2=-1).T.reshape(D, 1, h, 1)
    push = factor.permute(2, 1, 0).reshape(D, D, 1, h, 1)  # push[j, d] = factor[:, d, j]
    for d in range(D):
        u = xs[d] if z is None else xs[d] - z[d]
        c = torch.bucketize(u / safe[d], mids)
        codes[d] = c
        if d + 1 == D:
            break
        # what every route decodes (a zero scale reads the zero-point whatever the code)
        read = levels[c] * s[d] if z is None else levels[c] * s[d] + z[d]
        err = (xs[d] - read) / diag[d]  # [B, h, T]
        xs[d + 1:] -= push[d + 1:, d] * err
    return codes.masked_fill_(s <= 0, 0).to(torch.uint8)
