"""A plan document (plain YAML data) to checked :class:`Plan` fields, key by key.

Each value is checked where it is read, with its key path, before anything is built from
it: sizes within the limits of ``_checks`` (the geometry before the per-layer list,
``key_basis.shape`` before its base64 is decoded), lists and mappings where the schema
says so (a falsy ``rules: false`` or ``metrics: []`` is refused, not read as empty).
"""

from __future__ import annotations

from typing import Mapping

from .._version import __version__
from ..errors import PlanError
from ..models.geometry import LAYER_TYPES, MAX_SLIDING_WINDOW, Geometry
from ..models.modality import TOKEN_IDS_NAME
from ._checks import (DEFAULT_MODALITY, KINDS, MAX_HEAD_DIM, MAX_KV_HEADS, MAX_LAYERS, SCHEMA_VERSION, STREAMED,
                      check_choice, check_int, check_keys, check_list, check_str, is_int, is_num)
from ._fields import PLAN_BITS, BitRule, Provenance, QuantizerSettings, Reference, check_correction_rank
from ._keybasis import FeedbackMetric, KeyBasis
from ._rope import parse_rope_inv_freq

_TOP = ["name", "modalities", "labelling", "quantizer", "budget", "provenance", "metrics", "key_basis", "rope_inv_freq",
        "feedback_metric"]
_QUANTIZER = ["group_size", "key_axis", "value_axis", "residual_length", "sink_length", "key_correction_rank",
              "key_correction_bits", "rotation", "key_pre_rope"]
# quantizer keys that schema version 2 added (slot formats, kvplan.kernels.formats)
_QUANTIZER_V2 = ["key_scaling", "value_scaling", "codebooks"]
# ... and that schema version 3 added (the interim residual format)
_QUANTIZER_V3 = ["residual_bits"]
# ... and schema version 4 (residual-precision copies of the newest committed tokens)
_QUANTIZER_V4 = ["recent_length"]
# ... and schema version 5 (attention-sink positions held as codes)
_QUANTIZER_V5 = ["sink_bits"]
# ... and schema version 7 (copies of the most-attended committed tokens)
_QUANTIZER_V7 = ["heavy_length"]
# ... and schema version 8 (streamed KV heads)
_QUANTIZER_V8 = ["stream_window"]
_BPV = ["total", "payload", "scales_zeros", "residual", "correction"]


def plan_fields(d) -> dict:
    """Keyword arguments of :class:`Plan` for the document ``d`` (checks what one key can;
    ``Plan.__post_init__`` checks the rest)."""
    check_keys(d, "", ["schema_version", "model", "bits"], _TOP)
    version = _schema_version(d["schema_version"])
    name = d.get("name")
    if name is not None:
        check_str(name, "name")
    geometry = _geometry(d["model"])
    if version >= 2 and geometry.sliding_window is None and "sliding" in geometry.layer_types:
        # every writer of schema 2 on records the window; without it the sliding layers would be counted
        # as keeping every token while the cache frees what leaves the model's window
        raise PlanError("model.sliding_window", f"missing: the plan has sliding layers, and schema_version "
                        f"{version} plans record their window (only version-1 files may leave it out)",
                        show_value=False)
    modalities = check_list(d.get("modalities", [DEFAULT_MODALITY]), "modalities", "names")
    labelling = check_str(d["labelling"], "labelling") if "labelling" in d else TOKEN_IDS_NAME
    q = d.get("quantizer", {})
    check_keys(q, "quantizer", [], _QUANTIZER + _QUANTIZER_V2 + _QUANTIZER_V3 + _QUANTIZER_V4 + _QUANTIZER_V5
               + _QUANTIZER_V7 + _QUANTIZER_V8)
    for needs, keys in ((2, _QUANTIZER_V2), (3, _QUANTIZER_V3), (4, _QUANTIZER_V4), (5, _QUANTIZER_V5),
                        (7, _QUANTIZER_V7), (8, _QUANTIZER_V8)):
        for k in keys:
            if k in q and version < needs:
                raise PlanError(f"quantizer.{k}", f"needs schema_version {needs} (the file says {version})",
                                show_value=False)
    quantizer = QuantizerSettings(**q)
    b = d["bits"]
    check_keys(b, "bits", ["default"], ["rules"])
    default = check_choice(b["default"], "bits.default", PLAN_BITS)
    rules = tuple(_rule(r, f"bits.rules[{i}]")
                  for i, r in enumerate(check_list(b.get("rules", []), "bits.rules", "rules (write [] for none)")))
    if version < 8:
        for path, bits in [("bits.default", default)] + [(f"bits.rules[{i}].bits", r.bits) for i, r in enumerate(rules)]:
            if bits == STREAMED:
                raise PlanError(path, f"0 (a streamed KV head) needs schema_version 8 (the file says {version})", bits)
    budget = d.get("budget", {})
    check_keys(budget, "budget", [], ["target_bpv", "reference", "bpv"])
    rank = quantizer.key_correction_rank
    check_correction_rank(rank, geometry.head_dim)  # before key_basis.shape is compared with it
    feedback_metric = None
    if "feedback_metric" in d:  # schema version 6: the error-feedback encoder's metrics
        if version < 6:
            raise PlanError("feedback_metric", f"needs schema_version 6 (the file says {version})", show_value=False)
        feedback_metric = FeedbackMetric.from_dict(d["feedback_metric"], expected_shape=(
            geometry.num_layers, 2, geometry.num_kv_heads, geometry.head_dim, geometry.head_dim),
            with_frame=version >= 9)
    key_basis = None
    if "key_basis" in d:
        want = (geometry.num_layers, geometry.num_kv_heads, geometry.head_dim, rank) if rank else None
        key_basis = KeyBasis.from_dict(d["key_basis"], expected_shape=want)
    return dict(geometry=geometry, modalities=tuple(modalities), quantizer=quantizer, default_bits=default,
                rules=rules, target_bpv=budget.get("target_bpv"), reference=_reference(budget.get("reference", {})),
                provenance=_provenance(d.get("provenance", {})), metrics=d.get("metrics", {}), name=name, key_basis=key_basis,
                rope_inv_freq=parse_rope_inv_freq(d["rope_inv_freq"]) if "rope_inv_freq" in d else None,
                labelling=labelling, feedback_metric=feedback_metric)


def check_stated_bpv(plan, stated) -> None:
    """A ``budget.bpv`` written in the file must be what the plan's bits give."""
    if stated is None:
        return
    check_keys(stated, "budget.bpv", [], _BPV)
    for k, v in stated.items():
        if not is_num(v):
            raise PlanError(f"budget.bpv.{k}", "must be a finite number", v)
    actual = plan.bpv().as_dict()
    for k, v in stated.items():
        if round(v, 6) != round(actual[k], 6):
            raise PlanError(f"budget.bpv.{k}", f"disagrees with the plan's bits, which give {actual[k]:.6f} at the "
                            "reference; delete budget.bpv to recompute it", v)


def _schema_version(ver) -> int:
    """The file's schema version: 1 (read with every slot in the v1 format: fp16 min-max scales and
    zero-points, uniform codes), 2 (adds ``quantizer.key_scaling`` / ``value_scaling`` / ``codebooks``)
    3 (adds ``quantizer.residual_bits``; older files hold their residual at full precision), 4 (adds
    ``quantizer.recent_length``; older files keep no copies of committed tokens), 5 (adds
    ``quantizer.sink_bits``; older files hold their sink positions as written), 6 (adds
    ``feedback_metric``; older files' codes are rounded to the nearest level), 7 (adds
    ``quantizer.heavy_length``; older files keep no copies of heavy hitters), 8 (adds streamed KV
    heads: bits 0 and ``quantizer.stream_window``) or 9 (adds ``feedback_metric.frame``, the rotation
    settings its metrics were computed for; older files' metrics are taken as the plan's). Writers
    always write the newest version."""
    if not is_int(ver):
        raise PlanError("schema_version", "must be an integer", ver)
    if ver > SCHEMA_VERSION:
        raise PlanError("schema_version", f"is newer than this kvplan supports ({SCHEMA_VERSION}); upgrade kvplan",
                        ver)
    if ver < 1:
        raise PlanError("schema_version", "must be >= 1", ver)
    return ver


def _geometry(m) -> Geometry:
    check_keys(m, "model", ["model_type", "num_layers", "num_kv_heads", "head_dim", "layer_types"],
               ["sliding_window", "fingerprint"])
    n_layers = check_int(m["num_layers"], "model.num_layers", 1, MAX_LAYERS)
    n_kv = check_int(m["num_kv_heads"], "model.num_kv_heads", 1, MAX_KV_HEADS)
    hd = check_int(m["head_dim"], "model.head_dim", 1, MAX_HEAD_DIM)
    lt = m["layer_types"]
    if isinstance(lt, str):
        check_choice(lt, "model.layer_types", LAYER_TYPES)
        lt = [lt] * n_layers
    elif isinstance(lt, list):
        if len(lt) != n_layers:
            raise PlanError("model.layer_types", f"must have num_layers={n_layers} entries", len(lt))
        for i, t in enumerate(lt):
            check_choice(t, f"model.layer_types[{i}]", LAYER_TYPES)
    else:
        raise PlanError("model.layer_types", "must be 'full', 'sliding' or a list of them", lt)
    window = None
    if "sliding_window" in m:
        window = check_int(m["sliding_window"], "model.sliding_window", 1, MAX_SLIDING_WINDOW)
        if "sliding" not in lt:
            raise PlanError("model.sliding_window", "given but no layer type is 'sliding'", window)
    geometry = Geometry(n_layers, n_kv, hd, tuple(lt), check_str(m["model_type"], "model.model_type"), window)
    if "fingerprint" in m and m["fingerprint"] != geometry.fingerprint:
        raise PlanError("model.fingerprint",
                        f"does not match the model fields above ({geometry.fingerprint}); the plan was edited "
                        "inconsistently", m["fingerprint"])
    return geometry


def _rule(r, path) -> BitRule:
    check_keys(r, path, ["bits"], ["layers", "heads", "kind", "modality", "correct"])
    if "correct" in r and not isinstance(r["correct"], bool):
        raise PlanError(f"{path}.correct", "must be true or false", r["correct"])
    check_choice(r["bits"], f"{path}.bits", PLAN_BITS)
    selectors = {}
    for sel in ("layers", "heads"):
        if sel in r:
            v = [r[sel]] if is_int(r[sel]) else r[sel]
            if not isinstance(v, list):
                raise PlanError(f"{path}.{sel}", "must be an integer or a list of integers", v)
            for j, x in enumerate(v):
                if not is_int(x):
                    raise PlanError(f"{path}.{sel}[{j}]", "must be an integer", x)
            selectors[sel] = v
    if "kind" in r:
        check_choice(r["kind"], f"{path}.kind", KINDS)
    if "modality" in r:
        check_str(r["modality"], f"{path}.modality")
    return BitRule(bits=r["bits"], kind=r.get("kind"), modality=r.get("modality"), correct=r.get("correct", False),
                   **selectors)


def _reference(ref_d) -> Reference:
    check_keys(ref_d, "budget.reference", [], ["context_len", "modality_mix", "full_precision_bits", "layout"])
    mix = ref_d.get("modality_mix", {DEFAULT_MODALITY: 1.0})
    if not isinstance(mix, Mapping):
        raise PlanError("budget.reference.modality_mix", "must be a mapping of modality to fraction", mix)
    return Reference(ref_d.get("context_len", 4096), tuple(mix.items()), ref_d.get("full_precision_bits", 16),
                     ref_d.get("layout"))


def _provenance(prov) -> Provenance:
    check_keys(prov, "provenance", [], ["kvplan_version", "produced_by", "seed", "data_hash"])
    return Provenance(kvplan_version=prov.get("kvplan_version", __version__),  # which checks its fields
                      produced_by=prov.get("produced_by", "manual"), seed=prov.get("seed"),
                      data_hash=prov.get("data_hash"))
