"""The plan: one dataclass for a model geometry, its per-slot resolution and (de)serialization.

A plan assigns bits to every *slot* ``(layer, kv_head, kind in {k, v}, modality)``:
a default, then rules applied in order (later rules win). See README "Plan file format".

Loading (:meth:`Plan.from_yaml`) goes file bytes (``_files``: size limit, UTF-8) -> YAML
document (``_yaml``: bounded loader) -> checked fields (``_parse``) -> :class:`Plan`, whose
``__post_init__`` checks what needs the whole plan (``_validate_semantics``). Every failure
on the way is a :class:`~kvplan.errors.PlanError` naming file, key path and value.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import numpy as np

from ..errors import FILE_PATH, PlanError
from ..kernels.qtypes import FULL_PRECISION_BITS
from ..kernels.rotation import hadamard_fits
from ..models.geometry import Geometry
from ..models.modality import TOKEN_IDS_NAME
from . import accounting
from ._checks import (DEFAULT_MODALITY, KINDS, MAX_DEPTH, MAX_KV_UNITS, MAX_MODALITIES, MAX_TOKENS, SCHEMA_VERSION,
                      STREAMED, check_choice, check_int, check_str, is_num, key_path, split_codes)
from ._compress import compress, flat_rules
from ._fields import PLAN_BITS, BitRule, Provenance, QuantizerSettings, Reference, check_correction_rank
from ._files import atomic_write_text, check_size, decode_plan_bytes, read_plan_bytes
from ._keybasis import FeedbackMetric, KeyBasis
from ._parse import check_stated_bpv, plan_fields
from ._rope import as_floats, check_rope_inv_freq, layer_rope_inv_freq, normalize_rope_inv_freq, rope_to_yaml
from ._yaml import dump_plan_yaml, parse_plan_yaml


@dataclass(frozen=True)
class Plan:
    """A mixed-precision KV-cache plan for one model geometry.

    Build one with :func:`kvplan.baseline_plan`, :meth:`Plan.from_table` or
    :meth:`Plan.from_yaml`; resolve it to per-slot bits with :meth:`table`.
    """

    geometry: Geometry
    modalities: tuple[str, ...] = (DEFAULT_MODALITY,)
    quantizer: QuantizerSettings = field(default_factory=QuantizerSettings)
    default_bits: int = 16
    rules: tuple[BitRule, ...] = ()
    target_bpv: float | None = None
    reference: Reference = field(default_factory=Reference)
    provenance: Provenance = field(default_factory=Provenance)
    metrics: Mapping[str, Any] = field(default_factory=dict)
    name: str | None = None
    key_basis: KeyBasis | None = None  # required when quantizer.key_correction_rank > 0
    # the model's RoPE inverse frequencies [d/2], d <= head_dim; required when quantizer.key_pre_rope;
    # one tuple for every layer, or a dict layer type -> tuple (several RoPE bases, see _rope)
    rope_inv_freq: tuple[float, ...] | Mapping[str, tuple[float, ...]] | None = None
    # name of the token labelling the plan was searched with (kvplan.Labelling); kvplan.load
    # refuses the plan under another one
    labelling: str = TOKEN_IDS_NAME
    # metrics [L, 2, H_kv, D, D] of the error-feedback encoder (kvplan.kernels.feedback); None:
    # codes are rounded to the nearest level
    feedback_metric: FeedbackMetric | None = None

    def __post_init__(self):
        object.__setattr__(self, "modalities", tuple(self.modalities))
        object.__setattr__(self, "rope_inv_freq", normalize_rope_inv_freq(self.rope_inv_freq))
        object.__setattr__(self, "rules", tuple(self.rules))
        if self.key_basis is not None and not isinstance(self.key_basis, KeyBasis):
            object.__setattr__(self, "key_basis", KeyBasis(self.key_basis))
        if self.feedback_metric is not None and not isinstance(self.feedback_metric, FeedbackMetric):
            object.__setattr__(self, "feedback_metric", FeedbackMetric(self.feedback_metric))
        _validate_semantics(self)
        if self.rope_inv_freq is not None:  # numbers, checked above
            object.__setattr__(self, "rope_inv_freq", as_floats(self.rope_inv_freq))

    def layer_inv_freq(self, layer: int) -> tuple[float, ...] | None:
        """RoPE inverse frequencies of ``layer``'s keys (``None``: the plan carries none)."""
        return layer_rope_inv_freq(self.rope_inv_freq, self.geometry, layer)

    # ------------------------------------------------------------------ resolution
    def code_table(self) -> np.ndarray:
        """Format code per slot ``int [num_layers, num_kv_heads, 2 (k, v), n_modalities]``: the
        bits, plus :data:`CORRECTED` for key slots that store the key correction."""
        g = self.geometry
        t = np.full((g.num_layers, g.num_kv_heads, 2, len(self.modalities)), self.default_bits, dtype=np.int64)
        for r in self.rules:
            t[_rule_index(r, self.modalities, t.shape)] = r.code
        return t

    def table(self) -> np.ndarray:
        """Bits per slot as ``int [num_layers, num_kv_heads, 2 (k, v), n_modalities]``."""
        return split_codes(self.code_table())[0]

    def correction_table(self) -> np.ndarray:
        """``bool [num_layers, num_kv_heads, 2, n_modalities]``: slots storing the key correction."""
        return split_codes(self.code_table())[1]

    def streamed_heads(self) -> list[tuple[int, int]]:
        """The ``(layer, KV head)``s this plan streams (their slots at bits 0, :data:`STREAMED`), in layer
        then head order (validation makes a streamed head's every slot say 0)."""
        return [(int(l), int(h)) for l, h in np.argwhere((self.code_table() == STREAMED)[:, :, 0, 0])]

    def slot_bits(self, layer: int, head: int, kind: str, modality: str) -> int:
        """Bits of one slot (0: a streamed head's)."""
        check_int(layer, "layer", 0, self.geometry.num_layers - 1)  # -1 would read the last layer's
        check_int(head, "head", 0, self.geometry.num_kv_heads - 1)
        check_choice(kind, "kind", KINDS)
        check_choice(modality, "modality", self.modalities)
        return int(self.table()[layer, head, KINDS.index(kind), self.modalities.index(modality)])

    def __hash__(self) -> int:  # the generated one hashed the metrics dict: hash(plan) always failed
        """Equal plans hash alike: by :meth:`content_digest` and what it leaves out but ``==`` compares."""
        return hash((self.content_digest(), self.name, self.target_bpv))

    @classmethod
    def from_table(cls, table: np.ndarray, geometry: Geometry, modalities=(DEFAULT_MODALITY,), **kwargs) -> "Plan":
        """Plan with exactly these per-slot bits (or format codes, see :meth:`code_table`),
        written compactly as a default plus rules."""
        modalities = tuple(modalities)
        table = whole_table(table)
        expected = (geometry.num_layers, geometry.num_kv_heads, 2, len(modalities))
        if table.shape != expected:
            raise PlanError("bits", f"table shape must be {expected}", table.shape)
        default, rules = compress(table, modalities)
        return cls(geometry=geometry, modalities=modalities, default_bits=default, rules=tuple(rules), **kwargs)

    def with_table(self, table: np.ndarray, **changes) -> "Plan":
        """Copy with new per-slot bits or format codes (and any other field changes)."""
        default, rules = compress(whole_table(table), self.modalities)
        return replace(self, default_bits=default, rules=tuple(rules), **changes)

    def replace(self, **changes) -> "Plan":
        return replace(self, **changes)

    # ------------------------------------------------------------------ bpv
    def bpv(self, geometry: Geometry | None = None, context_len: int | None = None, modality_mix=None,
            full_precision_bits: int | None = None):
        """Honest bits per value the runtime stores for this plan (see ``plans.accounting``).

        Defaults to the plan's own geometry and reference (context length, modality mix; at the
        reference length with no mix given, the measured ``reference.layout`` when there is one).
        """
        if geometry is not None and not isinstance(geometry, Geometry):  # plan.bpv(768) meant a context length
            raise PlanError("geometry", "must be a kvplan.Geometry (a context length is plan.bpv(context_len=N))",
                            geometry)
        ref = self.reference
        if context_len is not None:  # a numpy integer (a length read off an array) is a whole number too
            context_len = check_int(int(context_len) if isinstance(context_len, np.integer) else context_len,
                                    "context_len", 1, MAX_TOKENS)
        if full_precision_bits is not None:
            full_precision_bits = check_choice(int(full_precision_bits) if isinstance(full_precision_bits, np.integer)
                                               else full_precision_bits, "full_precision_bits", (16, 32))
        return accounting.plan_bpv(
            self,
            geometry or self.geometry,
            context_len if context_len is not None else ref.context_len,
            self.bpv_layout(context_len, modality_mix),
            full_precision_bits if full_precision_bits is not None else ref.full_precision_bits,
        )

    def bpv_layout(self, context_len: int | None = None, modality_mix=None):
        """The token layout :meth:`bpv` counts: the measured ``reference.layout``'s labels at the
        reference length with no mix given, else ``modality_mix`` (default: the reference mix)."""
        ref = self.reference
        if context_len in (None, ref.context_len) and modality_mix is None and ref.layout is not None:
            return ref.labels()
        return modality_mix if modality_mix is not None else ref.modality_mix

    def check_geometry(self, geometry: Geometry, source: str | None = None) -> None:
        """Raise :class:`PlanError` unless this plan was made for ``geometry``."""
        mine = self.geometry
        for name in ("model_type", "num_layers", "num_kv_heads", "head_dim", "layer_types", "sliding_window"):
            a, b = getattr(mine, name), getattr(geometry, name)
            if name == "sliding_window" and a is None:  # a plan file from before windows were recorded
                continue
            if a != b:
                raise PlanError(f"model.{name}", f"plan was made for {a!r} but the model has {b!r}",
                                show_value=False, source=source)

    # ------------------------------------------------------------------ YAML
    def to_dict(self, flat: bool = False) -> dict:
        g = self.geometry
        lt = g.layer_types[0] if len(set(g.layer_types)) == 1 else list(g.layer_types)
        if flat:
            rules = [_rule_to_dict(r) for r in flat_rules(self.code_table(), self.modalities)]
            default = int(self.default_bits)
        else:
            rules = [_rule_to_dict(r) for r in self.rules]
            default = self.default_bits
        bpv = self.bpv()
        d = {
            "schema_version": SCHEMA_VERSION,
            "name": self.name,
            "model": {
                "model_type": g.model_type,
                "num_layers": g.num_layers,
                "num_kv_heads": g.num_kv_heads,
                "head_dim": g.head_dim,
                "layer_types": lt,
                **({"sliding_window": g.sliding_window} if g.sliding_window is not None else {}),
                "fingerprint": g.fingerprint,
            },
            "modalities": list(self.modalities),
            **({"labelling": self.labelling} if self.labelling != TOKEN_IDS_NAME else {}),
            "quantizer": {
                "group_size": self.quantizer.group_size,
                "key_axis": self.quantizer.key_axis,
                "value_axis": self.quantizer.value_axis,
                "residual_length": self.quantizer.residual_length,
                "sink_length": self.quantizer.sink_length,
                **({"key_correction_rank": self.quantizer.key_correction_rank,
                    "key_correction_bits": self.quantizer.key_correction_bits}
                   if self.quantizer.key_correction_rank else {}),
                **({"rotation": self.quantizer.rotation} if self.quantizer.rotation != "none" else {}),
                **({"key_pre_rope": True} if self.quantizer.key_pre_rope else {}),
                **({"key_scaling": self.quantizer.key_scaling, "value_scaling": self.quantizer.value_scaling}
                   if not self.quantizer.v1_formats else {}),
                **({"codebooks": self.quantizer.codebooks_dict()} if self.quantizer.codebooks else {}),
                **({"residual_bits": self.quantizer.residual_bits}
                   if self.quantizer.residual_bits != FULL_PRECISION_BITS else {}),
                **({"recent_length": self.quantizer.recent_length} if self.quantizer.recent_length else {}),
                **({"sink_bits": self.quantizer.sink_bits}
                   if self.quantizer.sink_bits != FULL_PRECISION_BITS else {}),
                **({"heavy_length": self.quantizer.heavy_length} if self.quantizer.heavy_length else {}),
                **({"stream_window": self.quantizer.stream_window} if self.quantizer.stream_window else {}),
            },
            "bits": {"default": default, "rules": rules},
            "budget": {
                "target_bpv": self.target_bpv,
                "reference": {
                    "context_len": self.reference.context_len,
                    "modality_mix": {k: v for k, v in self.reference.modality_mix},
                    "full_precision_bits": self.reference.full_precision_bits,
                    **({"layout": [list(r) for r in self.reference.layout]} if self.reference.layout else {}),
                },
                "bpv": {k: round(v, 6) for k, v in bpv.as_dict().items()},
            },
            "provenance": {
                "kvplan_version": self.provenance.kvplan_version,
                "produced_by": self.provenance.produced_by,
                "seed": self.provenance.seed,
                "data_hash": self.provenance.data_hash,
            },
            "metrics": _plain(self.metrics),
        }
        if self.name is None:
            del d["name"]
        if self.rope_inv_freq is not None:
            d["rope_inv_freq"] = rope_to_yaml(self.rope_inv_freq)
        if self.key_basis is not None:
            d["key_basis"] = self.key_basis.to_dict()
        if self.feedback_metric is not None:
            d["feedback_metric"] = self.feedback_metric.to_dict()
        return d

    def content_digest(self) -> str:
        """``sha256:<16 hex>`` of what a measurement of this plan depends on: the model geometry, modalities,
        labelling, quantizer, every slot's format code, the budget's reference, and the key-correction basis,
        RoPE frequencies and error-feedback metric; not its name, provenance, metrics or stated bpv, nor how
        its rules are written. The search records it (``metrics.search.plan_digest``)."""
        d = self.to_dict()
        for key in ("schema_version", "name", "provenance", "metrics", "bits"):
            d.pop(key, None)
        d["budget"] = {"reference": d["budget"]["reference"]}
        d["codes"] = self.code_table().tolist()
        text = json.dumps(d, sort_keys=True, default=str, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]

    def edited_note(self) -> str | None:
        """One line when this plan was edited since its search measured it (another :meth:`content_digest`,
        or for plans without one another bpv than ``metrics.bpv``): its ``metrics`` are not this plan's."""
        metrics = self.metrics if isinstance(self.metrics, Mapping) else {}
        search = metrics.get("search") if isinstance(metrics.get("search"), Mapping) else {}
        recorded = search.get("plan_digest")
        if isinstance(recorded, str):
            now = self.content_digest()
            return None if recorded == now else (
                f"edited since its search measured it (metrics.search.plan_digest {recorded}, this plan {now}): "
                "its metrics are the searched plan's, not this one's; re-measure it with kvplan eval")
        stated = metrics.get("bpv", {}).get("total") if isinstance(metrics.get("bpv"), Mapping) else None
        total = self.bpv().total
        if isinstance(stated, (int, float)) and not isinstance(stated, bool) and math.isfinite(stated) and \
                not math.isclose(stated, total, rel_tol=1e-9, abs_tol=1e-12):
            return (f"edited since it was measured (metrics.bpv.total {stated:.6g}, this plan {total:.6g} bpv): "
                    "its metrics are another plan's; re-measure it with kvplan eval")
        return None

    def over_target_note(self) -> str | None:
        """One line when this plan's honest bpv exceeds its ``target_bpv``."""
        total = self.bpv().total
        if self.target_bpv is not None and total > self.target_bpv + 1e-9:
            return f"its honest bpv {total:.4f} exceeds its budget.target_bpv {self.target_bpv:g}"
        return None

    def measurement_notes(self) -> list[str]:
        """What a reader of this plan's ``metrics`` must know, one line each: :meth:`edited_note` and
        :meth:`over_target_note`."""
        return [note for note in (self.edited_note(), self.over_target_note()) if note]

    def to_yaml(self, path: str | os.PathLike | None = None, flat: bool = False) -> str:
        """Serialize; with ``path`` the file is written atomically (temp file + rename). A plan whose file would
        not read back (sliding layers without their window: a version-1 file's, or a Geometry built without
        one) is refused."""
        g = self.geometry
        if g.sliding_window is None and "sliding" in g.layer_types:  # a file of this schema must record it
            raise PlanError("model.sliding_window", "missing: the plan has sliding layers, and a plan file records "
                            "their window (give the Geometry its sliding_window, e.g. Geometry.of(model))",
                            show_value=False)
        text = "# kvplan plan — load with kvplan.load(model, this_file)\n" + dump_plan_yaml(self.to_dict(flat=flat))
        if path is not None:
            atomic_write_text(path, text)
        return text

    @classmethod
    def from_dict(cls, d, source: str | None = None) -> "Plan":
        """A plan from its document (as ``yaml.safe_load`` gives it), strictly validated."""
        try:
            plan = cls(**plan_fields(d))
            check_stated_bpv(plan, d["budget"].get("bpv") if "budget" in d else None)
            return plan
        except PlanError as e:
            raise e.with_source(source) if source else e

    @classmethod
    def from_yaml(cls, path_or_text: str | bytes | os.PathLike) -> "Plan":
        """Load a plan from a YAML file path, YAML text or the bytes of a file (bounded YAML
        loader, strict validation). A one-line string is a path when it names an existing
        file or folder or ends in ``.yaml`` / ``.yml``."""
        source = None
        if isinstance(path_or_text, bytes):
            check_size(path_or_text, None)
            text = decode_plan_bytes(path_or_text, None)
        elif isinstance(path_or_text, os.PathLike) or (
            isinstance(path_or_text, str) and "\n" not in path_or_text
            and (path_or_text.endswith((".yaml", ".yml")) or os.path.exists(path_or_text))
        ):
            source = os.fspath(path_or_text)
            text = decode_plan_bytes(read_plan_bytes(source), source)
        elif isinstance(path_or_text, str):
            text = path_or_text
        else:
            raise PlanError("plan", "expected a file path or YAML text", type(path_or_text).__name__)
        check_size(text, source)
        data = parse_plan_yaml(text, source)
        if source is None and "\n" not in text and text.strip() and not isinstance(data, dict):  # "int3", "4", "-"
            raise PlanError(FILE_PATH, "no such plan file (nor the YAML text of a plan)", show_value=False,
                            source=text.strip())
        return cls.from_dict(data, source=source)


def _rule_index(r: BitRule, modalities, shape):
    """Open-mesh index of the slots a rule selects (outer product of its selectors)."""
    n_layers, n_heads, _, _ = shape
    return np.ix_(
        list(range(n_layers)) if r.layers is None else list(r.layers),
        list(range(n_heads)) if r.heads is None else list(r.heads),
        [0, 1] if r.kind is None else [KINDS.index(r.kind)],
        list(range(len(modalities))) if r.modality is None else [modalities.index(r.modality)],
    )


def _rule_to_dict(r: BitRule) -> dict:
    d = {}
    if r.layers is not None:
        d["layers"] = list(r.layers)
    if r.heads is not None:
        d["heads"] = list(r.heads)
    if r.kind is not None:
        d["kind"] = r.kind
    if r.modality is not None:
        d["modality"] = r.modality
    d["bits"] = r.bits
    if r.correct:
        d["correct"] = True
    return d


def _plain(obj):
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _check_metrics(obj, path, depth=0):
    if depth > MAX_DEPTH:
        raise PlanError(path, f"metrics nest deeper than {MAX_DEPTH} levels", show_value=False)
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise PlanError(key_path(path, k), "metric names must be strings", k)
            _check_metrics(v, key_path(path, k), depth + 1)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _check_metrics(v, f"{path}[{i}]", depth + 1)
    elif not (obj is None or isinstance(obj, (str, bool)) or is_num(obj)):
        raise PlanError(path, "metrics hold only finite numbers, strings, booleans, null, lists and mappings", obj)


def whole_table(table) -> np.ndarray:
    """``table`` (per-slot bits or format codes) as ``int64``; a value that is not a whole number is refused
    (converting it would truncate 2.9 bits to 2 without a word)."""
    arr = np.asarray(table)
    if arr.dtype.kind in "iu":
        return arr.astype(np.int64)
    flat = arr.ravel()
    for value in flat:
        whole = isinstance(value, (int, np.integer)) or (isinstance(value, (float, np.floating))
                                                         and math.isfinite(value) and float(value).is_integer())
        if isinstance(value, (bool, np.bool_)) or not whole:
            raise PlanError("bits", "per-slot bits must be whole numbers", value.item() if hasattr(value, "item")
                            else value)
    return arr.astype(np.int64)


def _validate_semantics(p: Plan) -> None:
    g = p.geometry
    if p.name is not None:  # what a plan file may hold (the parser's checks), so that a written plan reads back
        check_str(p.name, "name")
    check_str(g.model_type, "model.model_type")
    if not isinstance(p.provenance, Provenance):
        raise PlanError("provenance", "must be a kvplan.plans.Provenance", p.provenance)
    if g.num_layers * g.num_kv_heads > MAX_KV_UNITS:
        raise PlanError("model", f"num_layers x num_kv_heads is {g.num_layers * g.num_kv_heads}; plans cover at "
                        f"most {MAX_KV_UNITS} (layer, KV head) pairs", show_value=False)
    for i, m in enumerate(p.modalities):
        check_str(m, f"modalities[{i}]")
    check_str(p.labelling, "labelling")
    if not p.modalities or len(set(p.modalities)) != len(p.modalities):
        raise PlanError("modalities", "must be a non-empty list of distinct names", list(p.modalities))
    if len(p.modalities) > MAX_MODALITIES:
        raise PlanError("modalities", f"has {len(p.modalities)} names; at most {MAX_MODALITIES}", show_value=False)
    if DEFAULT_MODALITY not in p.modalities:
        raise PlanError("modalities", f"must include {DEFAULT_MODALITY!r} (generated tokens are text)",
                        list(p.modalities))
    check_choice(p.default_bits, "bits.default", PLAN_BITS)
    for i, r in enumerate(p.rules):
        path = f"bits.rules[{i}]"
        for name, n in (("layers", g.num_layers), ("heads", g.num_kv_heads)):
            sel = getattr(r, name)
            if sel is None:
                continue
            if len(sel) == 0:
                raise PlanError(f"{path}.{name}", "must not be empty (omit the key to match all)", [])
            for j, idx in enumerate(sel):
                check_int(idx, f"{path}.{name}[{j}]", 0, n - 1)
        if r.correct:
            if not p.quantizer.key_correction_rank:
                raise PlanError(f"{path}.correct", "needs quantizer.key_correction_rank > 0 (and key_basis)", True)
            if r.kind != "k":
                raise PlanError(f"{path}.correct", "applies to keys only: the rule must say kind: k", True)
            if r.bits == FULL_PRECISION_BITS:
                raise PlanError(f"{path}.correct", "full-precision slots have no quantization error to correct",
                                True)
        if r.modality is not None and r.modality not in p.modalities:
            raise PlanError(f"{path}.modality", f"is not one of the plan's modalities {list(p.modalities)}",
                            r.modality)
    if p.target_bpv is not None and not (is_num(p.target_bpv) and p.target_bpv > 0):
        raise PlanError("budget.target_bpv", "must be a positive number or null", p.target_bpv)
    mix = p.reference.modality_mix
    if not mix:
        raise PlanError("budget.reference.modality_mix", "must name at least one modality", {})
    for name, _ in mix:  # names and fractions themselves: checked by Reference
        if name not in p.modalities:
            raise PlanError(key_path("budget.reference.modality_mix", name),
                            f"is not one of the plan's modalities {list(p.modalities)}", name)
    if abs(sum(f for _, f in mix) - 1.0) > 1e-6:
        raise PlanError("budget.reference.modality_mix", "fractions must sum to 1", dict(mix))
    if not isinstance(p.metrics, Mapping):
        raise PlanError("metrics", "must be a mapping", p.metrics)
    _check_metrics(p.metrics, "metrics")
    rank = p.quantizer.key_correction_rank
    check_correction_rank(rank, g.head_dim)
    if rank and p.key_basis is None:
        raise PlanError("key_basis", f"missing: quantizer.key_correction_rank is {rank}, so the plan must carry the "
                        "per-head query bases", show_value=False)
    if p.key_basis is not None:
        want = (g.num_layers, g.num_kv_heads, g.head_dim, rank)
        if not rank:
            raise PlanError("key_basis", "given but quantizer.key_correction_rank is 0 (correction off)",
                            show_value=False)
        if p.key_basis.shape != want:
            raise PlanError("key_basis.shape", f"must be [num_layers, num_kv_heads, head_dim, key_correction_rank] = "
                            f"{list(want)}", list(p.key_basis.shape))
    if p.feedback_metric is not None:
        want = (g.num_layers, 2, g.num_kv_heads, g.head_dim, g.head_dim)
        if p.feedback_metric.shape != want:
            raise PlanError("feedback_metric.shape", f"must be {FeedbackMetric.AXES} = {list(want)}",
                            list(p.feedback_metric.shape))
        frame = p.feedback_metric.frame
        settings = {k: getattr(p.quantizer, k) for k in FeedbackMetric.FRAME_KEYS}
        if frame is not None and frame != settings:
            raise PlanError("feedback_metric.frame", f"the metrics were computed in the stored frame of {frame}, but "
                            f"the quantizer says {settings}: they would steer the codes in another frame (worse "
                            "than nearest-level codes); search again, or delete feedback_metric", frame)
    _check_streamed(p)
    if p.quantizer.rotation == "hadamard" and not hadamard_fits(g.head_dim):
        raise PlanError("quantizer.rotation", f"'hadamard' needs a power-of-two head_dim; the model's is {g.head_dim}",
                        p.quantizer.rotation)
    if p.quantizer.key_pre_rope and p.rope_inv_freq is None:
        raise PlanError("rope_inv_freq", "missing: quantizer.key_pre_rope is true, so the plan must carry the "
                        "model's RoPE inverse frequencies", show_value=False)
    if p.rope_inv_freq is not None:
        if not p.quantizer.key_pre_rope:
            raise PlanError("rope_inv_freq", "given but quantizer.key_pre_rope is false", show_value=False)
        check_rope_inv_freq(p.rope_inv_freq, g)




def _check_streamed(p: Plan) -> None:
    """Streamed KV heads (bits 0): every slot of such a head (K and V, each modality) says 0, in
    full-attention layers or sliding ones whose window holds the head's copies
    (:func:`~kvplan.plans.accounting.stream_fits_window`), with ``quantizer.stream_window`` >= 1 and
    without heavy-hitter copies."""
    codes = p.code_table()  # [L, H_kv, 2, M]
    streamed = codes == STREAMED
    if not streamed.any():
        return
    q = p.quantizer
    if q.stream_window < 1:
        raise PlanError("quantizer.stream_window", "must be at least 1: the plan streams KV heads (bits 0)",
                        q.stream_window)
    if q.heavy_length:
        raise PlanError("quantizer.heavy_length", "heavy-hitter copies and streamed KV heads (bits 0) are not "
                        "supported together", q.heavy_length)
    per_head = streamed.reshape(*streamed.shape[:2], -1)  # [L, H_kv, 2 * M]
    partial = per_head.any(-1) & ~per_head.all(-1)
    if partial.any():
        layer, head = (int(i) for i in np.argwhere(partial)[0])
        raise PlanError("bits", f"layer {layer} KV head {head}: bits 0 (a streamed head) must cover its keys and "
                        "values in every modality", show_value=False)
    for layer in np.nonzero(per_head.any(axis=(1, 2)))[0]:
        window = p.geometry.window(int(layer))
        if not accounting.stream_fits_window(q, window):
            raise PlanError("bits", f"layer {int(layer)} is a sliding layer of window {window}: its streamed heads' "
                            f"copies (stream_window {q.stream_window} + recent_length {q.recent_length}) and the "
                            f"tokens not committed yet (residual_length {q.residual_length} + group_size "
                            f"{q.group_size}) must fit in the window", show_value=False)
