"""Plan YAML: exact round trip and strict validation of malformed plans."""

import copy

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan import Geometry, Plan, PlanError, baseline_plan, headguard_plan, layerwise_plan, uniform_plan
from kvplan.plans import KVTUNER_PAIRS, Reference

GEOM = Geometry(30, 3, 64, ("full",) * 30, "llama")


def _plans():
    yield baseline_plan("fp16", GEOM)
    yield baseline_plan("int2-g128", GEOM)
    yield baseline_plan("int2-g128", GEOM, residual_length=0, sink_length=4)
    yield baseline_plan("k4v2", GEOM, modalities=("text", "visual"))
    yield layerwise_plan(GEOM, [KVTUNER_PAIRS[i % 5] for i in range(30)])
    yield headguard_plan(GEOM, [(0, 1), (7, 2)], modalities=("text", "visual"), protected_modality="visual",
                         reference=Reference(2048, {"text": 0.25, "visual": 0.75}))
    rng = np.random.default_rng(0)
    yield Plan.from_table(rng.choice([2, 3, 4, 8, 16], size=(30, 3, 2, 2)), GEOM, ("text", "doc"),
                          target_bpv=2.5, metrics={"kl": {"mean": 0.01, "ci": [0.005, 0.02]}})


@pytest.mark.parametrize("plan", list(_plans()), ids=lambda p: p.name or f"rules{len(p.rules)}")
def test_round_trip_exact(plan, tmp_path):
    text = plan.to_yaml()
    again = Plan.from_yaml(text)
    assert again == plan
    assert again.to_yaml() == text
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    assert Plan.from_yaml(path) == plan
    flat = Plan.from_yaml(plan.to_yaml(flat=True))
    assert np.array_equal(flat.table(), plan.table())
    assert len(flat.rules) == plan.table().size


def test_plan_without_sink_length_loads_with_none():
    text = baseline_plan("int2", GEOM).to_yaml().replace("  sink_length: 0\n", "")
    assert "sink_length" not in text
    assert Plan.from_yaml(text).quantizer.sink_length == 0


def test_compact_yaml_is_short_for_structured_plan():
    plan = layerwise_plan(GEOM, [(8, 4)] * 2 + [(4, 2)] * 28)
    assert len(plan.rules) <= 4
    assert len(plan.to_yaml().splitlines()) < 50


def test_table_rules_later_win():
    plan = uniform_plan(GEOM, 4)
    t = plan.table()
    t[3, 1, 0, 0] = 16
    t[:, :, 1, :] = 2
    p = plan.with_table(t)
    assert p.slot_bits(3, 1, "k", "text") == 16
    assert p.slot_bits(3, 0, "k", "text") == 4
    assert p.slot_bits(9, 2, "v", "text") == 2


BASE = yaml.safe_load(baseline_plan("int4", GEOM, modalities=("text", "visual")).to_yaml())


def _set(path, value):
    d = copy.deepcopy(BASE)
    cur = d
    for k in path[:-1]:
        cur = cur[k]
    if value is _DELETE:
        del cur[path[-1]]
    else:
        cur[path[-1]] = value
    return d


_DELETE = object()

# (description, document, expected key path in the error)
MALFORMED = [
    ("not a mapping", [1, 2], "<root>"),
    ("empty", None, "<root>"),
    ("unknown top key", {**BASE, "bitz": 1}, "bitz"),
    ("missing bits", _set(["bits"], _DELETE), "bits"),
    ("missing model", _set(["model"], _DELETE), "model"),
    ("missing schema", _set(["schema_version"], _DELETE), "schema_version"),
    ("newer schema", _set(["schema_version"], 99), "schema_version"),
    ("schema str", _set(["schema_version"], "1"), "schema_version"),
    ("layers str", _set(["model", "num_layers"], "30"), "model.num_layers"),
    ("layers zero", _set(["model", "num_layers"], 0), "model.num_layers"),
    ("heads bool", _set(["model", "num_kv_heads"], True), "model.num_kv_heads"),
    ("bad layer type", _set(["model", "layer_types"], "linear"), "model.layer_types"),
    ("layer types wrong length", _set(["model", "layer_types"], ["full"] * 3), "model.layer_types"),
    ("bad fingerprint", _set(["model", "fingerprint"], "sha256:0000"), "model.fingerprint"),
    ("unknown model key", _set(["model", "vocab"], 5), "model.vocab"),
    ("default bits 5", _set(["bits", "default"], 5), "bits.default"),
    ("default bits float", _set(["bits", "default"], 4.0), "bits.default"),
    ("default bits str", _set(["bits", "default"], "int4"), "bits.default"),
    ("rules not list", _set(["bits", "rules"], {"kind": "k"}), "bits.rules"),
    ("rule unknown key", _set(["bits", "rules"], [{"bits": 8, "layer": 1}]), "bits.rules[0].layer"),
    ("rule missing bits", _set(["bits", "rules"], [{"kind": "k"}]), "bits.rules[0].bits"),
    ("rule bits 1", _set(["bits", "rules"], [{"bits": 1}]), "bits.rules[0].bits"),
    ("rule layer out of range", _set(["bits", "rules"], [{"bits": 8, "layers": [30]}]), "bits.rules[0].layers[0]"),
    ("rule negative head", _set(["bits", "rules"], [{"bits": 8, "heads": [-1]}]), "bits.rules[0].heads[0]"),
    ("rule head out of range", _set(["bits", "rules"], [{"bits": 8, "heads": [0, 3]}]), "bits.rules[0].heads[1]"),
    ("rule layer str", _set(["bits", "rules"], [{"bits": 8, "layers": ["1"]}]), "bits.rules[0].layers[0]"),
    ("rule bad kind", _set(["bits", "rules"], [{"bits": 8, "kind": "q"}]), "bits.rules[0].kind"),
    ("rule unknown modality", _set(["bits", "rules"], [{"bits": 8, "modality": "audio"}]), "bits.rules[0].modality"),
    ("rule empty layers", _set(["bits", "rules"], [{"bits": 8, "layers": []}]), "bits.rules[0].layers"),
    ("group size 48", _set(["quantizer", "group_size"], 48), "quantizer.group_size"),
    ("bad axis", _set(["quantizer", "key_axis"], "head"), "quantizer.key_axis"),
    ("negative residual", _set(["quantizer", "residual_length"], -1), "quantizer.residual_length"),
    ("negative sink", _set(["quantizer", "sink_length"], -4), "quantizer.sink_length"),
    ("sink not an integer", _set(["quantizer", "sink_length"], "4"), "quantizer.sink_length"),
    ("unknown quantizer key", _set(["quantizer", "bits"], 4), "quantizer.bits"),
    ("modalities without text", _set(["modalities"], ["visual"]), "modalities"),
    ("modalities duplicate", _set(["modalities"], ["text", "text"]), "modalities"),
    ("modalities not list", _set(["modalities"], "text"), "modalities"),
    ("mix not summing", _set(["budget", "reference", "modality_mix"], {"text": 0.5}), "budget.reference.modality_mix"),
    ("mix unknown", _set(["budget", "reference", "modality_mix"], {"audio": 1.0}), "budget.reference.modality_mix.audio"),
    ("context zero", _set(["budget", "reference", "context_len"], 0), "budget.reference.context_len"),
    ("target negative", _set(["budget", "target_bpv"], -2), "budget.target_bpv"),
    ("stale bpv", _set(["budget", "bpv"], {"total": 1.0}), "budget.bpv.total"),
    ("seed str", _set(["provenance", "seed"], "x"), "provenance.seed"),
    ("metrics object", _set(["metrics"], {"kl": {"a": set()}}), "metrics.kl.a"),
]


@pytest.mark.parametrize("desc,doc,path", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_plan_names_key_path(desc, doc, path):
    with pytest.raises(PlanError) as info:
        Plan.from_yaml(yaml.safe_dump(doc))
    assert info.value.path == path, str(info.value)
    assert path in str(info.value)


def test_yaml_syntax_error_and_python_tags_rejected(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("schema_version: 1\nmodel: [unclosed\n")
    with pytest.raises(PlanError, match=r"bad\.yaml: <yaml>: not valid YAML at line"):
        Plan.from_yaml(f)
    evil = tmp_path / "evil.yaml"
    evil.write_text("!!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(PlanError, match="not valid YAML"):
        Plan.from_yaml(evil)


def test_fingerprint_mismatch_names_field():
    plan = baseline_plan("int4", GEOM)
    other = Geometry(30, 3, 64, ("full",) * 30, "qwen2")
    with pytest.raises(PlanError, match="model.model_type"):
        plan.check_geometry(other)
    with pytest.raises(PlanError, match="model.num_kv_heads"):
        plan.check_geometry(Geometry(30, 4, 64, ("full",) * 30, "llama"))


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 200), st.floats(allow_nan=True),
                     st.text(max_size=6))
_values = st.recursive(_scalars, lambda c: st.one_of(st.lists(c, max_size=3),
                                                     st.dictionaries(st.text(max_size=5), c, max_size=3)),
                       max_leaves=6)
_PATHS = [["schema_version"], ["model", "num_layers"], ["model", "head_dim"], ["model", "layer_types"],
          ["modalities"], ["quantizer", "group_size"], ["quantizer", "key_axis"], ["quantizer", "residual_length"],
          ["quantizer", "sink_length"], ["bits", "default"], ["bits", "rules"], ["budget", "target_bpv"], ["budget", "reference"],
          ["provenance", "seed"], ["metrics"]]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(_PATHS), _values)
def test_generated_mutations_fail_only_with_plan_error(path, value):
    doc = _set(path, value)
    try:
        Plan.from_yaml(yaml.safe_dump(doc))
    except PlanError as e:
        assert e.path and str(e)


def test_a_plan_file_named_like_a_baseline_is_read_as_the_file(tmp_path, monkeypatch):
    """``int2-good.yaml`` is a file, not the baseline ``int2``: a name is a baseline only when it is
    one whole (``int4``, ``k4v2-g64``) and no such file exists."""
    from kvplan.plans import is_baseline_name
    from kvplan.runtime.load import resolve_plan

    monkeypatch.chdir(tmp_path)
    assert is_baseline_name("int2") and is_baseline_name("k4v2-g64")
    assert not any(is_baseline_name(n) for n in ("int2-good.yaml", "int2-gx", "int2-g", "int4x", None))
    plan = uniform_plan(GEOM, 8, 2, name="mine")
    plan.to_yaml("int2-good.yaml")
    assert resolve_plan("int2-good.yaml", GEOM).name == "mine"
    with pytest.raises(PlanError, match=r"^int4-missing.yaml: plan file not found$"):  # was "<file>: ... (got ...)"
        resolve_plan("int4-missing.yaml", GEOM)
