"""Orthogonal rotations applied to K/V before quantization and undone on read.

Both are constants of the plan (no per-token bytes, so the honest bpv does not change) and
orthogonal, so a read undoes a write up to float rounding:

- **Hadamard** (``quantizer.rotation: hadamard``): ``y = x H`` with the normalized Sylvester
  Hadamard matrix ``H [D, D]`` (``H = Hᵀ = H⁻¹``; needs a power-of-two head_dim). It spreads a
  few large channels over all of them, so a min/max grid per group wastes fewer levels
  (QuaRot). Applied to quantized Keys and Values.
- **Pre-RoPE frame for Keys** (``quantizer.key_pre_rope: true``): before the Hadamard, the key
  at cache index ``t`` is rotated by ``-t`` with the model's RoPE frequencies ``inv_freq``
  (rotate-half pairs ``(i, i + d/2)`` with ``d = 2 * len(inv_freq)``; channels past ``d`` are
  left alone), undoing the position's rotation, so a channel no longer spins with the position
  and a per-channel group over tokens sees a near-constant signal (KVQuant). The read rotates
  by ``+t`` with the same ``t``, so the pair is exact whatever positions the model used (left
  padding, multimodal RoPE); only the benefit depends on matching the model's frequencies.
  In a left-padded batch (:meth:`Rotation.set_row_padding`) row ``b``'s ``t`` is its cache index
  minus its padding, its RoPE position, so a padded row is quantized in the frame it has unpadded.

Order: write ``y = R(-t) k`` then ``y H``; read ``ŷ Hᵀ`` then ``R(t)``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["Rotation", "hadamard_fits", "hadamard_matrix", "rope_rotate"]


def hadamard_fits(head_dim: int) -> bool:
    """True when a Hadamard rotation exists for ``head_dim`` (a power of two)."""
    return head_dim >= 1 and not head_dim & (head_dim - 1)


def hadamard_matrix(n: int, device=None) -> torch.Tensor:
    """Normalized Sylvester Hadamard matrix ``[n, n]`` (fp32, symmetric, its own inverse)."""
    if not hadamard_fits(n):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(device=device, dtype=torch.float32)


def _cos_sin(start: int, stop: int, inv_freq: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos`` / ``sin`` of ``t * inv_freq`` for ``t = start .. stop - 1``: ``[T, d/2]`` each."""
    t = torch.arange(start, stop, device=device, dtype=torch.float64)
    angle = torch.outer(t, inv_freq.to(device=device, dtype=torch.float64))
    return angle.cos().float(), angle.sin().float()


def rope_rotate(x: torch.Tensor, position: int, inv_freq: torch.Tensor, sign: float) -> torch.Tensor:
    """Rotate ``x [..., T, D]`` (fp32) by ``sign * t * inv_freq`` for ``t = position ..
    position + T - 1`` on the rotate-half pairs of its first ``2 * len(inv_freq)`` channels."""
    cos, sin = _cos_sin(position, position + x.shape[-2], inv_freq, x.device)
    return _rotate_pairs(x, cos, sign * sin)


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [..., T, D]`` with its rotate-half pairs turned by the angles of ``cos`` / ``sin [T, d/2]``."""
    return rotate_pairs_(x.clone(), cos, sin)


def rotate_pairs_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """In place: turn the rotate-half pairs ``(i, i + d/2)`` of fp32 ``x [..., T, D]`` by the angles
    of ``cos`` / ``sin [T, d/2]`` (or ``[B, 1, T, d/2]``, one row each; one ``[..., T, d/2]``
    temporary); returns ``x``."""
    half = cos.shape[-1]
    a, b = x[..., :half], x[..., half : 2 * half]
    a_sin = a * sin
    a.mul_(cos).sub_(b * sin)  # a cos - b sin
    b.mul_(cos).add_(a_sin)  # b cos + a sin
    return x


class AngleTable:
    """RoPE angles by cache index for one set of inverse frequencies, shared by every layer (and kind) of a
    cache that rotates with them: ``cos`` / ``sin [n, d/2]`` fp32 of table rows ``0 .. n - 1``, grown by
    doubling (every read of the history needs them, so they are computed once, not per block, step or
    layer: one table per layer grew with the context, uncounted, to many times the cache), with its
    complex and transposed forms built on demand. Row ``j`` holds RoPE position ``j - origin`` (the
    batch's longest left padding, 0 unpadded)."""

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq
        self.origin = 0
        self.cos = self.sin = None
        self.cis = None  # cos + i sin (complex64), rebuilt when the table grows
        self.by_pair = None  # cos / sin transposed, [d/2, n] each (native kernel)

    def set_origin(self, origin: int) -> None:
        if origin != self.origin:
            self.origin = origin
            self.cos = self.sin = self.cis = self.by_pair = None

    def grow(self, stop: int) -> None:
        """Make rows ``0 .. stop - 1`` available."""
        have = 0 if self.cos is None else self.cos.shape[0]
        if stop > have:
            n = max(stop, 2 * have, 1024)
            cos, sin = _cos_sin(have - self.origin, n - self.origin, self.inv_freq, self.inv_freq.device)
            self.cos = cos if self.cos is None else torch.cat([self.cos, cos])
            self.sin = sin if self.sin is None else torch.cat([self.sin, sin])


class Rotation:
    """The write/read transform of one kind (K or V) of one cache.

    ``hadamard``: fp32 ``[D, D]`` or ``None``; ``inv_freq``: fp32 ``[d/2]`` (keys in the pre-RoPE
    frame) or ``None``; ``table``: the :class:`AngleTable` of ``inv_freq`` to share (default: its own).
    Tensors live on the cache's device.
    """

    def __init__(self, hadamard: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None,
                 table: AngleTable | None = None):
        if hadamard is None and inv_freq is None:
            raise ValueError("a Rotation needs a Hadamard matrix, RoPE frequencies, or both")
        self.hadamard, self.inv_freq = hadamard, inv_freq
        self.table = None if inv_freq is None else (table or AngleTable(inv_freq))
        # row b of the batch reads cache index t at table row t + row_shift[b]
        self.row_shift: torch.Tensor | None = None  # int64 [B]; None: every row at shift 0
        self.max_shift = 0
        self._tile = self._pairs = None  # tile_matrices(), pair_order(): built once

    def set_row_padding(self, padding) -> None:
        """Left padding of each batch row (``padding[b]`` positions before row ``b``'s first token): row
        ``b``'s cache index ``t`` is rotated as RoPE position ``t - padding[b]``. Set before anything is
        written; a no-op without RoPE frequencies (a Hadamard alone does not depend on positions)."""
        if self.inv_freq is None:
            return
        padding = [int(p) for p in padding]
        origin = max(padding, default=0)
        self.table.set_origin(origin)
        shift = [origin - p for p in padding]
        self.max_shift = max(shift, default=0)
        self.row_shift = torch.tensor(shift, dtype=torch.int64, device=self.inv_freq.device) if self.max_shift else None

    def map_rows(self, fn) -> None:
        """Apply ``fn`` to the per-row shifts (the cache's batch reorders / selections / moves)."""
        if self.row_shift is not None:
            self.row_shift = fn(self.row_shift)

    def _per_row(self, table: torch.Tensor, position: int, length: int) -> torch.Tensor:
        """Rows ``[position, position + length)`` of ``table [n, d/2]`` shifted per batch row:
        ``[B, 1, length, d/2]`` (``[length, d/2]`` when every row's shift is 0)."""
        if self.row_shift is None:
            return table[position : position + length]
        idx = self.row_shift[:, None] + torch.arange(position, position + length, device=table.device)  # [B, T]
        return table[idx].unsqueeze(1)

    def pair_order(self, head_dim: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(perm, A)`` that put each rotary pair ``(i, i + d/2)`` next to each other:
        ``perm = [0, d/2, 1, d/2 + 1, ..., d/2 - 1, d - 1, d, ..., D - 1]`` (int64) and ``A = H[:, perm]``
        (``None`` without a Hadamard). With them a pre-RoPE key chunk is read as ``x' = ŷ A`` (or
        ``ŷ[..., perm]``), turned by one complex product ``x'_pairs · cis`` (:meth:`cis`), and dotted
        with ``q[..., perm]``."""
        if self._pairs is None or self._pairs[0].shape[0] != head_dim:
            dev = self.inv_freq.device
            h = self.inv_freq.shape[0]
            perm = torch.cat([torch.stack([torch.arange(h), torch.arange(h, 2 * h)], 1).flatten(),
                              torch.arange(2 * h, head_dim)]).to(dev)
            self._pairs = (perm, None if self.hadamard is None else self.hadamard[:, perm].contiguous())
        return self._pairs

    def cis(self, position: int, length: int) -> torch.Tensor:
        """complex64 ``cos + i sin`` of cache indices ``position ..``: ``[length, d/2]`` (a view of a
        table), or ``[B, 1, length, d/2]`` when the batch rows' padding differs (:meth:`set_row_padding`)."""
        self.angles(position, length + self.max_shift)
        t = self.table
        if t.cis is None or t.cis.shape[0] != t.cos.shape[0]:
            t.cis = torch.complex(t.cos, t.sin)
        return self._per_row(t.cis, position, length)

    def tile_matrices(self, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``A, A·P [D, D]`` with which a kernel reads a key tile ``ŷ`` of the pre-RoPE frame:
        ``ŷ A = ŷ Hᵀ`` (``A = H``, or ``I`` without a Hadamard) and ``ŷ A P = rotate_half(ŷ A)``
        (``(xP)_i = -x_{i+h}`` for ``i < h``, ``x_{i-h}`` for ``h <= i < 2h``, 0 past the rotary
        channels), so that RoPE is ``ŷA·cos + ŷAP·sin``."""
        if self._tile is None or self._tile[0].shape[0] != head_dim:
            dev = self.inv_freq.device
            a = self.hadamard if self.hadamard is not None else torch.eye(head_dim, device=dev)
            h = self.inv_freq.shape[0]
            p = torch.zeros(head_dim, head_dim, device=dev)
            i = torch.arange(h, device=dev)
            p[i + h, i] = -1.0
            p[i, i + h] = 1.0
            self._tile = (a.contiguous(), (a @ p).contiguous())
        return self._tile

    def angles_by_pair(self, position: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``cos`` / ``sin [d/2, length]`` of table rows ``position ..``: :meth:`angles`
        transposed (views of a table rebuilt when the table grows), so that one rotary pair's
        angles over consecutive tokens are contiguous. Row ``b`` of a padded batch reads its cache
        index ``t`` at column ``t - position + row_shift[b]``: ask for ``length + max_shift``."""
        self.angles(position, length)
        t = self.table
        if t.by_pair is None or t.by_pair[0].shape[1] != t.cos.shape[0]:
            t.by_pair = (t.cos.t().contiguous(), t.sin.t().contiguous())
        cos_t, sin_t = t.by_pair
        return cos_t[:, position : position + length], sin_t[:, position : position + length]

    def angles(self, position: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``cos`` / ``sin [length, d/2]`` of table rows ``position .. position + length - 1``
        (views of the table; needs ``inv_freq``): the cache indices of the batch rows at shift 0
        (every row unpadded); :meth:`row_angles` gives each row its own."""
        stop = position + length
        self.table.grow(stop)
        return self.table.cos[position:stop], self.table.sin[position:stop]

    def row_angles(self, position: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``cos`` / ``sin`` of cache indices ``position ..`` for every batch row: ``[length, d/2]``
        or, when the rows' padding differs, ``[B, 1, length, d/2]``."""
        self.angles(position, length + self.max_shift)
        return self._per_row(self.table.cos, position, length), self._per_row(self.table.sin, position, length)

    def forward(self, x: torch.Tensor, position: int) -> torch.Tensor:
        """``x [B, h, T, D]`` of tokens from cache index ``position`` -> rotated fp32."""
        y = x.float()
        if self.inv_freq is not None:
            cos, sin = self.row_angles(position, y.shape[-2])
            y = _rotate_pairs(y, cos, -sin)
        if self.hadamard is not None:
            y = y @ self.hadamard
        return y

    def inverse(self, y: torch.Tensor, position: int) -> torch.Tensor:
        """Undo :meth:`forward`: fp32 ``[B, h, T, D]``."""
        x = y.float()
        if self.hadamard is not None:
            x = x @ self.hadamard  # H is symmetric and orthogonal: its own inverse
        if self.inv_freq is not None:
            cos, sin = self.row_angles(position, x.shape[-2])
            x = _rotate_pairs(x, cos, sin)
        return x
