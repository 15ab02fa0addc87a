"""Plans with the HeadQ-style key correction: YAML round trip, rule compression, validation."""

import dataclasses

import numpy as np
import pytest
import yaml

from kvplan import Geometry, Plan, PlanError, uniform_plan
from kvplan.plans import CORRECTED, KeyBasis

GEOM = Geometry(3, 2, 16, ("full",) * 3, "llama")


def corrected_plan(codes=None, rank=2, modalities=("text",)):
    plan = uniform_plan(GEOM, 2, 4, residual_length=0, modalities=modalities)
    q = dataclasses.replace(plan.quantizer, key_correction_rank=rank)
    if codes is None:
        codes = plan.table()
        codes[:, 1, 0] += CORRECTED  # keys of KV head 1 corrected in every layer
    basis = np.linalg.qr(np.random.default_rng(0).standard_normal((3, 2, 16, 16)))[0][..., :rank]
    return plan.with_table(codes, quantizer=q, key_basis=basis)


def test_yaml_round_trip_keeps_codes_and_basis():
    plan = corrected_plan()
    text = plan.to_yaml()
    d = yaml.safe_load(text)
    assert d["quantizer"]["key_correction_rank"] == 2
    assert any(r.get("correct") is True and r["kind"] == "k" for r in d["bits"]["rules"])
    assert d["key_basis"]["shape"] == [3, 2, 16, 2]
    back = Plan.from_yaml(text)
    assert back == plan
    assert np.array_equal(back.code_table(), plan.code_table())
    assert back.correction_table()[:, 1, 0].all() and back.correction_table().sum() == 3
    assert np.array_equal(back.table(), plan.table())  # bits alone: the correction is not a bit width
    np.testing.assert_array_equal(back.key_basis.array, plan.key_basis.array)
    assert back.bpv().correction > 0
    assert np.array_equal(Plan.from_yaml(plan.to_yaml(flat=True)).code_table(), plan.code_table())


def test_plans_without_correction_write_no_correction_fields():
    d = yaml.safe_load(uniform_plan(GEOM, 2, 2).to_yaml())
    assert "key_basis" not in d and "key_correction_rank" not in d["quantizer"]


@pytest.mark.parametrize("seed", range(6))
def test_random_code_tables_compress_exactly(seed):
    rng = np.random.default_rng(seed)
    codes = rng.choice([2, 3, 4, 8, 16], size=(3, 2, 2, 2))
    corrected = (rng.random(codes.shape) < (0.2 + 0.15 * seed)) & (codes < 16)
    corrected[:, :, 1] = False  # values are never corrected
    codes = codes + CORRECTED * corrected
    plan = corrected_plan(codes, modalities=("text", "doc"))
    assert np.array_equal(plan.code_table(), codes)
    assert plan.default_bits < CORRECTED
    assert all(r.kind == "k" for r in plan.rules if r.correct)  # a correcting rule selects keys alone
    assert Plan.from_yaml(plan.to_yaml()) == plan


def _bad(mutate):
    d = yaml.safe_load(corrected_plan().to_yaml())
    del d["budget"]["bpv"]
    mutate(d)
    with pytest.raises(PlanError) as info:
        Plan.from_dict(d)
    return info.value


@pytest.mark.parametrize("mutate,path,words", [
    (lambda d: d["bits"]["rules"].append({"kind": "v", "bits": 2, "correct": True}), "bits.rules[2].correct",
     "keys only"),
    (lambda d: d["bits"]["rules"].append({"bits": 2, "correct": True}), "bits.rules[2].correct", "keys only"),
    (lambda d: d["bits"]["rules"].append({"kind": "k", "bits": 16, "correct": True}), "bits.rules[2].correct",
     "full-precision"),
    (lambda d: d["bits"]["rules"].append({"kind": "k", "bits": 2, "correct": "yes"}), "bits.rules[2].correct",
     "true or false"),
    (lambda d: d["quantizer"].update(key_correction_rank=0), "bits.rules[1].correct", "key_correction_rank > 0"),
    (lambda d: d.pop("key_basis"), "key_basis", "missing"),
    (lambda d: d["key_basis"].update(shape=[3, 2, 16, 3]), "key_basis.shape", "[3, 2, 16, 2]"),
    (lambda d: d["key_basis"].update(base64=d["key_basis"]["base64"][:-8]), "key_basis.base64", "truncated"),
    (lambda d: d["key_basis"].update(base64=d["key_basis"]["base64"][:-3]), "key_basis.base64", "not valid base64"),
    (lambda d: d["quantizer"].update(key_correction_rank=17), "quantizer.key_correction_rank", "at most head_dim"),
    (lambda d: d["key_basis"].update(base64="not base64!"), "key_basis.base64", "not valid base64"),
    (lambda d: d["key_basis"].update(dtype="float64"), "key_basis.dtype", "must be one of"),
    (lambda d: d["key_basis"].update(extra=1), "key_basis.extra", "unknown key"),
    (lambda d: d["quantizer"].update(key_correction_bits=5), "quantizer.key_correction_bits", "must be one of"),
    (lambda d: d["quantizer"].update(key_axis="token"), "quantizer.key_correction_rank", "key_axis 'channel'"),
])
def test_invalid_correction_fields_name_the_key(mutate, path, words):
    err = _bad(mutate)
    assert err.path == path and words in err.problem


def test_basis_shape_must_match_model_and_rank():
    plan = corrected_plan()
    with pytest.raises(PlanError, match=r"key_basis.shape: must be .*\[3, 2, 16, 2\]"):
        plan.replace(key_basis=np.zeros((3, 2, 16, 3)))
    with pytest.raises(PlanError, match="non-finite"):
        KeyBasis(np.full((3, 2, 16, 2), np.nan))
    with pytest.raises(PlanError, match="key_basis: given but"):
        uniform_plan(GEOM, 2, 2).replace(key_basis=np.zeros((3, 2, 16, 2)))


def test_slot_codes_pack_bits_and_correction_in_one_place():
    from kvplan.plans import STREAMED, codes_error, is_corrected, slot_code, split_codes
    from kvplan.plans._fields import PLAN_BITS

    codes = np.array([slot_code(b, c) for b in (2, 3, 4) for c in (False, True)] + [STREAMED, 8, 16])
    bits, corrected = split_codes(codes)
    assert bits.tolist() == [2, 2, 3, 3, 4, 4, 0, 8, 16]
    assert corrected.tolist() == is_corrected(codes).tolist() == [False, True] * 3 + [False] * 3
    assert codes_error(codes, PLAN_BITS) is None
    for bad in (slot_code(STREAMED, True), slot_code(16, True), 5, -1, 2 * slot_code(2, True)):
        assert "format codes other than" in codes_error(np.array([2, bad]), PLAN_BITS), bad
