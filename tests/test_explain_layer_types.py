"""kvplan explain and the sweep name each layer's type (sliding-window / full) next to its bits."""

import dataclasses
import json

from kvplan import Geometry, uniform_plan
from kvplan.evaluation.sweep import format_layers
from kvplan.explain import explain

HYBRID = Geometry(6, 2, 16, ("sliding",) * 5 + ("full",), "gemma3_text", 64)


def test_explain_shows_layer_types_next_to_bits(tmp_path):
    plan = uniform_plan(HYBRID, 2, 4)
    t = plan.table()
    t[5] = 8  # the full layer at 8 bits
    path = tmp_path / "plan.yaml"
    plan.with_table(t).to_yaml(path)
    txt = explain(path)
    assert "layer types: 5 sliding-window (window 64; they store only the tokens it needs), 1 full" in txt
    assert "L00 S 2.0/4.0" in txt and "L05 F 8.0/8.0" in txt
    rep = json.loads(explain(path, format="json"))
    assert [r["type"] for r in rep["allocation"]["per_layer"]] == list(HYBRID.layer_types)
    assert rep["model"]["sliding_window"] == 64


def test_explain_of_a_full_attention_plan_has_no_type_tags(tmp_path):
    g = dataclasses.replace(HYBRID, layer_types=("full",) * 6, sliding_window=None)
    path = tmp_path / "plan.yaml"
    uniform_plan(g, 2, 4).to_yaml(path)
    txt = explain(path)
    assert "layer types" not in txt and "L00 2.0/4.0" in txt


def test_sweep_names_the_layer_types():
    assert format_layers(HYBRID) == ("layers: 5 sliding-window (window 64): L00 L01 L02 L03 L04; 1 full: L05")
    assert format_layers(dataclasses.replace(HYBRID, layer_types=("full",) * 6, sliding_window=None)) == \
        "layers: 6 full-attention"
