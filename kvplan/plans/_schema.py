"""The plan: dataclasses, strict YAML (de)serialization and per-slot resolution.

A plan assigns bits to every *slot* ``(layer, kv_head, kind in {k, v}, modality)``:
a default, then rules applied in order (later rules win). See README "Plan file format".
"""

from __future__ import annotations

import base64
import math
import os
import tempfile
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import numpy as np
import yaml

from .._version import __version__
from ..errors import PlanError
from ..kernels.qtypes import FULL_PRECISION_BITS, GROUP_SIZES, SUPPORTED_BITS
from ..kernels.rotation import hadamard_fits
from ..models.geometry import LAYER_TYPES, Geometry

SCHEMA_VERSION = 1
KINDS = ("k", "v")
AXES = ("channel", "token")
CORRECTION_BITS = (2, 3, 4, 8)
ROTATIONS = ("none", "hadamard")  # quantizer.rotation (see kvplan.kernels.rotation)
# format code of a key slot stored at ``b`` bits with the key correction: ``b + CORRECTED``
# (``Plan.code_table``); plain bits are codes below it
CORRECTED = 100


def split_codes(codes):
    """``(bits, corrected)`` of format codes (an int or an int array): see :data:`CORRECTED`."""
    return codes % CORRECTED, codes >= CORRECTED
DEFAULT_MODALITY = "text"


# ----------------------------------------------------------------------------- checks
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _check_keys(obj, path: str, required: Sequence[str], optional: Sequence[str] = ()) -> None:
    if not isinstance(obj, Mapping):
        raise PlanError(path or "<root>", "must be a mapping", obj)
    for k in obj:
        if k not in required and k not in optional:
            allowed = ", ".join(list(required) + list(optional))
            raise PlanError(f"{path}.{k}" if path else str(k), f"unknown key (allowed: {allowed})", obj[k])
    for k in required:
        if k not in obj:
            raise PlanError(f"{path}.{k}" if path else k, "missing required key", show_value=False)


def _int(obj, path, lo=None, hi=None) -> int:
    if not _is_int(obj):
        raise PlanError(path, "must be an integer", obj)
    if (lo is not None and obj < lo) or (hi is not None and obj > hi):
        raise PlanError(path, f"must be in [{lo}, {hi if hi is not None else 'inf'}]", obj)
    return obj


def _choice(obj, path, choices) -> Any:
    wrong_type = any(_is_int(c) for c in choices) and not _is_int(obj)
    if wrong_type or isinstance(obj, bool) or obj not in choices:
        raise PlanError(path, f"must be one of {list(choices)}", obj)
    return obj


def _str(obj, path) -> str:
    if not isinstance(obj, str) or not obj:
        raise PlanError(path, "must be a non-empty string", obj)
    return obj


# ----------------------------------------------------------------------------- dataclasses
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
        _choice(self.group_size, "quantizer.group_size", GROUP_SIZES)
        _choice(self.key_axis, "quantizer.key_axis", AXES)
        _choice(self.value_axis, "quantizer.value_axis", AXES)
        _int(self.residual_length, "quantizer.residual_length", 0)
        _int(self.sink_length, "quantizer.sink_length", 0)
        _int(self.key_correction_rank, "quantizer.key_correction_rank", 0)
        _choice(self.key_correction_bits, "quantizer.key_correction_bits", CORRECTION_BITS)
        _choice(self.rotation, "quantizer.rotation", ROTATIONS)
        if not isinstance(self.key_pre_rope, bool):
            raise PlanError("quantizer.key_pre_rope", "must be true or false", self.key_pre_rope)
        if self.key_correction_rank and self.key_axis != "channel":
            raise PlanError("quantizer.key_correction_rank", "needs key_axis 'channel' (the correction code shares "
                            "the keys' token groups)", self.key_correction_rank)

    def axis(self, kind: str) -> str:
        return self.key_axis if kind == "k" else self.value_axis


class KeyBasis:
    """Per-layer, per-KV-head orthonormal bases ``U [L, H_kv, D, r]`` of the key correction.

    Learned offline from calibration queries (top eigenvectors of ``E[q qᵀ]`` over the
    post-RoPE queries a KV head serves). A key ``k`` stored at low bits as ``k̂`` also stores
    ``ẑ ≈ Uᵀ (k - k̂)`` and is read as ``k̂ + U ẑ``: the part of the error queries can see.
    Held as float16 (as written in the plan); part of the plan, like the bit table, not of
    the per-token cache bytes.
    """

    def __init__(self, basis):
        a = np.asarray(basis, dtype=np.float16)
        if a.ndim != 4:
            raise PlanError("key_basis.shape", "must be [num_layers, num_kv_heads, head_dim, rank]", list(a.shape))
        if not np.isfinite(a).all():
            raise PlanError("key_basis", "holds non-finite values", show_value=False)
        a.setflags(write=False)
        self.array = a

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    def __eq__(self, other) -> bool:
        return isinstance(other, KeyBasis) and np.array_equal(self.array, other.array)

    __hash__ = None

    def __repr__(self) -> str:
        return f"KeyBasis(shape={list(self.shape)})"

    def to_dict(self) -> dict:
        data = np.ascontiguousarray(self.array, dtype="<f2").tobytes()
        return {"dtype": "float16", "shape": list(self.shape), "base64": base64.b64encode(data).decode("ascii")}

    @classmethod
    def from_dict(cls, d) -> "KeyBasis":
        _check_keys(d, "key_basis", ["dtype", "shape", "base64"])
        _choice(d["dtype"], "key_basis.dtype", ("float16",))
        shape = d["shape"]
        if not isinstance(shape, list) or len(shape) != 4:
            raise PlanError("key_basis.shape", "must be a list [num_layers, num_kv_heads, head_dim, rank]", shape)
        for i, n in enumerate(shape):
            _int(n, f"key_basis.shape[{i}]", 1)
        if not isinstance(d["base64"], str):
            raise PlanError("key_basis.base64", "must be a base64 string", show_value=False)
        try:
            raw = base64.b64decode(d["base64"].encode("ascii"), validate=True)
        except (ValueError, UnicodeEncodeError):
            raise PlanError("key_basis.base64", "is not valid base64", show_value=False) from None
        n = int(np.prod(shape))
        if len(raw) != 2 * n:
            raise PlanError("key_basis.base64", f"decodes to {len(raw)} bytes; shape {shape} in float16 needs "
                            f"{2 * n}", show_value=False)
        return cls(np.frombuffer(raw, dtype="<f2").reshape(shape))


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
        _choice(self.bits, "bits", SUPPORTED_BITS)
        if self.kind is not None:
            _choice(self.kind, "kind", KINDS)
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
        _int(self.context_len, "budget.reference.context_len", 1)
        mix = tuple((str(k), float(v)) for k, v in (
            self.modality_mix.items() if isinstance(self.modality_mix, Mapping) else self.modality_mix))
        object.__setattr__(self, "modality_mix", mix)
        _choice(self.full_precision_bits, "budget.reference.full_precision_bits", (16, 32))


@dataclass(frozen=True)
class Provenance:
    kvplan_version: str = __version__
    produced_by: str = "manual"
    seed: int | None = None
    data_hash: str | None = None


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
    # the model's RoPE inverse frequencies [d/2], d <= head_dim; required when quantizer.key_pre_rope
    rope_inv_freq: tuple[float, ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "modalities", tuple(self.modalities))
        if self.rope_inv_freq is not None:
            object.__setattr__(self, "rope_inv_freq", tuple(self.rope_inv_freq))
        object.__setattr__(self, "rules", tuple(self.rules))
        if self.key_basis is not None and not isinstance(self.key_basis, KeyBasis):
            object.__setattr__(self, "key_basis", KeyBasis(self.key_basis))
        _validate_semantics(self)
        if self.rope_inv_freq is not None:  # numbers, checked above
            object.__setattr__(self, "rope_inv_freq", tuple(float(f) for f in self.rope_inv_freq))

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

    def slot_bits(self, layer: int, head: int, kind: str, modality: str) -> int:
        return int(self.table()[layer, head, KINDS.index(kind), self.modalities.index(modality)])

    @classmethod
    def from_table(cls, table: np.ndarray, geometry: Geometry, modalities=(DEFAULT_MODALITY,), **kwargs) -> "Plan":
        """Plan with exactly these per-slot bits (or format codes, see :meth:`code_table`),
        written compactly as a default plus rules."""
        modalities = tuple(modalities)
        table = np.asarray(table, dtype=np.int64)
        expected = (geometry.num_layers, geometry.num_kv_heads, 2, len(modalities))
        if table.shape != expected:
            raise PlanError("bits", f"table shape must be {expected}", table.shape)
        default, rules = _compress(table, modalities)
        return cls(geometry=geometry, modalities=modalities, default_bits=default, rules=tuple(rules), **kwargs)

    def with_table(self, table: np.ndarray, **changes) -> "Plan":
        """Copy with new per-slot bits or format codes (and any other field changes)."""
        default, rules = _compress(np.asarray(table, dtype=np.int64), self.modalities)
        return replace(self, default_bits=default, rules=tuple(rules), **changes)

    def replace(self, **changes) -> "Plan":
        return replace(self, **changes)

    # ------------------------------------------------------------------ bpv
    def bpv(self, geometry: Geometry | None = None, context_len: int | None = None, modality_mix=None,
            full_precision_bits: int | None = None):
        """Honest bits per value the runtime stores for this plan (see ``plans.accounting``).

        Defaults to the plan's own geometry and reference (context length, modality mix).
        """
        from .accounting import plan_bpv

        ref = self.reference
        return plan_bpv(
            self,
            geometry or self.geometry,
            context_len if context_len is not None else ref.context_len,
            modality_mix if modality_mix is not None else ref.modality_mix,
            full_precision_bits if full_precision_bits is not None else ref.full_precision_bits,
        )

    def check_geometry(self, geometry: Geometry, source: str | None = None) -> None:
        """Raise :class:`PlanError` unless this plan was made for ``geometry``."""
        mine = self.geometry
        for name in ("model_type", "num_layers", "num_kv_heads", "head_dim", "layer_types"):
            a, b = getattr(mine, name), getattr(geometry, name)
            if a != b:
                raise PlanError(f"model.{name}", f"plan was made for {a!r} but the model has {b!r}",
                                show_value=False, source=source)

    # ------------------------------------------------------------------ YAML
    def to_dict(self, flat: bool = False) -> dict:
        g = self.geometry
        lt = g.layer_types[0] if len(set(g.layer_types)) == 1 else list(g.layer_types)
        if flat:
            rules = [_rule_to_dict(r) for r in _flat_rules(self.code_table(), self.modalities)]
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
                "fingerprint": g.fingerprint,
            },
            "modalities": list(self.modalities),
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
            },
            "bits": {"default": default, "rules": rules},
            "budget": {
                "target_bpv": self.target_bpv,
                "reference": {
                    "context_len": self.reference.context_len,
                    "modality_mix": {k: v for k, v in self.reference.modality_mix},
                    "full_precision_bits": self.reference.full_precision_bits,
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
            d["rope_inv_freq"] = list(self.rope_inv_freq)
        if self.key_basis is not None:
            d["key_basis"] = self.key_basis.to_dict()
        return d

    def to_yaml(self, path: str | os.PathLike | None = None, flat: bool = False) -> str:
        """Serialize; with ``path`` the file is written atomically (temp file + rename)."""
        text = "# kvplan plan — load with kvplan.load(model, this_file)\n" + yaml.dump(
            _flow_rules(self.to_dict(flat=flat)), Dumper=_PlanDumper, sort_keys=False, width=120
        )
        if path is not None:
            atomic_write_text(path, text)
        return text

    @classmethod
    def from_dict(cls, d, source: str | None = None) -> "Plan":
        try:
            return _plan_from_dict(d)
        except PlanError as e:
            raise e.with_source(source) if source else e

    @classmethod
    def from_yaml(cls, path_or_text: str | os.PathLike) -> "Plan":
        """Load a plan from a YAML file path or YAML text (``yaml.safe_load``, strict validation)."""
        source = None
        text = path_or_text
        if isinstance(path_or_text, os.PathLike) or (
            isinstance(path_or_text, str) and "\n" not in path_or_text
            and (path_or_text.endswith((".yaml", ".yml")) or os.path.isfile(path_or_text))
        ):
            source = os.fspath(path_or_text)
            try:
                with open(source, encoding="utf-8") as f:
                    text = f.read()
            except OSError as e:
                raise PlanError("<file>", f"cannot read plan file: {e.strerror}", source, source=source) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
            raise PlanError("<yaml>", f"not valid YAML at {where}: {getattr(e, 'problem', e)}",
                            show_value=False, source=source) from None
        return cls.from_dict(data, source=source)


class _FlowMap(dict):
    """A mapping written on one line (bit rules)."""


class _PlanDumper(yaml.SafeDumper):
    """Block style for sections, flow style for bit rules and lists of scalars."""


_PlanDumper.add_representer(_FlowMap, lambda d, v: d.represent_mapping("tag:yaml.org,2002:map", v, flow_style=True))
_PlanDumper.add_representer(
    list, lambda d, v: d.represent_sequence(
        "tag:yaml.org,2002:seq", v, flow_style=all(not isinstance(x, (dict, list)) for x in v)))


def _flow_rules(d: dict) -> dict:
    d["bits"]["rules"] = [_FlowMap(r) for r in d["bits"]["rules"]]
    return d


def atomic_write_text(path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same folder and an atomic rename."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# ----------------------------------------------------------------------------- internals
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


def _check_metrics(obj, path):
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise PlanError(f"{path}.{k}", "metric names must be strings", k)
            _check_metrics(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _check_metrics(v, f"{path}[{i}]")
    elif not (obj is None or isinstance(obj, (str, bool)) or _is_num(obj)):
        raise PlanError(path, "metrics hold only numbers, strings, lists and mappings", obj)


def _validate_semantics(p: Plan) -> None:
    g = p.geometry
    if not p.modalities or len(set(p.modalities)) != len(p.modalities):
        raise PlanError("modalities", "must be a non-empty list of distinct names", list(p.modalities))
    for i, m in enumerate(p.modalities):
        _str(m, f"modalities[{i}]")
    if DEFAULT_MODALITY not in p.modalities:
        raise PlanError("modalities", f"must include {DEFAULT_MODALITY!r} (generated tokens are text)",
                        list(p.modalities))
    _choice(p.default_bits, "bits.default", SUPPORTED_BITS)
    for i, r in enumerate(p.rules):
        path = f"bits.rules[{i}]"
        for name, n in (("layers", g.num_layers), ("heads", g.num_kv_heads)):
            sel = getattr(r, name)
            if sel is None:
                continue
            if len(sel) == 0:
                raise PlanError(f"{path}.{name}", "must not be empty (omit the key to match all)", [])
            for j, idx in enumerate(sel):
                _int(idx, f"{path}.{name}[{j}]", 0, n - 1)
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
    if p.target_bpv is not None and not (_is_num(p.target_bpv) and p.target_bpv > 0):
        raise PlanError("budget.target_bpv", "must be a positive number or null", p.target_bpv)
    mix = p.reference.modality_mix
    if not mix:
        raise PlanError("budget.reference.modality_mix", "must name at least one modality", {})
    for name, frac in mix:
        if name not in p.modalities:
            raise PlanError(f"budget.reference.modality_mix.{name}",
                            f"is not one of the plan's modalities {list(p.modalities)}", name)
        if not (0 <= frac <= 1):
            raise PlanError(f"budget.reference.modality_mix.{name}", "must be a fraction in [0, 1]", frac)
    if abs(sum(f for _, f in mix) - 1.0) > 1e-6:
        raise PlanError("budget.reference.modality_mix", "fractions must sum to 1", dict(mix))
    _check_metrics(p.metrics, "metrics")
    rank = p.quantizer.key_correction_rank
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
    if p.quantizer.rotation == "hadamard" and not hadamard_fits(g.head_dim):
        raise PlanError("quantizer.rotation", f"'hadamard' needs a power-of-two head_dim; the model's is {g.head_dim}",
                        p.quantizer.rotation)
    if p.quantizer.key_pre_rope and p.rope_inv_freq is None:
        raise PlanError("rope_inv_freq", "missing: quantizer.key_pre_rope is true, so the plan must carry the "
                        "model's RoPE inverse frequencies", show_value=False)
    if p.rope_inv_freq is not None:
        if not p.quantizer.key_pre_rope:
            raise PlanError("rope_inv_freq", "given but quantizer.key_pre_rope is false", show_value=False)
        n = len(p.rope_inv_freq)
        if not 1 <= n <= g.head_dim // 2:
            raise PlanError("rope_inv_freq", f"has {n} entries; must have 1 .. head_dim / 2 = {g.head_dim // 2}",
                            show_value=False)
        for i, f in enumerate(p.rope_inv_freq):
            if not _is_num(f):
                raise PlanError(f"rope_inv_freq[{i}]", "must be a number", f)
            if not (math.isfinite(f) and f > 0):
                raise PlanError(f"rope_inv_freq[{i}]", "must be a positive finite number", f)


def _rope_inv_freq(v) -> tuple:
    """The YAML list as it is (its entries are checked with the rest of the plan)."""
    if not isinstance(v, list) or not v:
        raise PlanError("rope_inv_freq", "must be a non-empty list of numbers", v)
    return tuple(v)


def _plan_from_dict(d) -> Plan:
    _check_keys(d, "", ["schema_version", "model", "bits"],
                ["name", "modalities", "quantizer", "budget", "provenance", "metrics", "key_basis",
                 "rope_inv_freq"])
    ver = d["schema_version"]
    if not _is_int(ver):
        raise PlanError("schema_version", "must be an integer", ver)
    if ver > SCHEMA_VERSION:
        raise PlanError("schema_version", f"is newer than this kvplan supports ({SCHEMA_VERSION}); upgrade kvplan",
                        ver)
    if ver < 1:
        raise PlanError("schema_version", "must be >= 1", ver)
    name = d.get("name")
    if name is not None:
        _str(name, "name")

    m = d["model"]
    _check_keys(m, "model", ["model_type", "num_layers", "num_kv_heads", "head_dim", "layer_types"], ["fingerprint"])
    n_layers = _int(m["num_layers"], "model.num_layers", 1)
    n_kv = _int(m["num_kv_heads"], "model.num_kv_heads", 1)
    hd = _int(m["head_dim"], "model.head_dim", 1)
    lt = m["layer_types"]
    if isinstance(lt, str):
        _choice(lt, "model.layer_types", LAYER_TYPES)
        lt = [lt] * n_layers
    elif isinstance(lt, list):
        if len(lt) != n_layers:
            raise PlanError("model.layer_types", f"must have num_layers={n_layers} entries", len(lt))
        for i, t in enumerate(lt):
            _choice(t, f"model.layer_types[{i}]", LAYER_TYPES)
    else:
        raise PlanError("model.layer_types", "must be 'full', 'sliding' or a list of them", lt)
    geometry = Geometry(n_layers, n_kv, hd, tuple(lt), _str(m["model_type"], "model.model_type"))
    if "fingerprint" in m and m["fingerprint"] != geometry.fingerprint:
        raise PlanError("model.fingerprint",
                        f"does not match the model fields above ({geometry.fingerprint}); the plan was edited "
                        "inconsistently", m["fingerprint"])

    modalities = d.get("modalities", [DEFAULT_MODALITY])
    if not isinstance(modalities, list):
        raise PlanError("modalities", "must be a list of names", modalities)
    for i, mod in enumerate(modalities):
        _str(mod, f"modalities[{i}]")

    q = d.get("quantizer", {})
    _check_keys(q, "quantizer", [], ["group_size", "key_axis", "value_axis", "residual_length",
                                         "sink_length", "key_correction_rank", "key_correction_bits", "rotation",
                                         "key_pre_rope"])
    quantizer = QuantizerSettings(**q)

    b = d["bits"]
    _check_keys(b, "bits", ["default"], ["rules"])
    default = _choice(b["default"], "bits.default", SUPPORTED_BITS)
    raw_rules = b.get("rules") or []
    if not isinstance(raw_rules, list):
        raise PlanError("bits.rules", "must be a list", raw_rules)
    rules = []
    for i, r in enumerate(raw_rules):
        path = f"bits.rules[{i}]"
        _check_keys(r, path, ["bits"], ["layers", "heads", "kind", "modality", "correct"])
        if "correct" in r and not isinstance(r["correct"], bool):
            raise PlanError(f"{path}.correct", "must be true or false", r["correct"])
        _choice(r["bits"], f"{path}.bits", SUPPORTED_BITS)
        for sel in ("layers", "heads"):
            if sel in r:
                v = r[sel]
                if _is_int(v):
                    v = [v]
                if not isinstance(v, list):
                    raise PlanError(f"{path}.{sel}", "must be an integer or a list of integers", v)
                for j, x in enumerate(v):
                    if not _is_int(x):
                        raise PlanError(f"{path}.{sel}[{j}]", "must be an integer", x)
        if "kind" in r:
            _choice(r["kind"], f"{path}.kind", KINDS)
        if "modality" in r:
            _str(r["modality"], f"{path}.modality")
        lay = r.get("layers")
        hed = r.get("heads")
        rules.append(BitRule(
            bits=r["bits"],
            layers=None if lay is None else ([lay] if _is_int(lay) else lay),
            heads=None if hed is None else ([hed] if _is_int(hed) else hed),
            kind=r.get("kind"),
            modality=r.get("modality"),
            correct=r.get("correct", False),
        ))

    budget = d.get("budget", {})
    _check_keys(budget, "budget", [], ["target_bpv", "reference", "bpv"])
    target = budget.get("target_bpv")
    ref_d = budget.get("reference", {})
    _check_keys(ref_d, "budget.reference", [], ["context_len", "modality_mix", "full_precision_bits"])
    mix = ref_d.get("modality_mix", {DEFAULT_MODALITY: 1.0})
    if not isinstance(mix, Mapping):
        raise PlanError("budget.reference.modality_mix", "must be a mapping of modality to fraction", mix)
    for k, v in mix.items():
        if not _is_num(v):
            raise PlanError(f"budget.reference.modality_mix.{k}", "must be a number", v)
    ctx = _int(ref_d.get("context_len", 4096), "budget.reference.context_len", 1)
    fpb = _choice(ref_d.get("full_precision_bits", 16), "budget.reference.full_precision_bits", (16, 32))
    reference = Reference(ctx, tuple(mix.items()), fpb)

    prov = d.get("provenance", {})
    _check_keys(prov, "provenance", [], ["kvplan_version", "produced_by", "seed", "data_hash"])
    for key in ("kvplan_version", "produced_by", "data_hash"):
        if key in prov and prov[key] is not None and not isinstance(prov[key], str):
            raise PlanError(f"provenance.{key}", "must be a string", prov[key])
    if prov.get("seed") is not None:
        _int(prov["seed"], "provenance.seed")
    provenance = Provenance(
        kvplan_version=prov.get("kvplan_version", __version__),
        produced_by=prov.get("produced_by", "manual"),
        seed=prov.get("seed"),
        data_hash=prov.get("data_hash"),
    )
    metrics = d.get("metrics") or {}
    if not isinstance(metrics, Mapping):
        raise PlanError("metrics", "must be a mapping", metrics)
    _check_metrics(metrics, "metrics")

    plan = Plan(geometry=geometry, modalities=tuple(modalities), quantizer=quantizer, default_bits=default,
                rules=tuple(rules), target_bpv=target, reference=reference, provenance=provenance,
                metrics=metrics, name=name,
                key_basis=KeyBasis.from_dict(d["key_basis"]) if "key_basis" in d else None,
                rope_inv_freq=_rope_inv_freq(d["rope_inv_freq"]) if "rope_inv_freq" in d else None)
    stated = budget.get("bpv")
    if stated is not None:
        _check_keys(stated, "budget.bpv", [], ["total", "payload", "scales_zeros", "residual", "correction"])
        actual = plan.bpv().as_dict()
        for k, v in stated.items():
            if not _is_num(v):
                raise PlanError(f"budget.bpv.{k}", "must be a number", v)
            if round(v, 6) != round(actual[k], 6):
                raise PlanError(f"budget.bpv.{k}",
                                f"disagrees with the plan's bits, which give {actual[k]:.6f} at the reference; "
                                "delete budget.bpv to recompute it", v)
    return plan


_LEVELS = (
    ("kind",), ("modality",), ("kind", "modality"), ("layer",), ("layer", "kind"), ("layer", "kind", "modality"),
    ("head", "kind"), ("layer", "head"), ("layer", "head", "kind"), ("layer", "head", "kind", "modality"),
)
_AXIS = {"layer": 0, "head": 1, "kind": 2, "modality": 3}


def _compress(table: np.ndarray, modalities) -> tuple[int, list[BitRule]]:
    """Default + ordered rules reproducing ``table`` exactly (greedy, coarse to fine)."""
    vals, counts = np.unique(table, return_counts=True)
    plain = vals < CORRECTED  # the default is plain bits; corrected slots always come from rules
    default = int(vals[plain][np.argmax(counts[plain])]) if plain.any() else int(vals[0]) % CORRECTED
    current = np.full_like(table, default)
    rules: list[BitRule] = []
    for level in _LEVELS:
        if np.array_equal(current, table):
            break
        keep = [_AXIS[a] for a in level]
        shape = table.shape
        for idx in np.ndindex(*[shape[a] for a in keep]):
            sl = [slice(None)] * 4
            for a, i in zip(keep, idx):
                sl[a] = i
            sl = tuple(sl)
            tgt, cur = table[sl], current[sl]
            if np.array_equal(tgt, cur):
                continue
            v, c = np.unique(tgt, return_counts=True)
            if "kind" not in level or KINDS[idx[level.index("kind")]] != "k":
                v, c = v[v < CORRECTED], c[v < CORRECTED]  # a correcting rule must select keys alone
                if not v.size:
                    continue
            mode = int(v[np.argmax(c)])
            gain = int(((tgt == mode) & (cur != mode)).sum()) - int(((cur == tgt) & (tgt != mode)).sum())
            if gain > 0 or (len(keep) == 4):
                current[sl] = mode
                sel = dict(zip(level, idx))
                rules.append(_rule_of_code(
                    mode,
                    layers=(int(sel["layer"]),) if "layer" in sel else None,
                    heads=(int(sel["head"]),) if "head" in sel else None,
                    kind=KINDS[sel["kind"]] if "kind" in sel else None,
                    modality=modalities[sel["modality"]] if "modality" in sel else None,
                ))
    assert np.array_equal(current, table)
    return default, _merge_adjacent(rules)


def _merge_adjacent(rules: list[BitRule]) -> list[BitRule]:
    """Join neighbouring rules that differ only in their layer (or head) list."""
    out: list[BitRule] = []
    for r in rules:
        prev = out[-1] if out else None
        if (prev is not None and prev.bits == r.bits and prev.correct == r.correct and prev.kind == r.kind
                and prev.modality == r.modality):
            if prev.heads == r.heads and prev.layers is not None and r.layers is not None:
                out[-1] = replace(prev, layers=tuple(sorted(set(prev.layers) | set(r.layers))))
                continue
            if prev.layers == r.layers and prev.heads is not None and r.heads is not None:
                out[-1] = replace(prev, heads=tuple(sorted(set(prev.heads) | set(r.heads))))
                continue
        out.append(r)
    return out


def _rule_of_code(code: int, **selectors) -> BitRule:
    bits, corrected = split_codes(code)
    return BitRule(bits=bits, correct=corrected, **selectors)


def _flat_rules(table: np.ndarray, modalities) -> list[BitRule]:
    return [
        _rule_of_code(int(table[l, h, k, m]), layers=(l,), heads=(h,), kind=KINDS[k], modality=modalities[m])
        for l, h, k, m in np.ndindex(*table.shape)
    ]
