"""Plans with rotations (quantizer.rotation, quantizer.key_pre_rope + rope_inv_freq)."""

import dataclasses

import pytest
import yaml

from kvplan import Geometry, Plan, PlanError, uniform_plan

GEOM = Geometry(3, 2, 16, ("full",) * 3, "llama")
INV_FREQ = [1.0 / 10000 ** (i / 8) for i in range(8)]


def rotated_plan(rotation="hadamard", pre_rope=True, geometry=GEOM):
    plan = uniform_plan(geometry, 2, 4, residual_length=0)
    q = dataclasses.replace(plan.quantizer, rotation=rotation, key_pre_rope=pre_rope)
    return plan.replace(quantizer=q, rope_inv_freq=INV_FREQ if pre_rope else None)


def test_yaml_round_trip_and_unchanged_bpv():
    plan = rotated_plan()
    d = yaml.safe_load(plan.to_yaml())
    assert d["quantizer"]["rotation"] == "hadamard" and d["quantizer"]["key_pre_rope"] is True
    assert d["rope_inv_freq"] == INV_FREQ  # exact floats
    back = Plan.from_yaml(plan.to_yaml())
    assert back == plan and back.rope_inv_freq == tuple(INV_FREQ)
    plain = uniform_plan(GEOM, 2, 4, residual_length=0)
    assert back.bpv() == plain.bpv()  # rotations are plan constants, not cache bytes


def test_plans_without_rotation_write_no_rotation_fields():
    d = yaml.safe_load(uniform_plan(GEOM, 2, 4).to_yaml())
    assert "rotation" not in d["quantizer"] and "key_pre_rope" not in d["quantizer"]
    assert "rope_inv_freq" not in d


def _yaml_with(mutate):
    d = yaml.safe_load(rotated_plan().to_yaml())
    mutate(d)
    return yaml.safe_dump(d)


@pytest.mark.parametrize("mutate, path, words", [
    (lambda d: d["quantizer"].update(rotation="random"), "quantizer.rotation", "must be one of"),
    (lambda d: d["quantizer"].update(key_pre_rope="yes"), "quantizer.key_pre_rope", "true or false"),
    (lambda d: d.pop("rope_inv_freq"), "rope_inv_freq", "missing"),
    (lambda d: d["quantizer"].pop("key_pre_rope"), "rope_inv_freq", "key_pre_rope is false"),
    (lambda d: d.update(rope_inv_freq=INV_FREQ * 2), "rope_inv_freq", "head_dim / 2 = 8"),
    (lambda d: d["rope_inv_freq"].__setitem__(3, -1.0), "rope_inv_freq[3]", "positive"),
    (lambda d: d["rope_inv_freq"].__setitem__(2, "x"), "rope_inv_freq[2]", "a number"),
    (lambda d: d.update(rope_inv_freq="1,2"), "rope_inv_freq", "list of numbers"),
])
def test_invalid_rotation_fields_name_the_key(mutate, path, words):
    with pytest.raises(PlanError) as e:
        Plan.from_yaml(_yaml_with(mutate))
    assert e.value.path == path and words in str(e.value)


def test_hadamard_needs_a_power_of_two_head_dim():
    with pytest.raises(PlanError) as e:
        rotated_plan(pre_rope=False, geometry=Geometry(2, 2, 48, ("full",) * 2, "llama"))
    assert e.value.path == "quantizer.rotation" and "48" in str(e.value)
