"""The parts of a plan: quantizer settings, bit rules, the bpv reference and provenance."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from .._version import __version__
from ..errors import PlanError
from ..kernels.qtypes import GROUP_SIZES, SUPPORTED_BITS
from ._checks import (CORRECTED, DEFAULT_MODALITY, KINDS, MAX_HEAD_DIM, MAX_TOKENS, check_choice, check_int, is_num,
                      key_path)

AXES = ("channel", "token")
CORRECTION_BITS = (2, 3, 4, 8)
ROTATIONS = ("none", "hadamard")  # quantizer.rotation (see kvplan.kernels.rotation)


@dataclass(frozen=True)
class QuantizerSettings:
    """Plan-wide quantizer settings; bits are per slot."""

    group_size: int = 32
    key_axis: str = "channel"  # KIVI: keys per channel, grouped along tokens
    value_axis: str = "token"
    residual_length: int = 128  # newest tokens kept in full precision
    sink_length: int = 0  # first tokens of the sequence kept in full precision (attention sinks)
    # HeadQ-style key correction (see KeyBasis): key slots marked ``correct`` also store a
    # rank-r code of their quantization error in the plan's per-head query basis
    key_correction_rank: int = 0  # r; 0 = off
    key_correction_bits: int = 4  # bits of the correction code (channel axis, same token groups as the keys)
    # orthogonal rotations before quantization, undone on read (kvplan.kernels.rotation); plan
    # constants, so they cost no bpv
    rotation: str = "none"  # "hadamard": quantized K and V times a Hadamard matrix (power-of-two head_dim)
    key_pre_rope: bool = False  # quantized keys rotated back to the pre-RoPE frame (needs Plan.rope_inv_freq)

    def __post_init__(self):
        check_choice(self.group_size, "quantizer.group_size", GROUP_SIZES)
        check_choice(self.key_axis, "quantizer.key_axis", AXES)
        check_choice(self.value_axis, "quantizer.value_axis", AXES)
        check_int(self.residual_length, "quantizer.residual_length", 0, MAX_TOKENS)
        check_int(self.sink_length, "quantizer.sink_length", 0, MAX_TOKENS)
        # at most head_dim: checked with the geometry (Plan)
        check_int(self.key_correction_rank, "quantizer.key_correction_rank", 0, MAX_HEAD_DIM)
        check_choice(self.key_correction_bits, "quantizer.key_correction_bits", CORRECTION_BITS)
        check_choice(self.rotation, "quantizer.rotation", ROTATIONS)
        if not isinstance(self.key_pre_rope, bool):
            raise PlanError("quantizer.key_pre_rope", "must be true or false", self.key_pre_rope)
        if self.key_correction_rank and self.key_axis != "channel":
            raise PlanError("quantizer.key_correction_rank", "needs key_axis 'channel' (the correction code shares "
                            "the keys' token groups)", self.key_correction_rank)

    def axis(self, kind: str) -> str:
        return self.key_axis if kind == "k" else self.value_axis


def check_correction_rank(rank: int, head_dim: int) -> None:
    """The key correction's rank fits the model: a rank-r basis of head_dim-dim keys."""
    if rank > head_dim:
        raise PlanError("quantizer.key_correction_rank", f"must be at most head_dim = {head_dim} (a rank-r basis "
                        "of head_dim-dim keys)", rank)


@dataclass(frozen=True)
class BitRule:
    """Set ``bits`` on every slot matching all given selectors (``None`` = any).

    ``correct``: the matched key slots also store the key correction code (see
    :class:`KeyBasis`); a later rule without it turns it off again for its slots.
    """

    bits: int
    layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    kind: str | None = None
    modality: str | None = None
    correct: bool = False

    @property
    def code(self) -> int:
        """Slot format code: ``bits``, plus :data:`CORRECTED` when the slot is corrected."""
        return self.bits + (CORRECTED if self.correct else 0)

    def __post_init__(self):
        check_choice(self.bits, "bits", SUPPORTED_BITS)
        if self.kind is not None:
            check_choice(self.kind, "kind", KINDS)
        for name in ("layers", "heads"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, tuple(v))


@dataclass(frozen=True)
class Reference:
    """Where a plan's bpv is stated: context length and modality layout (runs, in order)."""

    context_len: int = 4096
    modality_mix: tuple[tuple[str, float], ...] = ((DEFAULT_MODALITY, 1.0),)
    full_precision_bits: int = 16

    def __post_init__(self):
        check_int(self.context_len, "budget.reference.context_len", 1, MAX_TOKENS)
        pairs = self.modality_mix.items() if isinstance(self.modality_mix, Mapping) else self.modality_mix
        mix = []
        for name, frac in pairs:
            path = key_path("budget.reference.modality_mix", name)
            if not isinstance(name, str):
                raise PlanError(path, "modality names must be strings", name)
            if not is_num(frac):
                raise PlanError(path, "must be a number", frac)
            if not 0 <= frac <= 1:
                raise PlanError(path, "must be a fraction in [0, 1]", frac)
            mix.append((name, float(frac)))
        object.__setattr__(self, "modality_mix", tuple(mix))
        check_choice(self.full_precision_bits, "budget.reference.full_precision_bits", (16, 32))


@dataclass(frozen=True)
class Provenance:
    kvplan_version: str = __version__
    produced_by: str = "manual"
    seed: int | None = None
    data_hash: str | None = None
