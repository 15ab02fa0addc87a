"""Registry of the slot formats a plan can name: how one quantized run of K or V is stored.

A :class:`Format` is a bit width, a *scaling* (what each group stores besides its codes) and a
*codebook* (where the ``2**bits`` levels sit). Every reader of a format goes through this object:
the byte accounting (:meth:`Format.group_bytes`, :meth:`Format.run_bytes`), the reference encode
and decode (:mod:`kvplan.kernels.reference`), the cache storage and the attention kernels.

Decode is one formula for every format::

    x̂ = zero + scale * L[code]          (zero = 0 for symmetric scalings)

with ``L`` the codebook in *level units*:

* ``minmax-*`` scalings (asymmetric): ``scale = (max - min) / qmax`` and ``zero = min`` of the group;
  uniform levels are ``L[c] = c`` (the v1 format), a codebook ``λ ∈ [0, 1]`` gives ``L = λ · qmax``.
* ``absmax-*`` scalings (symmetric, no zero-point): ``scale = max |x|`` of the group; uniform levels
  are ``L[c] = -1 + 2c / qmax``, a codebook gives ``L = λ ∈ [-1, 1]``.

Scalings (bytes per group): ``minmax-fp16`` fp16 scale + fp16 zero (4, the v1 format),
``minmax-e4m3`` fp8 e4m3 scale + fp16 zero (3), ``absmax-e4m3`` fp8 e4m3 scale alone (1). An e4m3
scale keeps 3 mantissa bits (relative step 1/16) over ``[2**-6, 448]`` (smaller scales lose relative
precision as subnormals); a larger scale is refused like a value outside the fp16 range.

Codebooks: :func:`lloyd_max_levels` fits the MSE-optimal levels (Lloyd-Max) to Gaussian groups of
the given length normalized like the scaling normalizes them. After a Hadamard rotation the
coordinates of K and V are close to Gaussian, and on the default model these fixed levels code K
and V as well as levels fitted to the model's own calibration K/V (``bench/codec_formats.md``). A
plan stores the levels it uses (``quantizer.codebooks``), so decoding never depends on this code's
fit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .qtypes import FULL_PRECISION_BITS, channel_group_size, packed_row_bytes, qtype

E4M3_MAX = 448.0
_FP16_MAX = 65504.0


@dataclass(frozen=True)
class Scaling:
    """What a group stores besides its codes."""

    name: str
    symmetric: bool  # no zero-point: the group is coded around 0 by its max |x|
    scale_dtype: torch.dtype
    zero_dtype: torch.dtype | None

    @property
    def group_bytes(self) -> int:
        """Bytes stored per group: the scale and, when asymmetric, the zero-point."""
        z = 0 if self.zero_dtype is None else torch.empty((), dtype=self.zero_dtype).element_size()
        return torch.empty((), dtype=self.scale_dtype).element_size() + z


SCALINGS: dict[str, Scaling] = {
    s.name: s
    for s in (
        Scaling("minmax-fp16", False, torch.float16, torch.float16),
        Scaling("minmax-e4m3", False, torch.float8_e4m3fn, torch.float16),
        Scaling("absmax-e4m3", True, torch.float8_e4m3fn, None),
    )
}
DEFAULT_SCALING = "minmax-fp16"


def scaling(name: str) -> Scaling:
    try:
        return SCALINGS[name]
    except KeyError:
        raise ValueError(f"unknown scaling {name!r}; known: {sorted(SCALINGS)}") from None


@dataclass(frozen=True)
class Format:
    """One stored format: ``bits`` (2, 3, 4, 8; 16 = full precision), a scaling and optional
    codebook levels ``λ`` (``2**bits`` increasing numbers in ``[0, 1]`` for minmax scalings,
    ``[-1, 1]`` for absmax; ``None`` = uniform levels)."""

    bits: int
    scaling: str = DEFAULT_SCALING
    levels: tuple[float, ...] | None = None

    def __post_init__(self):
        if self.bits == FULL_PRECISION_BITS:
            return
        qtype(self.bits)  # a quantized width
        sc = scaling(self.scaling)
        if self.levels is not None:
            object.__setattr__(self, "levels", tuple(float(v) for v in self.levels))
            check_levels(self.levels, self.bits, sc.symmetric)

    @property
    def full_precision(self) -> bool:
        return self.bits == FULL_PRECISION_BITS

    @property
    def spec(self) -> Scaling:
        return scaling(self.scaling)

    @property
    def legacy(self) -> bool:
        """The v1 format (uniform min-max codes with fp16 scale and zero): the Triton kernels'."""
        return self.scaling == DEFAULT_SCALING and self.levels is None

    @property
    def name(self) -> str:
        """Display name, e.g. ``int2-minmax-fp16``, ``lloyd2-absmax-e4m3``, ``fp``."""
        if self.full_precision:
            return "fp"
        return f"{'lloyd' if self.levels is not None else 'int'}{self.bits}-{self.scaling}"

    def group_bytes(self) -> int:
        return 0 if self.full_precision else self.spec.group_bytes

    def run_bytes(self, axis: str, group_size: int, head_dim: int, start: int, length: int,
                  fp_bytes: int) -> tuple[int, int]:
        """``(payload, scales_zeros)`` bytes one KV head stores for a committed run of ``length``
        tokens from absolute position ``start`` (channel-axis groups align to absolute positions)."""
        if self.full_precision:
            return length * head_dim * fp_bytes, 0
        payload = length * packed_row_bytes(head_dim, self.bits)
        if axis == "token":
            n_groups = length * (head_dim // channel_group_size(group_size, head_dim))
        else:
            n_groups = -(-((start % group_size) + length) // group_size) * head_dim
        return payload, n_groups * self.group_bytes()

    def level_units(self, device=None) -> torch.Tensor | None:
        """fp32 ``L [2**bits]``: decode is ``zero + scale * L[code]``; ``None`` when ``L[c] = c``."""
        if self.full_precision or self.legacy or (self.levels is None and not self.spec.symmetric):
            return None
        return _level_units(self.bits, self.levels, self.spec.symmetric, str(device or "cpu"))


def check_levels(levels, bits: int, symmetric: bool) -> None:
    """Codebook levels: ``2**bits`` finite, strictly increasing numbers within the scaling's range."""
    n = 1 << bits
    lo = -1.0 if symmetric else 0.0
    if len(levels) != n:
        raise ValueError(f"a {bits}-bit codebook needs {n} levels, got {len(levels)}")
    for a, b in zip(levels, levels[1:]):
        if not a < b:
            raise ValueError("codebook levels must be strictly increasing")
    if not (lo <= levels[0] and levels[-1] <= 1.0):
        raise ValueError(f"codebook levels must lie in [{lo:g}, 1]")


@functools.lru_cache(maxsize=None)
def _level_units(bits: int, levels, symmetric: bool, device: str) -> torch.Tensor:
    qmax = (1 << bits) - 1
    if levels is None:  # uniform symmetric
        lam = torch.linspace(-1.0, 1.0, qmax + 1, dtype=torch.float64)
    else:
        lam = torch.tensor(levels, dtype=torch.float64)
    return (lam if symmetric else lam * qmax).float().to(device)


@functools.lru_cache(maxsize=None)
def lloyd_max_levels(bits: int, symmetric: bool, group_len: int, n_groups: int = 4096,
                     iterations: int = 60) -> tuple[float, ...]:
    """MSE-optimal levels ``λ`` for Gaussian groups of ``group_len`` values normalized by the
    scaling (min-max to ``[0, 1]``, or by max ``|x|`` to ``[-1, 1]``): Lloyd-Max iterations on a
    fixed-seed sample and its mirror image, rounded to 4 decimals (deterministic, so every run
    writes the same plan)."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(n_groups, group_len, generator=g, dtype=torch.float64)
    if symmetric:
        u = z / z.abs().amax(-1, keepdim=True)
        lv = torch.linspace(-1.0, 1.0, 1 << bits, dtype=torch.float64)
    else:
        mn, mx = z.amin(-1, keepdim=True), z.amax(-1, keepdim=True)
        u = (z - mn) / (mx - mn)
        lv = torch.linspace(0.0, 1.0, 1 << bits, dtype=torch.float64)
    u = u.flatten()
    u = torch.cat([u, -u if symmetric else 1 - u])  # the Gaussian is symmetric: so are its levels
    # sorted once: each iteration's cells (midpoint < u <= next midpoint) are index ranges, and
    # their sums differences of one cumulative sum
    u = u.sort().values
    csum = torch.cat([u.new_zeros(1), u.cumsum(0)])
    first, last = torch.tensor([0]), torch.tensor([u.numel()])
    for _ in range(iterations):
        edges = torch.cat([first, torch.searchsorted(u, (lv[1:] + lv[:-1]) / 2, right=True), last])
        counts = (edges[1:] - edges[:-1]).to(u.dtype)
        sums = csum[edges[1:]] - csum[edges[:-1]]
        lv = torch.where(counts > 0, sums / counts.clamp_min(1), lv)
    return tuple(round(float(v), 4) for v in lv)


def default_codebook(bits: int, scaling_name: str, group_len: int) -> tuple[float, ...]:
    """The Lloyd-Max levels kvplan proposes for ``bits`` under ``scaling_name`` and groups of
    ``group_len`` values (``group_size`` tokens on the channel axis, the per-token group on the
    token axis)."""
    return lloyd_max_levels(bits, scaling(scaling_name).symmetric, group_len)


# ----------------------------------------------------------------------------- scale storage
class ScaleRangeError(ValueError):
    """A group's scale is past what its format's scale dtype holds (the cache names where)."""


def store_scale(s: torch.Tensor, fmt: Format) -> torch.Tensor:
    """fp32 scales in the format's scale dtype (refusing values past its range)."""
    dt = fmt.spec.scale_dtype
    limit = E4M3_MAX if dt == torch.float8_e4m3fn else _FP16_MAX
    if bool((s > limit).any()):
        raise ScaleRangeError(f"the values need a scale of {s.max().item():.4g}, past the {fmt.scaling} range "
                              f"({limit:g}); cannot quantize them in this format")
    return s.to(dt)
