"""Storage units of the quantized cache.

One cache layer keeps, for Keys and for Values separately, a list of :class:`Segment`
(a run of consecutive committed tokens of one modality) followed by a full-precision
residual. A segment splits the layer's KV heads into :class:`PackedBlock` s, one per
distinct quantizer setting, so heads of one layer can have different bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..kernels import FULL_PRECISION_BITS
from ..kernels import dequantize as _dequantize
from ..kernels import dequantize_into as _dequantize_into
from ..kernels import quantize as _quantize


@dataclass
class PackedBlock:
    """Tokens ``[start, start + length)`` of some KV heads of one layer, one kind (K or V).

    Quantized (``bits < 16``): ``codes uint8 [B, h, T, packed_row_bytes(D, bits)]`` and
    fp16 ``scale`` / ``zero`` laid out as in :mod:`kvplan.kernels.reference`.
    Full precision (``bits == 16``): ``codes`` is the tensor ``[B, h, T, D]`` itself
    (in the cache's storage dtype); ``scale`` and ``zero`` are ``None``.
    """

    heads: tuple[int, ...]  # physical KV head indices of this layer, ascending
    bits: int
    axis: str  # "token" | "channel"
    group_size: int
    start_offset: int  # channel axis: position of the first token inside its aligned group
    length: int
    head_dim: int
    codes: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None

    @classmethod
    def encode(cls, x: torch.Tensor, heads, bits, axis, group_size, start: int) -> "PackedBlock":
        """Quantize ``x [B, h, T, D]`` (tokens starting at absolute position ``start``)."""
        T, D = x.shape[-2], x.shape[-1]
        offset = start % group_size if axis == "channel" else 0
        if bits == FULL_PRECISION_BITS:
            return cls(tuple(heads), bits, axis, group_size, 0, T, D, x.contiguous())
        codes, scale, zero = _quantize(x, bits, group_size, axis, offset)
        return cls(tuple(heads), bits, axis, group_size, offset, T, D, codes, scale, zero)

    def decode(self, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized tokens ``[B, h, T, D]`` in ``dtype``."""
        if self.bits == FULL_PRECISION_BITS:
            return self.codes.to(dtype)
        return _dequantize(
            self.codes, self.scale, self.zero, self.bits, self.group_size, self.axis,
            self.head_dim, self.start_offset, dtype,
        )

    def decode_into(self, out: torch.Tensor) -> torch.Tensor:
        """Write the dequantized tokens into ``out [B, h, T, D]`` (a view into a read buffer)."""
        if self.bits == FULL_PRECISION_BITS:
            return out.copy_(self.codes)
        return _dequantize_into(out, self.codes, self.scale, self.zero, self.bits, self.group_size, self.axis,
                                self.head_dim, self.start_offset)

    def head_view(self, i: int) -> "PackedBlock":
        """The ``i``-th of this block's heads alone (views of the stored tensors, no copy)."""
        def one(t):
            return None if t is None else t[:, i : i + 1]
        return replace(self, heads=(self.heads[i],), codes=one(self.codes), scale=one(self.scale),
                       zero=one(self.zero))

    def append(self, other: "PackedBlock") -> None:
        """Extend this block in place with the next tokens of the same heads and settings.

        For the channel axis ``other`` must start on a group boundary (commits always end
        on one), so the per-group scales simply concatenate.
        """
        assert other.heads == self.heads and other.bits == self.bits and other.axis == self.axis
        assert self.axis != "channel" or other.start_offset == 0
        self.codes = torch.cat([self.codes, other.codes], dim=2)
        if self.scale is not None:
            self.scale = torch.cat([self.scale, other.scale], dim=2)
            self.zero = torch.cat([self.zero, other.zero], dim=2)
        self.length += other.length

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scale, self.zero) if t is not None]

    def nbytes_parts(self) -> dict[str, int]:
        """Bytes actually held, split into ``payload`` (codes or fp tensor) and ``scales_zeros``."""
        sz = 0 if self.scale is None else self.scale.nbytes + self.zero.nbytes
        return {"payload": self.codes.nbytes, "scales_zeros": sz}

    def map_tensors(self, fn) -> None:
        """Apply ``fn`` to every stored tensor (batch dim first), e.g. for beam reordering."""
        self.codes = fn(self.codes)
        if self.scale is not None:
            self.scale = fn(self.scale)
            self.zero = fn(self.zero)


@dataclass
class Segment:
    """A run of committed tokens of one modality: ``[start, start + length)``."""

    modality: str
    start: int
    length: int
    blocks: list[PackedBlock] = field(default_factory=list)
