"""Plan schema version 2: slot formats in the plan file, migration of version-1 files, and
bytes held by the cache == the plan's stated bpv for every format."""

from __future__ import annotations

import dataclasses

import numpy as np

import pytest
import torch
import yaml

import kvplan
from kvplan import Geometry, Plan, PlanError, uniform_plan
from kvplan.kernels.formats import default_codebook
from kvplan.plans import SCHEMA_VERSION, _parse
from tests.tiny_models import tiny_llama

GEOM = Geometry(2, 2, 16, ("full", "full"), "llama")


def _formats_plan(geometry=GEOM, **kw):
    base = uniform_plan(geometry, 2, 3, group_size=32, residual_length=0, sink_length=1, **kw)
    books = (("k", 2, default_codebook(2, "minmax-e4m3", 32)), ("v", 3, default_codebook(3, "absmax-e4m3", 16)))
    q = dataclasses.replace(base.quantizer, key_scaling="minmax-e4m3", value_scaling="absmax-e4m3", codebooks=books)
    return base.replace(quantizer=q)


def test_round_trip_keeps_formats(tmp_path):
    plan = _formats_plan()
    path = tmp_path / "p.yaml"
    plan.to_yaml(path)
    doc = yaml.safe_load(path.read_text())
    assert doc["schema_version"] == SCHEMA_VERSION and "residual_bits" not in doc["quantizer"]  # 16: the default, not written
    assert "recent_length" not in doc["quantizer"]  # 0: the default, not written
    assert doc["quantizer"]["value_scaling"] == "absmax-e4m3"
    assert doc["quantizer"]["codebooks"]["v"][3] == list(default_codebook(3, "absmax-e4m3", 16))
    back = Plan.from_yaml(path)
    assert back.quantizer == plan.quantizer
    assert back.quantizer.format("v", 3).name == "lloyd3-absmax-e4m3"
    assert back.quantizer.format("k", 4).name == "int4-minmax-e4m3"  # no codebook at 4 bits: uniform
    assert back.bpv().total == plan.bpv().total


def test_version_1_file_migrates_to_v1_formats(tmp_path):
    """A schema-1 file reads as v1 formats (fp16 min-max, uniform codes) and a full-precision residual,
    and is written back as the newest version with the same bits and bpv."""
    plan = uniform_plan(GEOM, 2, 2, group_size=32)
    doc = plan.to_dict()
    doc["schema_version"] = 1
    path = tmp_path / "v1.yaml"
    path.write_text(yaml.safe_dump(doc))
    old = Plan.from_yaml(path)
    assert old.quantizer.v1_formats and old.quantizer.format("k", 2).legacy
    assert old.quantizer.residual_bits == 16
    assert old.bpv() == plan.bpv()
    assert old.quantizer.recent_length == 0
    assert old.to_dict()["schema_version"] == SCHEMA_VERSION


@pytest.mark.parametrize("bits", [8, 4])
def test_residual_bits_round_trip_and_count(tmp_path, bits):
    base = uniform_plan(GEOM, 2, 2, group_size=32, residual_length=0)
    plan = base.replace(quantizer=dataclasses.replace(base.quantizer, residual_bits=bits))
    path = tmp_path / "p.yaml"
    plan.to_yaml(path)
    assert yaml.safe_load(path.read_text())["quantizer"]["residual_bits"] == bits
    back = Plan.from_yaml(path)
    assert back.quantizer.residual_bits == bits and back.bpv() == plan.bpv()
    # 300 tokens: 288 committed, 12 in the residual, coded per token (fp16 scale + zero per group of
    # min(group_size, head_dim) channels)
    D = GEOM.head_dim
    per_token = D * bits // 8 + (D // min(32, D)) * 4
    assert plan.quantizer.residual_token_bytes(D, 2) == per_token
    fp16 = base.bpv(context_len=300)
    coded = plan.bpv(context_len=300)
    assert coded.payload == fp16.payload and coded.scales_zeros == fp16.scales_zeros
    assert fp16.residual == pytest.approx(8 * 12 * D * 2 / (300 * D))
    assert coded.residual == pytest.approx(8 * 12 * per_token / (300 * D))
    assert plan.bpv(context_len=288) == base.bpv(context_len=288)  # nothing waits at a group boundary


def _assert_new_key_refused(doc, path, key, version, bad_value, bad_match):
    """``doc`` (a plan carrying ``quantizer.key``, added by schema ``version``) written as the version
    before is refused naming both versions; at ``version`` the ``bad_value`` is refused (``bad_match``)."""
    doc["schema_version"] = version - 1
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(PlanError, match=rf"quantizer\.{key}: needs schema_version {version} \(the file says "
                                        rf"{version - 1}\)"):
        Plan.from_yaml(path)
    doc["schema_version"] = version
    doc["quantizer"][key] = bad_value
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(PlanError, match=bad_match):
        Plan.from_yaml(path)


def test_version_2_file_with_residual_bits_is_refused(tmp_path):
    base = uniform_plan(GEOM, 2, 2)
    doc = base.replace(quantizer=dataclasses.replace(base.quantizer, residual_bits=8)).to_dict()
    _assert_new_key_refused(doc, tmp_path / "bad.yaml", "residual_bits", 3, 2, r"quantizer\.residual_bits: must be one of")


def test_recent_length_round_trips_and_a_version_3_file_with_it_is_refused(tmp_path):
    base = uniform_plan(GEOM, 2, 2, group_size=32, residual_length=0)
    plan = base.replace(quantizer=dataclasses.replace(base.quantizer, residual_bits=8, recent_length=16))
    path = tmp_path / "p.yaml"
    plan.to_yaml(path)
    doc = yaml.safe_load(path.read_text())
    assert doc["schema_version"] == SCHEMA_VERSION and doc["quantizer"]["recent_length"] == 16
    back = Plan.from_yaml(path)
    assert back.quantizer == plan.quantizer and back.bpv() == plan.bpv()
    _assert_new_key_refused(doc, path, "recent_length", 4, -1, r"quantizer\.recent_length")


def test_sink_bits_round_trips_and_a_version_4_file_with_it_is_refused(tmp_path):
    base = uniform_plan(GEOM, 2, 2, group_size=32, residual_length=0, sink_length=2)
    plan = base.replace(quantizer=dataclasses.replace(base.quantizer, sink_bits=8))
    path = tmp_path / "p.yaml"
    plan.to_yaml(path)
    doc = yaml.safe_load(path.read_text())
    assert doc["schema_version"] == SCHEMA_VERSION and doc["quantizer"]["sink_bits"] == 8
    back = Plan.from_yaml(path)
    assert back.quantizer == plan.quantizer and back.bpv() == plan.bpv() and back.bpv().total < base.bpv().total
    assert "sink_bits" not in base.to_dict()["quantizer"]  # 16: the default, not written
    _assert_new_key_refused(doc, path, "sink_bits", 5, 4, r"quantizer\.sink_bits: must be one of")


def test_recent_copies_are_counted_as_residual_bytes():
    """The newest ``recent_length`` committed tokens (never a sink position) cost one residual token each."""
    base = uniform_plan(GEOM, 2, 2, group_size=32, residual_length=0)
    q = dataclasses.replace(base.quantizer, residual_bits=8, recent_length=16, sink_length=1)
    plan = base.replace(quantizer=q)
    ref = base.replace(quantizer=dataclasses.replace(q, recent_length=0))
    D = GEOM.head_dim
    per_token = q.residual_token_bytes(D, 2)
    for T, copies in ((10, 0), (32, 16), (300, 16), (17, 0)):
        extra = plan.bpv(context_len=T).residual - ref.bpv(context_len=T).residual
        assert extra == pytest.approx(8 * copies * per_token / (T * D)), T
    # only 31 committed tokens after the sink: 16 copies; with 40 copies asked, 31
    wide = base.replace(quantizer=dataclasses.replace(q, recent_length=40))
    assert wide.bpv(context_len=32).residual - ref.bpv(context_len=32).residual == pytest.approx(
        8 * 31 * per_token / (32 * D))


def test_version_1_file_with_version_2_keys_is_refused(tmp_path):
    doc = _formats_plan().to_dict()
    doc["schema_version"] = 1
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(PlanError, match=r"quantizer\.(key_scaling|codebooks).*needs schema_version 2"):
        Plan.from_yaml(path)


@pytest.mark.parametrize("reader", [1, 2, 3, 4, 5])
def test_an_older_reader_says_newer_schema(tmp_path, monkeypatch, reader):
    path = tmp_path / "p.yaml"
    _formats_plan().to_yaml(path)
    monkeypatch.setattr(_parse, "SCHEMA_VERSION", reader)
    with pytest.raises(PlanError, match="schema_version: is newer than this kvplan supports"):
        Plan.from_yaml(path)


@pytest.mark.parametrize("edit,msg", [
    (lambda q: q.update(value_scaling="absmax-fp4"), "quantizer.value_scaling: must be one of"),
    (lambda q: q.update(codebooks={"v": {3: [0.1, 0.2]}}), r"quantizer\.codebooks\.v\.3: a 3-bit codebook needs 8"),
    (lambda q: q.update(codebooks={"k": {2: [0.0, 0.5, 0.4, 1.0]}}), "strictly increasing"),
    (lambda q: q.update(codebooks={"k": {2: [-1.0, -0.5, 0.5, 1.0]}}), r"lie in \[0, 1\]"),
    (lambda q: q.update(codebooks={"q": {2: [0.0, 0.3, 0.6, 1.0]}}), r"quantizer\.codebooks\.q: must be one of"),
    (lambda q: q.update(codebooks={"k": {5: [0.0] * 32}}), r"quantizer\.codebooks\.k: must be one of"),
    (lambda q: q.update(codebooks={"k": {2: [0.0, "x", 0.6, 1.0]}}), "must be a list of numbers"),
])
def test_bad_format_fields_name_their_key(edit, msg, tmp_path):
    doc = _formats_plan().to_dict()
    edit(doc["quantizer"])
    doc["budget"].pop("bpv")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(PlanError, match=msg):
        Plan.from_yaml(path)


@pytest.mark.parametrize("n_tokens", [64, 77, 130])
def test_cache_bytes_equal_plan_bpv_with_new_formats(n_tokens):
    """Through kvplan.load + generate on a tiny Llama, the bytes the cache holds are the plan's bpv,
    and the formats are what the blocks store (e4m3 scales, no value zero-points)."""
    model = tiny_llama(head_dim=16)
    g = Geometry.of(model)
    plan = _formats_plan(g)
    kvplan.load(model, plan)
    ids = torch.randint(3, 250, (1, n_tokens), generator=torch.Generator().manual_seed(n_tokens))
    out = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    cache = out.past_key_values
    T = cache.get_seq_length()
    assert cache.bpv() == plan.bpv(context_len=T, full_precision_bits=32).total  # fp32 model: 32-bit residual
    blk_k = cache.layers[0].segments["k"][-1].blocks[0]  # (segment 0 is the full-precision sink)
    blk_v = cache.layers[0].segments["v"][-1].blocks[0]
    assert blk_k.scale.dtype == torch.float8_e4m3fn and blk_k.zero.dtype == torch.float16
    assert blk_v.zero is None and blk_v.fmt.name == "lloyd3-absmax-e4m3"
    kvplan.unload(model)


def test_reference_layout_states_the_bpv_of_interleaved_runs(tmp_path):
    """A measured layout (text, visual, text, visual runs) gives the bytes of exactly that prompt;
    the contiguous mix of the same fractions gives other bytes (partial groups at run boundaries)."""
    from kvplan.plans import Reference, layout_labels
    from kvplan.plans.accounting import plan_bpv

    layout = (("text", 14), ("visual", 300), ("text", 20), ("visual", 300), ("text", 30))
    T = sum(n for _, n in layout)
    mix = (("text", 64 / T), ("visual", 1 - 64 / T))
    plan = uniform_plan(GEOM, 2, 2, group_size=32, residual_length=0, modalities=("text", "visual"),
                        reference=Reference(T, mix, 16, layout))
    plan = plan.with_table(np.where(np.arange(2)[None, None, None, :] == 1, 4, 2) * np.ones((2, 2, 2, 2), int))
    labels = [lab for lab, n in layout for _ in range(n)]
    assert plan.bpv().total == plan_bpv(plan, GEOM, T, labels).total
    assert plan.bpv().total != plan.bpv(modality_mix=mix).total
    path = tmp_path / "p.yaml"
    plan.to_yaml(path)
    assert yaml.safe_load(path.read_text())["budget"]["reference"]["layout"][1] == ["visual", 300]
    back = Plan.from_yaml(path)
    assert back.reference.layout == layout and back.bpv() == plan.bpv()
    assert layout_labels(T, mix) != labels


@pytest.mark.parametrize("layout,msg", [
    ([["text", 10]], "runs must add up to context_len"),
    ([["audio", 664]], "modality must be one of"),
    ([["text", 0], ["text", 664]], r"layout\[0\]\[1\]: must be in \[1"),
    ([["text"]], r"layout\[0\]: must be a \[modality, tokens\] pair"),
    ({"text": 664}, "must be a non-empty list"),
])
def test_bad_reference_layout_names_its_entry(layout, msg, tmp_path):
    doc = uniform_plan(GEOM, 2, 2).to_dict()
    doc["budget"]["reference"].update(context_len=664, layout=layout)
    doc["budget"].pop("bpv")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(PlanError, match=msg):
        Plan.from_yaml(path)


def _metric(geom, seed=0):
    """SPD metrics [L, 2, H_kv, D, D] (fp16-exact symmetric)."""
    a = np.random.default_rng(seed).standard_normal((geom.num_layers, 2, geom.num_kv_heads, geom.head_dim, 4))
    m = a @ np.swapaxes(a, -1, -2) / 4 + np.eye(geom.head_dim)
    return m.astype(np.float16)


def test_feedback_metric_round_trips_as_upper_triangles_and_a_version_5_file_with_it_is_refused(tmp_path):
    base = uniform_plan(GEOM, 2, 2, group_size=32, residual_length=0)
    plan = base.replace(feedback_metric=_metric(GEOM))
    path = tmp_path / "p.yaml"
    plan.to_yaml(path)
    doc = yaml.safe_load(path.read_text())
    D = GEOM.head_dim
    assert doc["feedback_metric"]["shape"] == [GEOM.num_layers, 2, GEOM.num_kv_heads, D, D]
    assert len(__import__("base64").b64decode(doc["feedback_metric"]["base64"])) == (
        2 * GEOM.num_layers * 2 * GEOM.num_kv_heads * D * (D + 1) // 2)  # the upper triangles, fp16
    back = Plan.from_yaml(path)
    assert back.feedback_metric == plan.feedback_metric and back.bpv() == base.bpv()
    assert "feedback_metric" not in base.to_dict()
    doc["schema_version"] = 5
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(PlanError, match=r"feedback_metric: needs schema_version 6 \(the file says 5\)"):
        Plan.from_yaml(path)


@pytest.mark.parametrize("edit,msg", [
    (lambda d: d.update(shape=[d["shape"][0], 2, d["shape"][2], 8, 8]),
     r"feedback_metric\.shape: must be \[num_layers, 2, num_kv_heads, head_dim, head_dim\] = \[2, 2, 2, 16, 16\]"),
    (lambda d: d.update(base64=d["base64"][:-8]), r"feedback_metric\.base64: decodes to"),
    (lambda d: d.update(dtype="float32"), r"feedback_metric\.dtype: must be one of"),
])
def test_a_bad_feedback_metric_names_its_key(edit, msg, tmp_path):
    doc = uniform_plan(GEOM, 2, 2).replace(feedback_metric=_metric(GEOM)).to_dict()
    edit(doc["feedback_metric"])
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(PlanError, match=msg):
        Plan.from_yaml(path)


def test_a_feedback_metric_records_its_frame_and_a_plan_edited_to_another_rotation_is_refused(tmp_path):
    """The metrics live in the stored frame (Hadamard, pre-RoPE): a plan edited by hand to ``rotation: none``
    kept them, loaded and validated, and its encoder steered codes by another frame's metric (worse than
    nearest-level codes). Files before schema 9 hold no frame and are read as before."""
    from kvplan.plans import FeedbackMetric

    base = uniform_plan(GEOM, 2, 2, group_size=32, residual_length=0)
    base = base.replace(quantizer=dataclasses.replace(base.quantizer, rotation="hadamard"))
    plan = base.replace(feedback_metric=FeedbackMetric(_metric(GEOM), frame={"rotation": "hadamard",
                                                                             "key_pre_rope": False}))
    path = tmp_path / "p.yaml"
    plan.to_yaml(path)
    text = path.read_text()
    assert Plan.from_yaml(path) == plan and Plan.from_yaml(path).feedback_metric.frame["rotation"] == "hadamard"
    path.write_text(text.replace("  rotation: hadamard\n", "  rotation: none\n", 1))  # the quantizer's, first
    assert yaml.safe_load(path.read_text())["quantizer"]["rotation"] == "none"
    with pytest.raises(PlanError, match=r"feedback_metric\.frame: the metrics were computed in the stored frame of "
                                        r"\{'rotation': 'hadamard', 'key_pre_rope': False\}, but the quantizer says "
                                        r"\{'rotation': 'none', 'key_pre_rope': False\}"):
        Plan.from_yaml(path)
    with pytest.raises(PlanError, match="feedback_metric.frame"):  # the same edit through the API
        plan.replace(quantizer=dataclasses.replace(plan.quantizer, rotation="none"))
    doc = yaml.safe_load(text)
    doc["schema_version"] = 8
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(PlanError, match=r"feedback_metric\.frame: needs schema_version 9"):
        Plan.from_yaml(path)
    del doc["feedback_metric"]["frame"]
    path.write_text(yaml.safe_dump(doc))
    assert Plan.from_yaml(path).feedback_metric.frame is None  # an older file: its metric taken as the plan's
    doc["feedback_metric"]["frame"] = {"rotation": "hadamard", "key_pre_rope": "yes"}
    doc["schema_version"] = 9
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(PlanError, match=r"feedback_metric\.frame\.key_pre_rope: must be true or false"):
        Plan.from_yaml(path)


def test_a_metric_that_is_not_positive_definite_is_refused_naming_its_slot():
    m = _metric(GEOM)
    m[1, 1, 0] = -m[1, 1, 0]
    with pytest.raises(PlanError, match=r"feedback_metric\[1\]\[1\]\[0\]: must be positive definite \(layer 1, v, "
                                        r"KV head 0\)"):
        uniform_plan(GEOM, 2, 2).replace(feedback_metric=m)


def test_heavy_length_round_trips_and_a_version_6_file_with_it_is_refused(tmp_path):
    base = uniform_plan(GEOM, 2, 2, group_size=32, residual_length=0, sink_length=1)
    plan = base.replace(quantizer=dataclasses.replace(base.quantizer, residual_bits=8, heavy_length=4))
    path = tmp_path / "p.yaml"
    plan.to_yaml(path)
    doc = yaml.safe_load(path.read_text())
    assert doc["schema_version"] == SCHEMA_VERSION == 9 and doc["quantizer"]["heavy_length"] == 4
    back = Plan.from_yaml(path)
    assert back.quantizer == plan.quantizer and back.bpv() == plan.bpv() and back.bpv().residual > base.bpv().residual
    assert "heavy_length" not in base.to_dict()["quantizer"]  # 0: the default, not written
    _assert_new_key_refused(doc, path, "heavy_length", 7, -1, r"quantizer\.heavy_length")
