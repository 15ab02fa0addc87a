"""The parts of a plan: quantizer settings, bit rules, the bpv reference and provenance."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from .._version import __version__
from ..errors import PlanError
from ..kernels.formats import DEFAULT_SCALING, SCALINGS, Format, check_levels
from ..kernels.qtypes import FULL_PRECISION_BITS, GROUP_SIZES, QTYPES, SUPPORTED_BITS
from ._checks import (DEFAULT_MODALITY, KINDS, MAX_HEAD_DIM, MAX_TOKENS, STREAMED, check_choice, check_int,
                      is_num, key_path, slot_code)

AXES = ("channel", "token")
CORRECTION_BITS = (2, 3, 4, 8)
ROTATIONS = ("none", "hadamard")  # quantizer.rotation (see kvplan.kernels.rotation)
RESIDUAL_BITS = (4, 8, FULL_PRECISION_BITS)  # quantizer.residual_bits
SINK_BITS = (8, FULL_PRECISION_BITS)  # quantizer.sink_bits
SINK_AXIS = "token"  # a coded sink position: per-token groups of channels along head_dim
PLAN_BITS = (STREAMED, *SUPPORTED_BITS)  # what a plan's bits may say (0: a streamed KV head)


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
    # slot formats (kvplan.kernels.formats, schema version 2): what each group stores besides its
    # codes, per kind, and non-uniform codebook levels per kind and bits (plan constants, no bpv)
    key_scaling: str = DEFAULT_SCALING
    value_scaling: str = DEFAULT_SCALING
    codebooks: tuple = ()  # ((kind, bits, levels), ...); YAML: {k: {2: [λ0, ...]}, v: {...}}
    # schema version 3: how the residual (the newest tokens not committed yet: the residual_length
    # window and the group still filling) is held once a token's first forward is over: 16 = as
    # written (the model's dtype), 8 / 4 = per-token v1 codes (groups of channels along head_dim)
    residual_bits: int = FULL_PRECISION_BITS
    # schema version 4: the newest ``recent_length`` committed tokens (never a sink position) also keep
    # a copy at the residual's precision, which every read uses instead of their slot codes: the
    # tokens the next queries attend to most stay sharp right after their group commits. The copies
    # are dropped as newer tokens commit (the slot codes stay: nothing is quantized twice); counted
    # as residual bytes (plans.accounting.recent_tokens)
    recent_length: int = 0
    # schema version 5: how the committed attention-sink positions (``sink_length``) are held: 16 =
    # as written (the model's dtype), 8 = per-token v1 codes (groups of channels along head_dim) in
    # the slots' rotated frame (``rotation``, ``key_pre_rope``): a sink token costs a quarter of an
    # fp32 one and reads back within 8-bit rounding
    sink_bits: int = FULL_PRECISION_BITS
    # schema version 7: heavy hitters. Each KV head of a full-attention layer also keeps copies, at
    # the residual's precision, of the ``heavy_length`` committed tokens (never a sink position) that
    # a prompt's last queries attend to most (kvplan.runtime.heavy); every read uses a copy instead
    # of the token's slot codes. Counted as residual bytes, with each copy's position and score
    # (plans.accounting.heavy_tokens)
    heavy_length: int = 0
    # schema version 8: streamed KV heads (slots at bits 0, ``STREAMED``) keep copies, at the residual's
    # precision, of their newest ``stream_window`` committed tokens (never a sink position) and attend
    # to those, the sink positions and the residual only; older tokens are neither stored nor read.
    # Counted as residual bytes (plans.accounting.stream_tokens)
    stream_window: int = 0

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
        check_choice(self.key_scaling, "quantizer.key_scaling", tuple(SCALINGS))
        check_choice(self.value_scaling, "quantizer.value_scaling", tuple(SCALINGS))
        check_choice(self.residual_bits, "quantizer.residual_bits", RESIDUAL_BITS)
        check_int(self.recent_length, "quantizer.recent_length", 0, MAX_TOKENS)
        check_choice(self.sink_bits, "quantizer.sink_bits", SINK_BITS)
        check_int(self.heavy_length, "quantizer.heavy_length", 0, MAX_TOKENS)
        check_int(self.stream_window, "quantizer.stream_window", 0, MAX_TOKENS)
        object.__setattr__(self, "codebooks", _codebooks(self.codebooks, self))
        if self.key_correction_rank and self.key_axis != "channel":
            raise PlanError("quantizer.key_correction_rank", "needs key_axis 'channel' (the correction code shares "
                            "the keys' token groups)", self.key_correction_rank)

    def axis(self, kind: str) -> str:
        return self.key_axis if kind == "k" else self.value_axis

    def scaling(self, kind: str) -> str:
        return self.key_scaling if kind == "k" else self.value_scaling

    def format(self, kind: str, bits: int) -> Format:
        """The stored format of a ``kind`` slot at ``bits`` (16: full precision)."""
        if bits == FULL_PRECISION_BITS:
            return Format(bits)
        return Format(bits, self.scaling(kind), self.codebook(kind, bits))

    @property
    def residual_format(self) -> Format:
        """How a residual token is held after its first forward (``residual_bits``; 16: as written)."""
        return Format(self.residual_bits)

    def residual_token_bytes(self, head_dim: int, fp_bytes: int) -> int:
        """Bytes one residual token takes per KV head and kind (``fp_bytes``: the full-precision storage)."""
        payload, scales = self.residual_format.run_bytes("token", self.group_size, head_dim, 0, 1, fp_bytes)
        return payload + scales

    @property
    def sink_format(self) -> Format:
        """How a committed attention-sink position is held (``sink_bits``; 16: as written), on the
        :data:`SINK_AXIS`."""
        return Format(self.sink_bits)

    def sink_token_bytes(self, head_dim: int, fp_bytes: int) -> int:
        """Bytes one committed sink position takes per KV head and kind."""
        payload, scales = self.sink_format.run_bytes(SINK_AXIS, self.group_size, head_dim, 0, 1, fp_bytes)
        return payload + scales

    def codebook(self, kind: str, bits: int) -> tuple[float, ...] | None:
        for k, b, levels in self.codebooks:
            if k == kind and b == bits:
                return levels
        return None

    @property
    def v1_formats(self) -> bool:
        """Every slot in the schema-version-1 format (fp16 min-max scales, uniform codes)."""
        return self.key_scaling == self.value_scaling == DEFAULT_SCALING and not self.codebooks

    def codebooks_dict(self) -> dict:
        """``{kind: {bits: [levels]}}`` as written in a plan file."""
        out: dict = {}
        for k, b, levels in self.codebooks:
            out.setdefault(k, {})[b] = list(levels)
        return out


def _codebooks(value, q: "QuantizerSettings") -> tuple:
    """Normalize ``codebooks`` (a YAML mapping ``{kind: {bits: [levels]}}`` or the tuple form) to a
    sorted tuple ``((kind, bits, levels), ...)``, each checked against its kind's scaling."""
    if isinstance(value, Mapping):
        items = []
        for kind, per_bits in value.items():
            path = key_path("quantizer.codebooks", kind)
            check_choice(kind, path, KINDS)
            if not isinstance(per_bits, Mapping):
                raise PlanError(path, "must map bits to a list of levels", per_bits)
            for bits, levels in per_bits.items():
                items.append((kind, bits, levels))
    elif isinstance(value, (tuple, list)):
        items = list(value)
    else:
        raise PlanError("quantizer.codebooks", "must map k / v to {bits: [levels]}", value)
    out = []
    for kind, bits, levels in items:
        path = f"quantizer.codebooks.{kind}.{bits}"
        check_choice(bits, f"quantizer.codebooks.{kind}", tuple(sorted(QTYPES)))
        if not isinstance(levels, (list, tuple)):
            raise PlanError(path, "must be a list of numbers", levels)
        if len(levels) != 1 << bits:
            raise PlanError(path, f"a {bits}-bit codebook needs {1 << bits} levels", len(levels))
        if not all(is_num(v) for v in levels):
            raise PlanError(path, "must be a list of numbers", levels)
        levels = tuple(float(v) for v in levels)
        try:
            check_levels(levels, bits, SCALINGS[q.scaling(kind)].symmetric)
        except ValueError as e:
            raise PlanError(path, str(e), show_value=False) from None
        out.append((kind, bits, levels))
    if len({(k, b) for k, b, _ in out}) != len(out):
        raise PlanError("quantizer.codebooks", "names a kind and bits twice", show_value=False)
    return tuple(sorted(out))


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
        return slot_code(self.bits, self.correct)

    def __post_init__(self):
        check_choice(self.bits, "bits", PLAN_BITS)
        if self.correct and self.bits == STREAMED:
            raise PlanError("correct", "a streamed head (bits 0) stores no codes to correct", True)
        if self.kind is not None:
            check_choice(self.kind, "kind", KINDS)
        for name in ("layers", "heads"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, tuple(v))


MAX_LAYOUT_RUNS = 65536  # budget.reference.layout entries


@dataclass(frozen=True)
class Reference:
    """Where a plan's bpv is stated: context length and modality layout.

    ``modality_mix``: fractions, laid out as one contiguous run per modality in order (what
    ``plan.bpv(context_len=T)`` uses at any length). ``layout``: optionally, the measured runs
    ``(modality, tokens)`` of a real prompt of ``context_len`` tokens (e.g. a VLM prompt's text,
    image, text, image... runs), so the bpv at the reference is that prompt's bytes exactly.
    """

    context_len: int = 4096
    modality_mix: tuple[tuple[str, float], ...] = ((DEFAULT_MODALITY, 1.0),)
    full_precision_bits: int = 16
    layout: tuple[tuple[str, int], ...] | None = None

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
        if self.layout is not None:
            object.__setattr__(self, "layout", _layout(self.layout, self.context_len, {n for n, _ in mix}))

    def labels(self) -> list:
        """The reference's token labels: ``layout`` when measured, else the mix's runs."""
        from .accounting import layout_labels

        if self.layout is not None:
            return [name for name, n in self.layout for _ in range(n)]
        return layout_labels(self.context_len, self.modality_mix)


def _layout(value, context_len: int, names: set) -> tuple:
    """``budget.reference.layout``: runs ``[modality, tokens]`` of the mix's modalities, summing to
    ``context_len``."""
    path = "budget.reference.layout"
    if not isinstance(value, (list, tuple)) or not value:
        raise PlanError(path, "must be a non-empty list of [modality, tokens] runs", value)
    if len(value) > MAX_LAYOUT_RUNS:
        raise PlanError(path, f"has more than {MAX_LAYOUT_RUNS} runs", len(value))
    runs = []
    for i, run in enumerate(value):
        where = f"{path}[{i}]"
        if not isinstance(run, (list, tuple)) or len(run) != 2:
            raise PlanError(where, "must be a [modality, tokens] pair", run)
        name, n = run
        if not isinstance(name, str) or name not in names:
            raise PlanError(where, f"modality must be one of the modality_mix's {sorted(names)}", name)
        runs.append((name, check_int(n, f"{where}[1]", 1, MAX_TOKENS)))
    if sum(n for _, n in runs) != context_len:
        raise PlanError(path, f"runs must add up to context_len = {context_len}", sum(n for _, n in runs))
    return tuple(runs)


@dataclass(frozen=True)
class Provenance:
    kvplan_version: str = __version__
    produced_by: str = "manual"
    seed: int | None = None
    data_hash: str | None = None

    def __post_init__(self):
        for key in ("kvplan_version", "produced_by", "data_hash"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, str):
                raise PlanError(f"provenance.{key}", "must be a string", value)
        if self.seed is not None:
            check_int(self.seed, "provenance.seed")
