"""Plans for sliding-window / hybrid models: model.sliding_window, rope_inv_freq per layer type,
and the bpv of sliding layers (only their kept window is stored and counted)."""

import dataclasses

import pytest
import yaml

from kvplan import Geometry, Plan, PlanError, uniform_plan
from kvplan.plans import plan_bytes
from kvplan.plans.accounting import sliding_kept_start

HYBRID = Geometry(6, 2, 16, ("sliding",) * 5 + ("full",), "gemma3_text", 64)
LOCAL = [1.0 / 10000 ** (i / 8) for i in range(8)]
GLOBAL = [1.0 / 1000000 ** (i / 8) for i in range(8)]


def hybrid_plan(rope=None, geometry=HYBRID):
    plan = uniform_plan(geometry, 2, 4, residual_length=8)
    q = dataclasses.replace(plan.quantizer, key_pre_rope=True)
    return plan.replace(quantizer=q, rope_inv_freq=rope or {"full": GLOBAL, "sliding": LOCAL})


def test_round_trip_with_window_and_two_rope_bases():
    plan = hybrid_plan()
    d = yaml.safe_load(plan.to_yaml())
    assert d["model"]["sliding_window"] == 64
    assert d["rope_inv_freq"] == {"full": GLOBAL, "sliding": LOCAL}
    back = Plan.from_yaml(plan.to_yaml())
    assert back == plan and back.geometry.sliding_window == 64
    assert back.layer_inv_freq(0) == tuple(LOCAL) and back.layer_inv_freq(5) == tuple(GLOBAL)
    # one list (every plan file so far) still means every layer
    single = hybrid_plan(rope=LOCAL)
    assert Plan.from_yaml(single.to_yaml()).layer_inv_freq(5) == tuple(LOCAL)


def test_geometries_without_a_window_keep_their_fingerprint():
    g = Geometry(3, 2, 16, ("full",) * 3, "llama")
    assert g.fingerprint == "sha256:" + __import__("hashlib").sha256(
        b'["llama",3,2,16,["full","full","full"]]').hexdigest()[:16]
    assert HYBRID.fingerprint != dataclasses.replace(HYBRID, sliding_window=128).fingerprint
    assert "sliding_window" not in yaml.safe_load(uniform_plan(g, 4).to_yaml())["model"]


def _yaml_with(mutate):
    d = yaml.safe_load(hybrid_plan().to_yaml())
    d["budget"].pop("bpv")
    d["model"].pop("fingerprint")
    mutate(d)
    return yaml.safe_dump(d)


@pytest.mark.parametrize("mutate, path, words", [
    (lambda d: d["rope_inv_freq"].pop("full"), "rope_inv_freq", "the model's are ['full', 'sliding']"),
    (lambda d: d["rope_inv_freq"].update(chunked=LOCAL), "rope_inv_freq", "names layer types"),
    (lambda d: d["rope_inv_freq"].update(sliding=LOCAL * 2), "rope_inv_freq.sliding", "head_dim / 2 = 8"),
    (lambda d: d["rope_inv_freq"]["full"].__setitem__(2, 0.0), "rope_inv_freq.full[2]", "positive"),
    (lambda d: d["rope_inv_freq"]["full"].__setitem__(1, "x"), "rope_inv_freq.full[1]", "a number"),
    (lambda d: d["rope_inv_freq"].update(full=[]), "rope_inv_freq.full", "non-empty list"),
    (lambda d: d.update(rope_inv_freq={}), "rope_inv_freq", "mapping of layer type"),
    (lambda d: d["model"].update(sliding_window=0), "model.sliding_window", "must be in"),
    (lambda d: d["model"].update(sliding_window="512"), "model.sliding_window", "integer"),
    (lambda d: d["model"].update(sliding_window=2 ** 40), "model.sliding_window", "must be in"),
    (lambda d: d["model"].update(layer_types="full"), "model.sliding_window", "no layer type is 'sliding'"),
])
def test_invalid_sliding_fields_name_the_key(mutate, path, words):
    with pytest.raises(PlanError) as e:
        Plan.from_yaml(_yaml_with(mutate))
    assert e.value.path == path and words in str(e.value), str(e.value)


def test_check_geometry_compares_windows():
    plan = hybrid_plan()
    with pytest.raises(PlanError, match="model.sliding_window: plan was made for 64"):
        plan.check_geometry(dataclasses.replace(HYBRID, sliding_window=512))
    old = plan.replace(geometry=dataclasses.replace(HYBRID, sliding_window=None))  # an older file: no window
    old.check_geometry(HYBRID)


@pytest.mark.parametrize("T", [1, 40, 63, 64, 71, 72, 100, 127, 128, 160, 1000, 4096])
def test_sliding_layers_count_only_their_kept_window(T):
    """bpv of a sliding layer is over what it keeps: whole 32-token groups before the newest 63
    tokens are freed; bytes per layer follow."""
    plan = uniform_plan(HYBRID, 2, 4, residual_length=8)
    full = plan.replace(geometry=Geometry(6, 2, 16, ("full",) * 6, "gemma3_text"))
    kept = sliding_kept_start(T, 64, 32)
    assert kept == (0 if T < 64 + 31 else 32 * ((T - 63) // 32))
    one_full = plan_bytes(full, full.geometry, ["text"] * T)
    one_sliding = plan_bytes(plan, plan.geometry, ["text"] * T)
    if kept == 0:
        assert one_sliding == one_full and plan.bpv(context_len=T) == full.bpv(context_len=T)
    else:
        assert sum(one_sliding.values()) < sum(one_full.values())
    values = 2 * 2 * 16 * (5 * (T - kept) + T)
    assert plan.bpv(context_len=T).total == 8 * sum(one_sliding.values()) / values


def test_sliding_window_bytes_stop_growing():
    plan = uniform_plan(HYBRID, 2, 4, residual_length=8)
    only_sliding = plan.replace(geometry=Geometry(6, 2, 16, ("sliding",) * 6, "gemma3_text", 64))
    sizes = [sum(plan_bytes(only_sliding, only_sliding.geometry, ["text"] * T).values()) for T in (2016, 20000)]
    assert sizes[0] == sizes[1]  # same position inside a group: same kept window
