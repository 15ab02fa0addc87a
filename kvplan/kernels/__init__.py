"""Quantize / pack / dequantize and decode attention over packed blocks behind one dispatcher.

Each op has a PyTorch reference (``reference.py``) and a Triton kernel with the same
signature (``triton_kernels.py``). CUDA tensors go to Triton when it imports; everything
else goes to the reference. Triton is imported lazily, so CPU-only installs work.
Set ``KVPLAN_DISABLE_TRITON=1`` to force the reference everywhere. Decode attention on the CPU
has native C loops (``attention_native.py``) besides the chunked PyTorch kernel;
``KVPLAN_DISABLE_NATIVE=1`` turns them off.
"""

from __future__ import annotations

import functools
import os

import torch

from . import reference
from .qtypes import FULL_PRECISION_BITS, GROUP_SIZES, QTYPES, SUPPORTED_BITS, packed_row_bytes, qtype

__all__ = [
    "FULL_PRECISION_BITS",
    "decode_attention",
    "decode_attention_kernel",
    "native_unavailable",
    "GROUP_SIZES",
    "QTYPES",
    "SUPPORTED_BITS",
    "dequantize",
    "dequantize_into",
    "packed_row_bytes",
    "qtype",
    "quantize",
    "triton_available",
]


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when the Triton kernels can be imported (Triton installed and importable)."""
    if os.environ.get("KVPLAN_DISABLE_TRITON") == "1":
        return False
    try:
        from . import triton_kernels  # noqa: F401
    except Exception:  # ImportError, or a broken Triton install
        return False
    return True


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_available()


def quantize(x, bits, group_size, axis, start_offset=0, range_flag=None, fmt=None):
    """Quantize ``x [B, h, T, D]`` to ``(packed codes, scale, zero)``; see ``reference`` for layout.

    Values outside the fp16 range of the scales raise ``ValueError``; with ``range_flag`` (int32
    ``[1]`` on ``x``'s device) the Triton kernel raises the flag instead, without a host sync,
    for the caller to check later (the reference always checks at once). ``fmt``: a
    :class:`~kvplan.kernels.formats.Format` other than v1 is encoded by the PyTorch reference on
    every device (the Triton encode kernels write the v1 format only).
    """
    if fmt is not None and not fmt.legacy:
        return reference.quantize(x, bits, group_size, axis, start_offset, fmt)
    if _use_triton(x):
        from . import triton_kernels

        return triton_kernels.quantize(x, bits, group_size, axis, start_offset, range_flag=range_flag)
    return reference.quantize(x, bits, group_size, axis, start_offset)


def dequantize(packed, scale, zero, bits, group_size, axis, head_dim, start_offset=0, dtype=torch.float16,
               fmt=None):
    """Unpack and dequantize to ``[B, h, T, D]`` in ``dtype`` (``fmt``: see :func:`quantize`)."""
    if _use_triton(packed):
        from . import triton_kernels

        return triton_kernels.dequantize(packed, scale, zero, bits, group_size, axis, head_dim, start_offset, dtype,
                                         fmt)
    return reference.dequantize(packed, scale, zero, bits, group_size, axis, head_dim, start_offset, dtype, fmt)


def dequantize_into(out, packed, scale, zero, bits, group_size, axis, head_dim, start_offset=0, fmt=None):
    """:func:`dequantize` written into ``out [B, h, T, D]`` (may be a view into a larger buffer)."""
    if _use_triton(packed):
        return out.copy_(dequantize(packed, scale, zero, bits, group_size, axis, head_dim, start_offset, out.dtype,
                                    fmt))
    return reference.dequantize_into(out, packed, scale, zero, bits, group_size, axis, head_dim, start_offset, fmt)


def decode_attention(q, key_blocks, value_blocks, key_residual, value_residual, attn_mask=None, sm_scale=None):
    """Decode attention over packed blocks + residual: ``q [B, Hq, Tq, D]`` -> ``[B, Hq, Tq, D]``.

    The fused Triton kernel for CUDA tensors when Triton imports
    (``triton_kernels.packed_decode_attention``); on the CPU the native kernel
    (``attention_native.native_decode_attention``, C loops built at first use) when it builds
    here and serves the head_dim, else the chunked PyTorch kernel
    (``attention_chunked.chunked_decode_attention``: dequantize a cache-sized chunk, attend,
    next chunk), with a warning saying why. ``attention_reference.reference_decode_attention``
    is the test oracle.
    """
    return decode_attention_kernel(q.is_cuda, q.shape[-1])(q, key_blocks, value_blocks, key_residual,
                                                           value_residual, attn_mask, sm_scale)


def decode_attention_kernel(cuda: bool, head_dim: int | None = None):
    """The decode-attention function for CUDA (``True``) or CPU tensors of this ``head_dim``
    (``None``: not known yet; the native kernel checks it per call)."""
    if cuda and triton_available():
        from .triton_kernels import packed_decode_attention

        return packed_decode_attention
    if not cuda:
        why = native_unavailable(head_dim)
        if why is None:
            from .attention_native import native_decode_attention

            return native_decode_attention
        _warn_chunked_once(why)
    else:
        _warn_chunked_once("Triton cannot be imported", "the fused Triton CUDA decode attention")
    from .attention_chunked import chunked_decode_attention

    return chunked_decode_attention


def native_unavailable(head_dim: int | None = None) -> str | None:
    """Why the native CPU decode attention cannot run here (``None``: it can). Builds it on first call."""
    if os.environ.get("KVPLAN_DISABLE_NATIVE") == "1":
        return "KVPLAN_DISABLE_NATIVE=1"
    from .attention_native import native_supports
    from .native_build import NativeUnavailable, native_library

    why = None if head_dim is None else native_supports(head_dim)
    if why is not None:
        return why
    try:
        native_library()
    except NativeUnavailable as e:
        return str(e)
    return None


@functools.lru_cache(maxsize=None)
def _warn_chunked_once(why: str, kernel: str = "the native CPU decode attention") -> None:
    import warnings

    warnings.warn(f"kvplan: {kernel} is not available ({why}); using the chunked PyTorch kernel, which is "
                  "slower", RuntimeWarning, stacklevel=3)
