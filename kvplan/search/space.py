"""The search space: which slots share one searched bit parameter, and the plan-wide quantizer.

A *group* is a set of slots ``(layer, kv_head, kind, modality)`` driven by one Optuna
parameter. The parameter is an integer *level* (an index into the group's ordered list of
bit settings), so samplers see the order ``2 < 3 < 4 < 8 < 16`` (ordinal, not categorical).

Granularities:

- ``"slot"``     one parameter per slot (the full table; ``L * H * 2 * M`` parameters);
- ``"layer_kv"`` one per (layer, kind): all heads and modalities of a layer's K (or V);
- ``"layer"``    one per layer: K and V of the layer share the bits;
- ``"kvtuner"``  one per layer choosing a (K bits, V bits) pair from KVTuner's candidates
  (:data:`kvplan.plans.KVTUNER_PAIRS`), ordered by cost.

The plan-wide quantizer fields (group size, key axis, residual length, attention-sink
length, recent copies) are searched as categorical parameters ``q.group_size`` / ``q.key_axis`` /
``q.residual_length`` / ``q.sink_length`` / ``q.recent_length`` when more than one choice is given,
otherwise fixed.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import numpy as np
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution

from ..errors import KVPlanError
from ..kernels.formats import default_codebook
from ..kernels.qtypes import FULL_PRECISION_BITS, GROUP_SIZES, STREAMED, SUPPORTED_BITS
from ..kernels.rotation import hadamard_fits
from ..models.geometry import Geometry
from ..models.modality import TOKEN_IDS_NAME
from ..plans import (KINDS, KVTUNER_PAIRS, FeedbackMetric, KeyBasis, Plan, Provenance, QuantizerSettings,
                     Reference, slot_code)
from ..plans._rope import as_floats, layer_rope_inv_freq, normalize_rope_inv_freq
from ..plans.accounting import stream_fits_window

GRANULARITIES = ("slot", "layer_kv", "layer", "kvtuner")
DEFAULT_BITS = (2, 3, 4, 8, 16)
DEFAULT_GROUP_SIZES = GROUP_SIZES  # (32, 64, 128)
DEFAULT_RESIDUAL_LENGTHS = (0, 32, 128)
DEFAULT_KEY_AXES = ("channel",)
# first tokens kept apart from the slots (held as quantizer.sink_bits says): none, the attention sink
# (BOS / first token), a few
DEFAULT_SINK_LENGTHS = (0, 1, 4)
# newest committed tokens that keep a residual-precision copy (quantizer.recent_length), chosen on the
# validation split (bench/search.md): the default search offered 0 / 4 / 8 copies reached 0.0319
# validation KL with 4 (0.0359 offered none); 16 copies did not fit 2.5 bpv beside an fp32 sink token, and a
# search offered 0 / 8 / 16 kept none (bench/results/recent_tokens.md: 8 copies paid with slot bits
# cost more than they bring)
DEFAULT_RECENT_LENGTHS = (0, 4, 8)
# how searched plans hold residual tokens and recent copies: 8-bit per-token codes. On validation
# they read as the as-written tokens do (600 tokens: 0.01824 vs 0.01826 KL) at half the bytes and
# less (bench/results/residual_bits.md); 4-bit codes doubled the KL
DEFAULT_RESIDUAL_BITS = 8
# how searched plans hold their attention-sink positions (quantizer.sink_bits): 8-bit per-token codes in the
# slots' rotated frame, chosen on the validation split (bench/search.md): the default search reached 0.0294
# validation KL with them vs 0.0319 with the sink as written (fp32: 0.046 bpv more at 512 tokens, while the
# plan recorded before, at 7ae02ac, reads 0.03197 with its sink coded vs 0.03190: bench/results/sink_bits.md)
DEFAULT_SINK_BITS = 8
# heavy-hitter copies per KV head of searched plans (quantizer.heavy_length), off: on the validation split 2
# copies helped the default model's search (0.0186 vs 0.0198) and hurt Gemma-3-270M's (0.0458 vs 0.0403;
# bench/search.md)
DEFAULT_HEAVY_LENGTH = 0
# committed tokens a streamed KV head keeps (plans' bits 0; kvplan.search.streaming), chosen on the validation
# split: the whole default search with 16 reads validation KL 0.0146 against 0.0198 without (bench/search.md;
# 16 among 16 / 32 / 64 by bench/results/streaming_heads/). Searches turn it on where they can stream: slot
# granularity and no heavy-hitter copies (kvplan.search.search's stream_window=None)
DEFAULT_STREAM_WINDOW = 16
# rank of the HeadQ-style key correction the search offers for key slots at the lowest bits (0 = off);
# chosen on the validation split: the default search at 2.5 bpv reached validation KL 0.0679 with rank 2
# vs 0.0776 with rank 0 (bench/results/key_correction_rank/; ranks 1 and 4 not re-run on validation)
DEFAULT_KEY_CORRECTION_RANK = 2
# slot formats (kvplan.kernels.formats) of every searched plan, chosen on the validation split by
# bench/codec_formats.py (bench/results/codec_formats.md): keys in the v1 format (a Lloyd-Max
# codebook lowers their MSE but raises the KL: it clips each group's extremes, the keys that
# draw attention), values symmetric with e4m3 scales and Lloyd-Max levels (1 byte per group
# instead of 4, at a lower KL than the v1 format)
DEFAULT_FORMATS = {"key_scaling": "minmax-fp16", "value_scaling": "absmax-e4m3", "codebooks": ("v",)}
# real (scored) evaluations of a search after its sensitivity profile, chosen on the validation split
# (bench/search.md): the default search at 60 / 120 / 240 trials reached validation KL 0.0206 / 0.0198 /
# 0.0196 in 617 / 840 / 1641 s on the 2-core box; 120 is where more trials stop paying for their time
DEFAULT_TRIALS = 120
# searched parameter name -> QuantizerSettings field
Q_FIELDS = {"q.group_size": "group_size", "q.key_axis": "key_axis", "q.residual_length": "residual_length",
            "q.sink_length": "sink_length", "q.recent_length": "recent_length"}
Q_PARAMS = tuple(Q_FIELDS)


@dataclass(frozen=True)
class Group:
    """One searched parameter: ``slots`` (flat indices into the bit table) and, per level,
    the format code (bits, or bits + ``CORRECTED`` for a corrected key slot) each of those
    slots gets (``level_bits[level, i]``)."""

    name: str
    slots: np.ndarray  # int [n_slots]
    level_bits: np.ndarray  # int [n_levels, n_slots], rows in increasing cost order

    @property
    def n_levels(self) -> int:
        return self.level_bits.shape[0]


class SearchSpace:
    """Search parameters ↔ bit tables ↔ plans, for one geometry and modality set."""

    def __init__(self, geometry: Geometry, modalities: Sequence[str] = ("text",), granularity: str = "slot",
                 bits: Sequence[int] = DEFAULT_BITS, group_sizes: Sequence[int] = DEFAULT_GROUP_SIZES,
                 residual_lengths: Sequence[int] = DEFAULT_RESIDUAL_LENGTHS,
                 key_axes: Sequence[str] = DEFAULT_KEY_AXES, value_axis: str = "token",
                 sink_lengths: Sequence[int] = DEFAULT_SINK_LENGTHS, pairs: Sequence[tuple[int, int]] = KVTUNER_PAIRS,
                 key_basis=None, key_correction_bits: int = 4, rotation: str = "none",
                 rope_inv_freq: Sequence[float] | None = None, key_scaling: str = "minmax-fp16",
                 value_scaling: str = "minmax-fp16", codebooks: Sequence[str] = (),
                 labelling: str = TOKEN_IDS_NAME, residual_bits: int = FULL_PRECISION_BITS,
                 recent_lengths: Sequence[int] = (0,), sink_bits: int = FULL_PRECISION_BITS,
                 feedback_metric=None, heavy_length: int = 0, streamed_heads: Sequence[tuple[int, int]] = (),
                 stream_window: int = 0):
        if granularity not in GRANULARITIES:
            raise KVPlanError(f"granularity {granularity!r} is not one of {list(GRANULARITIES)}")
        bits = tuple(sorted(set(int(b) for b in bits)))
        bad = [b for b in bits if b not in SUPPORTED_BITS]
        if bad or not bits:
            raise KVPlanError(f"candidate bits {list(bits)} must be a non-empty subset of {list(SUPPORTED_BITS)}")
        for name, vals, allowed in (("group_sizes", group_sizes, GROUP_SIZES), ("key_axes", key_axes,
                                                                                ("channel", "token"))):
            if not vals or any(v not in allowed for v in vals):
                raise KVPlanError(f"{name} {list(vals)} must be a non-empty subset of {list(allowed)}")
        for name, vals in (("residual_lengths", residual_lengths), ("sink_lengths", sink_lengths),
                           ("recent_lengths", recent_lengths)):
            if not vals or any((not isinstance(r, int)) or isinstance(r, bool) or r < 0 for r in vals):
                raise KVPlanError(f"{name} {list(vals)} must be non-negative integers")
        self.geometry = geometry
        self.modalities = tuple(modalities)
        self.labelling = labelling  # name of the token labelling every plan of the space is searched with
        self.granularity = granularity
        self.bits = bits
        self.group_sizes = tuple(sorted(set(group_sizes)))
        self.residual_lengths = tuple(sorted(set(residual_lengths)))
        self.sink_lengths = tuple(sorted(set(sink_lengths)))
        self.recent_lengths = tuple(sorted(set(recent_lengths)))
        self.key_axes = tuple(dict.fromkeys(key_axes))
        self.value_axis = value_axis
        self.pairs = tuple(sorted({tuple(p) for p in pairs}, key=lambda p: (p[0] + p[1], p[0])))
        self.shape = (geometry.num_layers, geometry.num_kv_heads, 2, len(self.modalities))
        # key correction: one basis [L, H_kv, D, r] for every plan of the space (None: off)
        self.key_basis = None if key_basis is None else KeyBasis(key_basis)
        # error-feedback metrics [L, 2, H_kv, D, D] every plan of the space carries (None: off)
        self.feedback_metric = None if feedback_metric is None else FeedbackMetric(
            feedback_metric, frame={"rotation": rotation, "key_pre_rope": rope_inv_freq is not None})
        self.key_correction = {} if key_basis is None else {
            "key_correction_rank": self.key_basis.shape[-1], "key_correction_bits": key_correction_bits}
        # rotations (kvplan.kernels.rotation): fixed for every plan of the space; keys in the
        # pre-RoPE frame when the model's RoPE frequencies are given
        # one list, or a dict layer type -> list (several RoPE bases, kvplan.plans._rope)
        self.rope_inv_freq = None if rope_inv_freq is None else as_floats(normalize_rope_inv_freq(rope_inv_freq))
        self.fixed_fields = {**self.key_correction, "rotation": rotation, "key_pre_rope": rope_inv_freq is not None,
                             "key_scaling": key_scaling, "value_scaling": value_scaling,
                             "residual_bits": residual_bits, "sink_bits": sink_bits, "heavy_length": heavy_length}
        QuantizerSettings(**self.fixed_fields)  # validates rotation, scalings, residual and sink bits, heavy copies
        # kinds whose quantized bits get Lloyd-Max codebooks (fitted per group length: codebooks_for)
        self.codebook_kinds = tuple(k for k in ("k", "v") if k in tuple(codebooks))
        if len(self.codebook_kinds) != len(tuple(codebooks)):
            raise KVPlanError(f"codebooks {list(codebooks)} must name kinds among ['k', 'v']")
        if rotation == "hadamard" and not hadamard_fits(geometry.head_dim):
            raise KVPlanError(f"rotation 'hadamard' needs a power-of-two head_dim; this model's is {geometry.head_dim} "
                              "(use rotation='none')")
        # streamed KV heads (plans' bits 0, chosen before the search: kvplan.search.streaming): their slots
        # are fixed at STREAMED, one level, no searched parameter; slot granularity only
        self.streamed_heads = tuple(sorted({(int(l), int(h)) for l, h in streamed_heads}))
        if self.streamed_heads:
            if granularity != "slot":
                raise KVPlanError("streamed heads need granularity 'slot'")
            if not stream_window:
                raise KVPlanError("streamed heads need a stream window (stream_window >= 1)")
            for l, h in self.streamed_heads:
                if not (0 <= l < geometry.num_layers and 0 <= h < geometry.num_kv_heads):
                    raise KVPlanError(f"streamed head ({l}, {h}) is not a (layer, KV head) of this model")
            self.fixed_fields["stream_window"] = int(stream_window)
            QuantizerSettings(**self.fixed_fields)
            streamable = self.streamable_layers()
            for l, h in self.streamed_heads:
                if l not in streamable:
                    raise KVPlanError(f"streamed head ({l}, {h}): layer {l} is a sliding layer of window "
                                      f"{geometry.window(l)}, too short for the copies of a streamed head under "
                                      "every quantizer setting of the space")
        self.groups: list[Group] = self._build_groups()
        self._slot_group = np.full(int(np.prod(self.shape)), -1, dtype=np.int64)
        for gi, g in enumerate(self.groups):
            self._slot_group[g.slots] = gi
        assert (self._slot_group >= 0).all()

    # ------------------------------------------------------------------ structure
    @property
    def codes(self) -> tuple[int, ...]:
        """Slot format codes the space can assign: the candidate bits, and with the key
        correction the lowest quantized bits + :data:`CORRECTED` (a level between it and the next)."""
        return ((STREAMED,) if self.streamed_heads else ()) + self.bits + (
            (slot_code(self.bits[0], corrected=True),) if self.corrects_keys else ())

    @property
    def corrects_keys(self) -> bool:
        """True when key groups have a corrected level (key correction on, lowest bits quantized)."""
        return self.key_basis is not None and self.bits[0] < FULL_PRECISION_BITS

    def _key_levels(self) -> np.ndarray:
        """Level codes of a keys-only group, in increasing cost order."""
        levels = list(self.bits)
        if self.corrects_keys:
            levels.insert(1, slot_code(self.bits[0], corrected=True))
        return np.array(levels, dtype=np.int64)[:, None]

    def _build_groups(self) -> list[Group]:
        L, H, _, M = self.shape
        idx = np.arange(int(np.prod(self.shape))).reshape(self.shape)
        levels = np.array(self.bits, dtype=np.int64)[:, None]
        groups = []
        if self.granularity == "slot":
            streamed = set(self.streamed_heads)
            for l, h, k, m in itertools.product(range(L), range(H), range(2), range(M)):
                sl = idx[l, h, k, m].reshape(1)
                lv = self._key_levels() if k == 0 else levels.copy()
                if (l, h) in streamed:
                    lv = np.array([[STREAMED]], dtype=np.int64)
                groups.append(Group(f"L{l:02d}.H{h}.{KINDS[k]}.{self.modalities[m]}", sl, lv))
        elif self.granularity == "layer_kv":
            for l, k in itertools.product(range(L), range(2)):
                sl = idx[l, :, k, :].ravel()
                lv = self._key_levels() if k == 0 else levels
                groups.append(Group(f"L{l:02d}.{KINDS[k]}", sl, np.repeat(lv, sl.size, axis=1)))
        elif self.granularity == "layer":
            for l in range(L):
                sl = idx[l].ravel()
                groups.append(Group(f"L{l:02d}", sl, np.repeat(levels, sl.size, axis=1)))
        else:  # kvtuner
            for l in range(L):
                sk, sv = idx[l, :, 0, :].ravel(), idx[l, :, 1, :].ravel()
                lb = np.array([[kb] * sk.size + [vb] * sv.size for kb, vb in self.pairs], dtype=np.int64)
                groups.append(Group(f"L{l:02d}.kv", np.concatenate([sk, sv]), lb))
        return groups

    @property
    def q_choices(self) -> dict[str, tuple]:
        return {"q.group_size": self.group_sizes, "q.key_axis": self.key_axes,
                "q.residual_length": self.residual_lengths, "q.sink_length": self.sink_lengths,
                "q.recent_length": self.recent_lengths}

    def codebooks_for(self, group_size: int, key_axis: str) -> tuple:
        """The plan constant ``quantizer.codebooks`` at this group size: Lloyd-Max levels
        (:func:`kvplan.kernels.formats.default_codebook`) for every quantized bit width of the space
        up to 4 bits, for each kind in ``codebook_kinds``, fitted to that kind's group length."""
        D = self.geometry.head_dim
        out = []
        for kind in self.codebook_kinds:
            axis = key_axis if kind == "k" else self.value_axis
            glen = group_size if axis == "channel" else min(group_size, D)
            scaling = self.fixed_fields["key_scaling" if kind == "k" else "value_scaling"]
            out += [(kind, b, default_codebook(b, scaling, glen)) for b in self.bits if b <= 4]
        return tuple(out)

    def quantizers(self) -> list[QuantizerSettings]:
        """Every plan-wide quantizer setting the space allows."""
        return [QuantizerSettings(group_size=g, key_axis=a, value_axis=self.value_axis, residual_length=r,
                                  sink_length=s, recent_length=w, codebooks=self.codebooks_for(g, a),
                                  **self.fixed_fields)
                for g, a, r, s, w in itertools.product(self.group_sizes, self.key_axes, self.residual_lengths,
                                                       self.sink_lengths, self.recent_lengths)]

    def streamable_layers(self, stream_window: int | None = None) -> tuple[int, ...]:
        """Layers whose KV heads can stream (window ``stream_window``, default the space's) under every
        quantizer setting of the space: full-attention layers, and sliding ones whose window holds a
        streamed head's copies (:func:`~kvplan.plans.accounting.stream_fits_window`)."""
        w = self.fixed_fields.get("stream_window", 0) if stream_window is None else stream_window
        qs = [replace(q, stream_window=w) for q in self.quantizers()]
        return tuple(l for l in range(self.geometry.num_layers)
                     if all(stream_fits_window(q, self.geometry.window(l)) for q in qs))

    def distributions(self) -> dict[str, BaseDistribution]:
        """Optuna distributions: ``IntDistribution`` levels per group, categorical quantizer fields."""
        d: dict[str, BaseDistribution] = {g.name: IntDistribution(0, g.n_levels - 1) for g in self.groups
                                          if g.n_levels > 1}
        for name, choices in self.q_choices.items():
            if len(choices) > 1:
                d[name] = CategoricalDistribution(list(choices))
        return d

    def suggest(self, trial) -> dict:
        """Ask a trial for every parameter (define-by-run); returns its params."""
        for name, dist in self.distributions().items():
            if isinstance(dist, IntDistribution):
                trial.suggest_int(name, dist.low, dist.high)
            else:
                trial.suggest_categorical(name, dist.choices)
        return dict(trial.params)

    # ------------------------------------------------------------------ conversions
    def levels_of(self, params: Mapping) -> np.ndarray:
        return np.array([int(params.get(g.name, 0)) for g in self.groups], dtype=np.int64)

    def quantizer_of(self, params: Mapping) -> QuantizerSettings:
        choices = self.q_choices
        fields = {f: params.get(name, choices[name][0]) for name, f in Q_FIELDS.items()}
        return QuantizerSettings(value_axis=self.value_axis, **fields, **self.fixed_fields,
                                 codebooks=self.codebooks_for(fields["group_size"], fields["key_axis"]))

    def table_of_levels(self, levels: Sequence[int]) -> np.ndarray:
        flat = np.empty(int(np.prod(self.shape)), dtype=np.int64)
        for g, lv in zip(self.groups, levels):
            flat[g.slots] = g.level_bits[int(lv)]
        return flat.reshape(self.shape)

    def table_of(self, params: Mapping) -> np.ndarray:
        """Format codes ``[layers, kv_heads, 2, modalities]`` of a parameter set (bits, plus
        ``CORRECTED`` on corrected key slots; see ``Plan.code_table``)."""
        return self.table_of_levels(self.levels_of(params))

    def params_of(self, levels: Sequence[int], quantizer: QuantizerSettings) -> dict:
        """Parameter dict for group levels and a quantizer (only searched names)."""
        dists = self.distributions()
        p = {g.name: int(lv) for g, lv in zip(self.groups, levels) if g.name in dists}
        for name, field in Q_FIELDS.items():
            if name in dists:
                p[name] = getattr(quantizer, field)
        return p

    def levels_of_table(self, table: np.ndarray) -> np.ndarray | None:
        """Group levels reproducing ``table`` exactly, or ``None`` if this space cannot express it."""
        flat = np.asarray(table, dtype=np.int64).ravel()
        out = np.empty(len(self.groups), dtype=np.int64)
        for i, g in enumerate(self.groups):
            hit = np.nonzero((g.level_bits == flat[g.slots][None, :]).all(axis=1))[0]
            if hit.size == 0:
                return None
            out[i] = hit[0]
        return out

    def contains_quantizer(self, q: QuantizerSettings) -> bool:
        return (q.value_axis == self.value_axis
                and q.key_correction_rank == self.key_correction.get("key_correction_rank", 0)
                and all(getattr(q, f) == v for f, v in self.fixed_fields.items())
                and q.codebooks == self.codebooks_for(q.group_size, q.key_axis)
                and all(getattr(q, f) in self.q_choices[name] for name, f in Q_FIELDS.items()))

    def plan_of(self, params: Mapping, reference: Reference, **kwargs) -> Plan:
        kwargs.setdefault("provenance", Provenance(produced_by="kvplan search"))
        return self.plan_of_table(self.table_of(params), self.quantizer_of(params), reference, **kwargs)

    def plan_of_table(self, table, quantizer: QuantizerSettings, reference: Reference, **kwargs) -> Plan:
        """Plan with these bits and quantizer settings (and the space's key correction basis and
        RoPE frequencies when the settings use them)."""
        return Plan.from_table(table, self.geometry, self.modalities, quantizer=quantizer, reference=reference,
                               key_basis=self.key_basis if quantizer.key_correction_rank else None,
                               rope_inv_freq=self.rope_inv_freq if quantizer.key_pre_rope else None,
                               feedback_metric=self.feedback_metric, **{"labelling": self.labelling, **kwargs})

    def rotations(self, layer: int, device="cpu") -> dict:
        """The write rotations of ``layer``'s quantized keys and values in every plan of the space
        (``kvplan.runtime.cache.plan_rotations`` of such a plan)."""
        from ..runtime.cache import layer_rotations  # not at import: the runtime pulls in transformers

        inv_freq = layer_rope_inv_freq(self.rope_inv_freq, self.geometry, layer)
        return layer_rotations(self.geometry.head_dim, self.fixed_fields["rotation"], inv_freq, device)

    def describe(self) -> dict:
        """JSON-able description (written beside exported plans)."""
        return {"granularity": self.granularity, "bits": list(self.bits), "group_sizes": list(self.group_sizes),
                "residual_lengths": list(self.residual_lengths), "sink_lengths": list(self.sink_lengths),
                "key_axes": list(self.key_axes), "key_correction": self._describe_correction(),
                "rotation": self.fixed_fields["rotation"], "key_pre_rope": self.fixed_fields["key_pre_rope"],
                "formats": {"key_scaling": self.fixed_fields["key_scaling"],
                            "value_scaling": self.fixed_fields["value_scaling"],
                            "codebooks": list(self.codebook_kinds)},
                "residual_bits": self.fixed_fields["residual_bits"], "sink_bits": self.fixed_fields["sink_bits"],
                **({"heavy_length": heavy} if (heavy := self.fixed_fields["heavy_length"]) else {}),
                **({"streamed_heads": [list(x) for x in self.streamed_heads],
                    "stream_window": self.fixed_fields["stream_window"]} if self.streamed_heads else {}),
                **({"error_feedback": {"metric_sha256": _digest(self.feedback_metric.array)}}
                   if self.feedback_metric is not None else {}),
                **({"recent_lengths": list(self.recent_lengths)} if self.recent_lengths != (0,) else {}),
                "value_axis": self.value_axis, "modalities": list(self.modalities), "shape": list(self.shape),
                "n_params": len(self.distributions()), "pairs": [list(p) for p in self.pairs]}

    def _describe_correction(self) -> dict | None:
        if self.key_basis is None:
            return None
        return {**self.key_correction, "basis_sha256": _digest(self.key_basis.array)}

    def __repr__(self) -> str:
        return (f"SearchSpace(granularity={self.granularity!r}, groups={len(self.groups)}, bits={self.bits}, "
                f"group_sizes={self.group_sizes}, residual_lengths={self.residual_lengths}, "
                f"sink_lengths={self.sink_lengths}, recent_lengths={self.recent_lengths}, "
                f"key_axes={self.key_axes})")


def _digest(a: np.ndarray) -> str:
    """Short sha256 of an array's bytes (written to search.json to name a plan constant)."""
    return hashlib.sha256(a.tobytes()).hexdigest()[:16]
