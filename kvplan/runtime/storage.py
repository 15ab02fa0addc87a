"""Storage units of the quantized cache.

One cache layer keeps, for Keys and for Values separately, a list of :class:`Segment`
(a run of consecutive committed tokens of one modality) followed by a full-precision
residual. A segment splits the layer's KV heads into :class:`PackedBlock` s, one per
distinct quantizer setting, so heads of one layer can have different bits.

Key correction (HeadQ-style): a quantized key block may carry ``correction``, a nested
channel-axis block holding ``ẑ ≈ Uᵀ (k - k̂)`` per token ``[B, h, T, r]`` in the same token
groups, and ``basis`` ``U [h, D, r]`` (from the plan). Reads return ``k̂ + U ẑ``.

Rotations (``quantizer.rotation`` / ``key_pre_rope``, :mod:`kvplan.kernels.rotation`): a
quantized block may carry ``rotation``; its codes then hold ``forward(x, position)`` and reads
return ``inverse(x̂, position)``, ``position`` being the cache index of the block's first token.
The key correction, when present, codes the error left after the inverse rotation.

The residual (:class:`Residual`): the newest tokens of one kind not committed yet, held as
written or -- ``quantizer.residual_bits`` 8 / 4 -- as per-token codes once their first forward is
over, until their group commits.

Growth: a committed block is extended in place by :meth:`PackedBlock.append`. Its tensors are
views of the first ``length`` tokens of capacity buffers that grow by 1.5x when full, so a
commit copies only its own tokens (amortised O(1) per token, not the whole history again).
Bytes are counted as stored (the views): ``nbytes_parts`` is what the plan's bpv promises; the
allocation behind them holds at most 50% more tokens than are stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..kernels import FULL_PRECISION_BITS
from ..kernels import dequantize as _dequantize
from ..kernels import dequantize_into as _dequantize_into
from ..kernels import quantize as _quantize
from ..kernels.feedback import quantize_with_feedback
from ..kernels.formats import Format
from ..kernels.rotation import Rotation
from ..plans import STREAMED


@dataclass
class PackedBlock:
    """Tokens ``[start, start + length)`` of some KV heads of one layer, one kind (K or V).

    Quantized (``bits < 16``): ``codes uint8 [B, h, T, packed_row_bytes(D, bits)]`` and
    ``scale`` / ``zero`` laid out as in :mod:`kvplan.kernels.reference`, in the dtypes of the
    block's slot format ``fmt`` (:mod:`kvplan.kernels.formats`; ``None`` = the v1 format: fp16
    scale and zero, uniform codes); ``zero`` is ``None`` for a symmetric format.
    Full precision (``bits == 16``): ``codes`` is the tensor ``[B, h, T, D]`` itself
    (in the cache's storage dtype); ``scale`` and ``zero`` are ``None``. A streamed head's tokens
    (``bits == 0``, ``plans.STREAMED``): ``codes`` is an empty ``[B, h, T, 0]``; nothing is stored and
    every attention route masks those positions off (reads decode zeros).
    With a key correction, ``correction`` is the code block ``[B, h, T, r]`` and ``basis``
    the fp32 ``[h, D, r]`` it is read through (see the module docstring).
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
    correction: "PackedBlock | None" = None  # key correction code [B, h, T, r]
    basis: torch.Tensor | None = None  # fp32 [h, D, r], read-only (the plan's, not cache bytes)
    position: int = 0  # cache index of the first token (what a rotation is keyed on)
    rotation: Rotation | None = None  # codes hold rotation.forward(x) (plan constant, not cache bytes)
    fmt: Format | None = None  # the slot format (None: v1)
    # capacity buffers behind codes / scale / zero once the block has been appended to (not
    # copied by dataclasses.replace: views made by token_range / head_range never grow)
    _buffers: dict = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def encode(cls, x: torch.Tensor, heads, bits, axis, group_size, start: int, basis: torch.Tensor | None = None,
               correction_bits: int = 4, rotation: Rotation | None = None,
               range_flag: torch.Tensor | None = None, fmt: Format | None = None,
               feedback: tuple[torch.Tensor, torch.Tensor] | None = None, grid_origin: int = 0) -> "PackedBlock":
        """Quantize ``x [B, h, T, D]`` (tokens starting at absolute position ``start``).

        With ``rotation`` the codes hold ``rotation.forward(x, start)`` (full-precision blocks
        are stored as they are). With ``basis`` (``[h, D, r]``, channel axis only) the block
        also stores the key correction: ``Uᵀ (x - x̂)`` quantized at ``correction_bits`` in the
        same token groups, ``x̂`` being the read after the inverse rotation. ``range_flag``: see
        :func:`kvplan.kernels.quantize` (CUDA: the fp16-range check without a host sync).
        ``fmt``: the slot format (default v1; the correction code is always v1). ``feedback``:
        ``(U [h, D, D], order [h, D])`` of :func:`kvplan.kernels.feedback.feedback_factors`: the
        codes are chosen by error feedback (same scales and bytes; None: nearest level).
        ``grid_origin``: channel-axis token groups are aligned to ``grid_origin + k * group_size``
        (``KVPlanCache.grid_origin``; 0 unless a batch is left-padded).
        """
        T, D = x.shape[-2], x.shape[-1]
        if bits == STREAMED:  # a streamed head's tokens: nothing stored (reads are masked off)
            return cls(tuple(heads), bits, axis, group_size, 0, T, D,
                       x.new_empty((*x.shape[:2], T, 0), dtype=torch.uint8), position=start)
        offset = (start - grid_origin) % group_size if axis == "channel" else 0
        if bits == FULL_PRECISION_BITS:  # a copy of its own: x may be a view of a larger buffer (the residual)
            owned = x.contiguous()
            if owned.untyped_storage().nbytes() != owned.nbytes:
                owned = owned.clone()
            return cls(tuple(heads), bits, axis, group_size, 0, T, D, owned, position=start)
        fmt = None if fmt is None or fmt.legacy else fmt
        stored = x if rotation is None else rotation.forward(x, start)  # [B, h, T, D] in the stored frame
        if feedback is None:
            codes, scale, zero = _quantize(stored, bits, group_size, axis, offset, range_flag, fmt)
        else:
            codes, scale, zero = quantize_with_feedback(stored, bits, group_size, axis, offset, *feedback,
                                                        range_flag=range_flag, fmt=fmt)
        block = cls(tuple(heads), bits, axis, group_size, offset, T, D, codes, scale, zero, position=start,
                    rotation=rotation, fmt=fmt)
        if basis is not None:
            if axis != "channel":
                raise ValueError("the key correction needs channel-axis blocks")
            err = x.float() - block._decode_base(torch.float32)  # [B, h, T, D]
            z = torch.matmul(err, basis)  # [B, h, T, r]
            block.correction = cls.encode(z, heads, correction_bits, "channel", group_size, start,
                                          range_flag=range_flag, grid_origin=grid_origin)
            block.basis = basis
        return block

    def _decode_base(self, dtype: torch.dtype) -> torch.Tensor:
        """The quantized tokens read back (inverse rotation applied), without the correction."""
        if self.rotation is None:
            return _dequantize(self.codes, self.scale, self.zero, self.bits, self.group_size, self.axis,
                               self.head_dim, self.start_offset, dtype, self.fmt)
        y = _dequantize(self.codes, self.scale, self.zero, self.bits, self.group_size, self.axis, self.head_dim,
                        self.start_offset, torch.float32, self.fmt)
        return self.rotation.inverse(y, self.position).to(dtype)

    def _correction_term(self) -> torch.Tensor:
        """``U ẑ`` per token: fp32 ``[B, h, T, D]``."""
        return torch.matmul(self.correction.decode(torch.float32), self.basis.transpose(-1, -2))

    def decode(self, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized tokens ``[B, h, T, D]`` in ``dtype`` (zeros for a streamed head's: never attended)."""
        if self.bits == STREAMED:
            return self.codes.new_zeros((*self.codes.shape[:3], self.head_dim), dtype=dtype)
        if self.bits == FULL_PRECISION_BITS:
            return self.codes.to(dtype)
        if self.correction is None:
            return self._decode_base(dtype)
        return (self._decode_base(torch.float32) + self._correction_term()).to(dtype)

    def stored_into(self, out: torch.Tensor) -> torch.Tensor:
        """The stored codes dequantized as stored, into ``out [B, h, T, D]``: in the rotated frame
        when ``rotation`` is set and without the key correction (what the decode-attention
        kernels read; they apply the rest on the query / output side or per tile)."""
        if self.bits == STREAMED:
            return out.zero_()
        if self.bits == FULL_PRECISION_BITS:
            return out.copy_(self.codes)
        return _dequantize_into(out, self.codes, self.scale, self.zero, self.bits, self.group_size, self.axis,
                                self.head_dim, self.start_offset, self.fmt)

    def decode_into(self, out: torch.Tensor) -> torch.Tensor:
        """Write the dequantized tokens into ``out [B, h, T, D]`` (a view into a read buffer)."""
        if self.bits == STREAMED:
            return out.zero_()
        if self.bits == FULL_PRECISION_BITS:
            return out.copy_(self.codes)
        if self.rotation is not None or (self.correction is not None and out.dtype != torch.float32):
            # rotate back / add the correction in fp32, round to out's dtype once
            return out.copy_(self.decode(torch.float32))
        _dequantize_into(out, self.codes, self.scale, self.zero, self.bits, self.group_size, self.axis,
                         self.head_dim, self.start_offset, self.fmt)
        if self.correction is not None:
            out.add_(self._correction_term())
        return out

    def head_range(self, i0: int, i1: int) -> "PackedBlock":
        """This block's heads ``i0 .. i1 - 1`` (positions in ``heads``) alone: views, no copy."""
        def part(t):
            return None if t is None else t[:, i0:i1]
        return replace(self, heads=self.heads[i0:i1], codes=part(self.codes), scale=part(self.scale),
                       zero=part(self.zero),
                       correction=None if self.correction is None else self.correction.head_range(i0, i1),
                       basis=None if self.basis is None else self.basis[i0:i1])

    def head_runs(self):
        """``(h0, h1, block)`` for each maximal run of consecutive physical heads ``h0 .. h1 - 1``."""
        i0 = 0
        for i in range(1, len(self.heads) + 1):
            if i == len(self.heads) or self.heads[i] != self.heads[i - 1] + 1:
                yield self.heads[i0], self.heads[i - 1] + 1, (self if i0 == 0 and i == len(self.heads)
                                                               else self.head_range(i0, i))
                i0 = i

    def token_range(self, a: int, b: int) -> "PackedBlock":
        """Tokens ``a .. b - 1`` of this block alone (views of the stored tensors, no copy).

        Channel axis: ``a`` must be 0 or sit on a group boundary (``(start_offset + a) %
        group_size == 0``) so the range owns whole per-group scales from its start.
        """
        if not 0 <= a < b <= self.length:
            raise ValueError(f"token range [{a}, {b}) outside the block's {self.length} tokens")
        if a == 0 and b == self.length:
            return self
        codes = self.codes[:, :, a:b]
        position = self.position + a
        if self.bits in (FULL_PRECISION_BITS, STREAMED):
            return replace(self, codes=codes, length=b - a, position=position)
        if self.correction is not None:
            return replace(replace(self, correction=None).token_range(a, b),
                           correction=self.correction.token_range(a, b), basis=self.basis)
        if self.axis == "token":
            return replace(self, codes=codes, scale=self.scale[:, :, a:b], zero=_rows(self.zero, a, b),
                           length=b - a, position=position)
        first = self.start_offset + a
        if a and first % self.group_size:
            raise ValueError(f"channel-axis token range must start on a group boundary (token {a}, offset "
                             f"{self.start_offset}, group {self.group_size})")
        g0, g1 = first // self.group_size, -(-(self.start_offset + b) // self.group_size)
        return replace(self, codes=codes, scale=self.scale[:, :, g0:g1], zero=_rows(self.zero, g0, g1),
                       start_offset=first % self.group_size, length=b - a, position=position)

    def token_chunks(self, chunk_tokens: int):
        """``(a, b, block)`` covering the tokens in order, ``chunk_tokens`` (a multiple of the
        group size) at a time; chunk ends fall on group boundaries for the channel axis."""
        if chunk_tokens % self.group_size:
            raise ValueError(f"chunk_tokens {chunk_tokens} is not a multiple of group size {self.group_size}")
        a = 0
        end = chunk_tokens - self.start_offset
        while a < self.length:
            b = min(end, self.length)
            yield a, b, self.token_range(a, b)
            a, end = b, end + chunk_tokens

    def append(self, other: "PackedBlock") -> None:
        """Extend this block in place with the next tokens of the same heads and settings.

        For the channel axis ``other`` must start on a group boundary (commits always end
        on one), so the per-group scales simply concatenate.
        """
        assert other.heads == self.heads and other.bits == self.bits and other.axis == self.axis
        assert other.fmt == self.fmt
        assert self.axis != "channel" or other.start_offset == 0
        assert (self.correction is None) == (other.correction is None)
        assert (self.rotation is None) == (other.rotation is None)
        assert self.rotation is None or other.position == self.position + self.length, "tokens must follow on"
        self.codes = self._grow("codes", self.codes, other.codes)
        if self.scale is not None:
            self.scale = self._grow("scale", self.scale, other.scale)
        if self.zero is not None:
            self.zero = self._grow("zero", self.zero, other.zero)
        if self.correction is not None:
            self.correction.append(other.correction)
        self.length += other.length

    def _grow(self, name: str, cur: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """``cur`` extended by ``new`` along dim 2 (tokens, or channel-axis groups), as a view of a
        capacity buffer: only ``new`` is copied unless the buffer is full, then it grows by 1.5x.
        A ``cur`` that is not the view of its buffer (first append, or tensors replaced by
        :meth:`map_tensors`) starts a new buffer."""
        if self._buffers is None:
            self._buffers = {}
        n, m = cur.shape[2], new.shape[2]
        buf = self._buffers.get(name)
        if (buf is None or buf.shape[2] < n + m or buf.data_ptr() != cur.data_ptr()
                or buf.shape[:2] != cur.shape[:2] or buf[:, :, :n].stride() != cur.stride()):
            buf = cur.new_empty((*cur.shape[:2], max(n + m, n + n // 2), *cur.shape[3:]))
            buf[:, :, :n].copy_(cur)
            self._buffers[name] = buf
        buf[:, :, n : n + m].copy_(new)
        return buf[:, :, : n + m]

    def layout(self) -> tuple:
        """What must match for :meth:`append`: heads, bits, axis, format, and whether keys carry a
        correction (an 8-bit sink block, token axis, never absorbs the 8-bit channel-axis keys after it)."""
        return self.heads, self.bits, self.axis, self.fmt, self.correction is not None

    def tensors(self) -> list[torch.Tensor]:
        own = [t for t in (self.codes, self.scale, self.zero) if t is not None]
        return own + (self.correction.tensors() if self.correction is not None else [])

    def nbytes_parts(self) -> dict[str, int]:
        """Bytes actually held: ``payload`` (codes or fp tensor), ``scales_zeros``, ``correction``
        (the key correction code with its scales and zero-points)."""
        sz = sum(t.nbytes for t in (self.scale, self.zero) if t is not None)
        corr = 0 if self.correction is None else sum(t.nbytes for t in self.correction.tensors())
        return {"payload": self.codes.nbytes, "scales_zeros": sz, "correction": corr}

    def map_tensors(self, fn) -> None:
        """Apply ``fn`` to every stored tensor (batch dim first), e.g. for beam reordering."""
        self.codes = fn(self.codes)
        if self.scale is not None:
            self.scale = fn(self.scale)
        if self.zero is not None:
            self.zero = fn(self.zero)
        if self.correction is not None:
            self.correction.map_tensors(fn)


def _rows(t: torch.Tensor | None, a: int, b: int) -> torch.Tensor | None:
    """``t[:, :, a:b]`` (``None`` stays ``None``: a symmetric format has no zero-points)."""
    return None if t is None else t[:, :, a:b]


@dataclass
class Segment:
    """A run of committed tokens of one modality: ``[start, start + length)``."""

    modality: str
    start: int
    length: int
    blocks: list[PackedBlock] = field(default_factory=list)


class Residual:
    """The newest tokens of one kind of one layer that are not committed yet: ``[B, H_kv, n, D]``, in
    time order (the ``residual_length`` window and the group still filling).

    ``bits == 16``: held as written (the cache's dtype). ``bits`` 8 or 4 (``quantizer.residual_bits``):
    tokens written by the current forward stay as written (``fresh``: their first use is at full
    precision, and the evaluated tokens of a paused cache are never coded) until :meth:`seal`, which
    codes them per token (:class:`PackedBlock`, v1 format, token axis: fp16 scale and zero per group of
    ``group_size`` channels along D) into ``sealed``. Sealed tokens are read dequantized and, when
    their group commits, encoded from that read into their slot format; nothing is coded twice in
    the residual. At most ``residual_length + group_size - 1`` tokens wait here, so the
    concatenations below are O(1) per step.
    """

    def __init__(self, bits: int, group_size: int, empty: torch.Tensor):
        self.bits = bits
        self.group_size = group_size
        self.sealed: PackedBlock | None = None  # the oldest tokens, coded (bits < 16 only)
        self.fresh = empty  # [B, H_kv, n_fresh, D] as written, after the sealed ones

    @property
    def length(self) -> int:
        return (0 if self.sealed is None else self.sealed.length) + self.fresh.shape[-2]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        B, H, _, D = self.fresh.shape
        return B, H, self.length, D

    @property
    def dtype(self) -> torch.dtype:
        return self.fresh.dtype

    @property
    def device(self) -> torch.device:
        return self.fresh.device

    def append(self, x: torch.Tensor) -> None:
        """Add the newest tokens ``x [B, H_kv, t, D]`` (as written, until :meth:`seal`)."""
        self.fresh = torch.cat([self.fresh, x], dim=-2)

    def read(self) -> torch.Tensor:
        """Every token as the cache reads it: ``[B, H_kv, n, D]`` in the cache's dtype (the stored
        tensor itself while nothing is sealed)."""
        if self.sealed is None:
            return self.fresh
        return torch.cat([self.sealed.decode(self.fresh.dtype), self.fresh], dim=-2)

    def oldest(self, n: int) -> torch.Tensor:
        """The ``n`` oldest tokens as read (what a commit encodes into the slot formats)."""
        if self.sealed is None:
            return self.fresh[:, :, :n]
        m = self.sealed.length
        if n <= m:
            return self.sealed.token_range(0, n).decode(self.fresh.dtype)
        return torch.cat([self.sealed.decode(self.fresh.dtype), self.fresh[:, :, : n - m]], dim=-2)

    def parts(self, a: int, b: int) -> tuple[PackedBlock | None, torch.Tensor]:
        """Tokens ``a .. b - 1`` (oldest first) as stored: ``(their codes or None, the uncoded ones
        [B, H_kv, n, D])``, views."""
        m = 0 if self.sealed is None else self.sealed.length
        sealed = self.sealed.token_range(a, min(b, m)) if a < min(b, m) else None
        return sealed, self.fresh[:, :, max(a - m, 0) : max(b - m, 0)]

    def push(self, sealed: PackedBlock | None, fresh: torch.Tensor) -> None:
        """Add tokens newer than every held one, as another holder stored them (:meth:`parts`):
        codes are copied, never coded again."""
        if sealed is not None:
            if self.fresh.shape[-2]:
                raise ValueError("coded tokens cannot follow uncoded ones in a residual")
            if self.sealed is None:
                self.sealed = self._copied(replace(sealed))
            else:
                self.sealed.append(sealed)
        if fresh.shape[-2]:
            self.fresh = torch.cat([self.fresh, fresh], dim=-2)

    def drop_oldest(self, n: int) -> None:
        """Forget the ``n`` oldest tokens (committed, or freed by a sliding window); copies what is
        left so the dropped bytes are released."""
        if n <= 0:
            return
        m = 0 if self.sealed is None else self.sealed.length
        if m:
            self.sealed = None if n >= m else self._copied(self.sealed.token_range(n, m))
        if n > m:
            self.fresh = self.fresh[:, :, n - m :].clone()

    def drop_newest(self, n: int) -> None:
        """Forget the ``n`` newest tokens (``Cache.crop``); copies what is left so the dropped bytes are
        released."""
        if n <= 0:
            return
        f = self.fresh.shape[-2]
        self.fresh = self.fresh[:, :, : max(f - n, 0)].clone()
        if n > f:
            m = self.sealed.length
            self.sealed = None if n - f >= m else self._copied(self.sealed.token_range(0, m - (n - f)))

    def seal(self) -> None:
        """Code the fresh tokens (``bits < 16``; a no-op at 16 bits or when none are fresh)."""
        if self.bits == FULL_PRECISION_BITS or self.fresh.shape[-2] == 0:
            return
        heads = tuple(range(self.fresh.shape[1]))
        block = PackedBlock.encode(self.fresh, heads, self.bits, "token", self.group_size, 0)
        if self.sealed is None:
            self.sealed = block
        else:
            self.sealed.append(block)
        B, H, _, D = self.fresh.shape
        self.fresh = self.fresh.new_empty((B, H, 0, D))  # not a view: the coded tokens' bytes are released

    @staticmethod
    def _copied(block: PackedBlock) -> PackedBlock:
        block.map_tensors(lambda t: t.clone())
        return block

    def tensors(self) -> list[torch.Tensor]:
        return [self.fresh] + ([] if self.sealed is None else self.sealed.tensors())

    @property
    def nbytes(self) -> int:
        """Bytes held: the fresh tokens as written plus the sealed codes with their scales and zeros."""
        sealed = 0 if self.sealed is None else sum(self.sealed.nbytes_parts().values())
        return self.fresh.nbytes + sealed

    def map_tensors(self, fn) -> None:
        """Apply ``fn`` to every stored tensor (batch dim first), e.g. for beam reordering."""
        self.fresh = fn(self.fresh)
        if self.sealed is not None:
            self.sealed.map_tensors(fn)
