"""Registry of the integer code types a plan can name, described once.

A *qtype* is a bit width: its code range, and how codes pack densely into bytes.
Plans name bits as integers (``2, 3, 4, 8``); ``16`` means "keep full precision".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

FULL_PRECISION_BITS = 16

# What each group stores besides its codes (scales, zero-points, codebooks) is the slot
# format's business: kvplan.kernels.formats.


@dataclass(frozen=True)
class QType:
    bits: int
    # Codes packed together in one "pack unit" of `unit_bytes` bytes.
    codes_per_unit: int
    unit_bytes: int

    @property
    def qmin(self) -> int:
        return 0

    @property
    def qmax(self) -> int:
        return (1 << self.bits) - 1


QTYPES: dict[int, QType] = {
    8: QType(8, codes_per_unit=1, unit_bytes=1),
    4: QType(4, codes_per_unit=2, unit_bytes=1),
    # 3-bit: eight codes in three bytes, no padding to 4 bits.
    3: QType(3, codes_per_unit=8, unit_bytes=3),
    2: QType(2, codes_per_unit=4, unit_bytes=1),
}

SUPPORTED_BITS = (2, 3, 4, 8, FULL_PRECISION_BITS)
# bits of a streamed KV head's slots (plans schema 8): no codes at all; every attention route gives
# those positions no weight (the head reads only the cache's copies of its newest tokens)
STREAMED = 0
GROUP_SIZES = (32, 64, 128)


def qtype(bits: int) -> QType:
    try:
        return QTYPES[bits]
    except KeyError:
        raise ValueError(f"unsupported bit width {bits!r}; quantized widths are {sorted(QTYPES)}") from None


def packed_row_bytes(n_codes: int, bits: int) -> int:
    """Bytes used to store one row of ``n_codes`` codes at ``bits`` (rows pad to whole pack units)."""
    qt = qtype(bits)
    units = -(-n_codes // qt.codes_per_unit)
    return units * qt.unit_bytes


@functools.lru_cache(maxsize=None)
def channel_group_size(group_size: int, head_dim: int) -> int:
    """Group length along D for per-token groups: the largest divisor of ``head_dim`` that is at most
    ``group_size``, so that groups tile each token's channels and never span two tokens (head_dim 80,
    as phi-2's, with group 32: 20 channels per group; 128 with group 32: 32)."""
    if group_size < 1 or head_dim < 1:
        raise ValueError(f"group_size {group_size} and head_dim {head_dim} must be positive")
    return max(g for g in range(1, min(group_size, head_dim) + 1) if head_dim % g == 0)
