"""What one search searches, resolved once: :class:`SearchConfig`.

:func:`kvplan.search.search` takes its choices as keywords, many of them ``None`` for "decide from the
model and the scorer" (key correction, error feedback, rotations, slot formats, streamed heads).
:meth:`SearchConfig.resolve` decides them once, refusing combinations the search cannot use; the
profile, the search space of every worker (:meth:`SearchConfig.space`) and the identity a worker must
share to join a study (:meth:`SearchConfig.identity`) all read that one object. The budget check the CLI
runs before the prefill (:func:`kvplan.search.check_budgets`) resolves formats and the stream window
with the same functions (:func:`resolve_formats`, :func:`resolve_stream_window`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import KVPlanError
from ..kernels.qtypes import FULL_PRECISION_BITS
from ..kernels.rotation import hadamard_fits
from ..models.geometry import Geometry
from ..models.rope import multimodal_rope, rope_inv_freq
from .space import DEFAULT_FORMATS, DEFAULT_KEY_CORRECTION_RANK, DEFAULT_STREAM_WINDOW, SearchSpace


def resolve_formats(key_scaling, value_scaling, codebooks) -> tuple[str, str, tuple[str, ...]]:
    """The slot formats of every searched plan: the ones given, ``DEFAULT_FORMATS`` for each ``None``."""
    return (DEFAULT_FORMATS["key_scaling"] if key_scaling is None else key_scaling,
            DEFAULT_FORMATS["value_scaling"] if value_scaling is None else value_scaling,
            tuple(DEFAULT_FORMATS["codebooks"] if codebooks is None else codebooks))


def resolve_stream_window(stream_window, granularity: str, heavy_length: int, profile) -> int:
    """The search's stream window: the one given, or for ``None`` ``DEFAULT_STREAM_WINDOW`` where the
    search can stream (slot granularity, no heavy-hitter copies, a sensitivity profile), else 0; refuses
    a window the search cannot use."""
    if stream_window is None:
        return DEFAULT_STREAM_WINDOW if granularity == "slot" and not heavy_length and profile else 0
    if stream_window and not profile:
        raise KVPlanError("stream_window: streamed heads are chosen from the sensitivity profile, which "
                          "profile=False (--no-profile) turns off")
    if stream_window and granularity != "slot":
        raise KVPlanError(f"stream_window: streamed heads are chosen per KV head, which needs granularity 'slot' "
                          f"(got {granularity!r})")
    if stream_window and heavy_length:
        raise KVPlanError("stream_window and heavy_length: streamed KV heads and heavy-hitter copies are not "
                          "supported together")
    return int(stream_window)


@dataclass(frozen=True)
class SearchConfig:
    """The search space's options and the codec of every searched plan, resolved (no ``None`` left);
    see :func:`kvplan.search.search` for each field."""

    geometry: Geometry
    modalities: tuple[str, ...]
    granularity: str
    bits: tuple[int, ...]
    group_sizes: tuple[int, ...]
    residual_lengths: tuple[int, ...]
    key_axes: tuple[str, ...]
    sink_lengths: tuple[int, ...]
    key_correction_rank: int
    key_correction_bits: int
    rotation: str
    key_pre_rope: bool
    rope_inv_freq: Any  # the model's RoPE frequencies (None without a RoPE model); used when key_pre_rope
    key_scaling: str
    value_scaling: str
    codebooks: tuple[str, ...]
    labelling: str  # the name of the labelling that gives the task's tokens their modalities
    residual_bits: int
    recent_lengths: tuple[int, ...]
    sink_bits: int
    heavy_length: int
    stream_window: int
    error_feedback: bool

    @classmethod
    def resolve(cls, *, scorer, model, geometry: Geometry, modalities: Sequence[str], granularity: str,
                bits, group_sizes, residual_lengths, key_axes, sink_lengths, key_correction_rank,
                key_correction_bits: int, rotation, key_pre_rope, key_scaling, value_scaling, codebooks,
                labelling: str, residual_bits: int, recent_lengths, sink_bits: int, heavy_length: int,
                stream_window, error_feedback, profile) -> "SearchConfig":
        """Decide every ``None`` of search()'s keywords from ``scorer`` (its ``.model`` and calibration
        queries) or ``model``, and refuse what the search cannot do with them."""
        has_queries = hasattr(scorer, "model") and hasattr(scorer, "calibration_sequences")
        if key_correction_rank is None:
            key_correction_rank = DEFAULT_KEY_CORRECTION_RANK if has_queries else 0
        if error_feedback is None:
            error_feedback = has_queries
        if error_feedback and not has_queries:
            raise KVPlanError("error_feedback needs a scorer with .model and .calibration_sequences() to learn the "
                              "metrics from (the built-in harness scorer has both); pass error_feedback=False")
        if key_correction_rank and not has_queries:
            raise KVPlanError("key_correction_rank > 0 needs a scorer with .model and .calibration_sequences() to "
                              "learn the query bases from (the built-in harness scorer has both); pass "
                              "key_correction_rank=0 to search without the key correction")
        if rotation is None:
            rotation = "hadamard" if hadamard_fits(geometry.head_dim) else "none"
        rope_model = getattr(scorer, "model", None) or (model if hasattr(model, "named_buffers") else None)
        inv_freq = rope_inv_freq(rope_model) if rope_model is not None else None
        # pre-RoPE keys are rotated back at their cache index; under multimodal (3-D) RoPE an image
        # token's rotation is set by its grid position instead, so the frame would not be the model's
        mrope = rope_model is not None and multimodal_rope(rope_model)
        if key_pre_rope is None:
            key_pre_rope = inv_freq is not None and not mrope
        if key_pre_rope and mrope:
            raise KVPlanError("key_pre_rope: this model uses multimodal RoPE (3-D positions for image tokens), "
                              "which cache indices do not reproduce; search with key_pre_rope=False "
                              "(--no-pre-rope-keys)")
        if key_pre_rope and inv_freq is None:
            raise KVPlanError("key_pre_rope needs the model's RoPE frequencies: pass a loaded RoPE model (or a "
                              "scorer with .model), or key_pre_rope=False")
        key_scaling, value_scaling, codebooks = resolve_formats(key_scaling, value_scaling, codebooks)
        return cls(geometry=geometry, modalities=tuple(modalities), granularity=granularity, bits=tuple(bits),
                   group_sizes=tuple(group_sizes), residual_lengths=tuple(residual_lengths),
                   key_axes=tuple(key_axes), sink_lengths=tuple(sink_lengths),
                   key_correction_rank=int(key_correction_rank), key_correction_bits=int(key_correction_bits),
                   rotation=rotation, key_pre_rope=bool(key_pre_rope), rope_inv_freq=inv_freq,
                   key_scaling=key_scaling, value_scaling=value_scaling, codebooks=codebooks, labelling=labelling,
                   residual_bits=int(residual_bits), recent_lengths=tuple(recent_lengths), sink_bits=int(sink_bits),
                   heavy_length=int(heavy_length),
                   stream_window=resolve_stream_window(stream_window, granularity, heavy_length, profile),
                   error_feedback=bool(error_feedback))

    def space(self, key_basis=None, feedback_metric=None, streamed: Sequence[tuple[int, int]] = ()) -> SearchSpace:
        """The search space, with the study's key-correction bases, error-feedback metrics and streamed
        KV heads once they are known (none before the profile)."""
        return SearchSpace(self.geometry, self.modalities, self.granularity, self.bits, self.group_sizes,
                           self.residual_lengths, self.key_axes, sink_lengths=self.sink_lengths, key_basis=key_basis,
                           key_correction_bits=self.key_correction_bits, rotation=self.rotation,
                           rope_inv_freq=self.rope_inv_freq if self.key_pre_rope else None,
                           key_scaling=self.key_scaling, value_scaling=self.value_scaling, codebooks=self.codebooks,
                           labelling=self.labelling, residual_bits=self.residual_bits,
                           recent_lengths=self.recent_lengths, sink_bits=self.sink_bits,
                           feedback_metric=feedback_metric, heavy_length=self.heavy_length, streamed_heads=streamed,
                           stream_window=self.stream_window if streamed else 0)

    def identity(self) -> dict:
        """The ``space`` entry of a study's identity: what a worker must share to join the study."""
        return {"granularity": self.granularity, "bits": list(self.bits), "group_sizes": list(self.group_sizes),
                "residual_lengths": list(self.residual_lengths), "key_axes": list(self.key_axes),
                "sink_lengths": list(self.sink_lengths), "key_correction_rank": self.key_correction_rank,
                "key_correction_bits": self.key_correction_bits, "rotation": self.rotation,
                "key_pre_rope": self.key_pre_rope, "key_scaling": self.key_scaling,
                "value_scaling": self.value_scaling, "codebooks": list(self.codebooks),
                # only when set: studies made before the field existed stay joinable
                **({"residual_bits": self.residual_bits} if self.residual_bits != FULL_PRECISION_BITS else {}),
                **({"sink_bits": self.sink_bits} if self.sink_bits != FULL_PRECISION_BITS else {}),
                **({"heavy_length": self.heavy_length} if self.heavy_length else {}),
                **({"stream_window": self.stream_window} if self.stream_window else {}),
                **({"error_feedback": True} if self.error_feedback else {}),
                **({"recent_lengths": sorted(set(self.recent_lengths))} if self.recent_lengths != (0,) else {})}
