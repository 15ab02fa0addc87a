"""Baselines evaluate through the same harness."""

import numpy as np
import pytest

from kvplan.evaluation import (evaluate, evaluate_peer, head_sensitivity, headguard_from_sensitivity, named_plan,
                               parse_peer, top_heads)
from kvplan.models import Geometry
from kvplan.plans import KVTUNER_PAIRS, layerwise_plan

MODS = ("text",)


def test_parse_peer_and_top_heads():
    assert parse_peer("quanto-int2") == ("quanto", 2) and parse_peer("hqq-int4") == ("hqq", 4)
    assert parse_peer("int2") is None
    s = np.zeros((4, 2))
    s[3, 1], s[0, 0] = 2.0, 1.0
    assert top_heads(s, 1 / 8) == [(3, 1)]
    assert top_heads(s, 2 / 8) == [(0, 0), (3, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["int8", "int4", "k4v2", "k4v2-g64", "int2-g128"])
def test_named_baselines(smol, prepared, name):
    r = evaluate(smol[0], named_plan(name, smol[0], modalities=MODS), prepared[:1], progress=False)
    assert r["kl"]["mean"] > 0 and 2 < r["bpv"] < 16
    assert r["bpv_accounting"] == pytest.approx(r["bpv_measured"])


@pytest.mark.slow
def test_layerwise_and_headguard(smol, prepared):
    model = smol[0]
    g = Geometry.of(model)
    pairs = [KVTUNER_PAIRS[i % len(KVTUNER_PAIRS)] for i in range(g.num_layers)]
    r = evaluate(model, layerwise_plan(g, pairs, modalities=MODS, residual_length=0), prepared[:1], progress=False)
    assert r["kl"]["mean"] > 0
    sens = head_sensitivity(model, prepared[:1], modality="text", kinds=("k",), layers=[0, 1], progress=False)
    assert sens["k"].shape == (g.num_layers, g.num_kv_heads) and (sens["k"][:2] > 0).all()
    plan = headguard_from_sensitivity(model, sens["score"], modalities=MODS, protected_modality="text",
                                      residual_length=0)
    t = plan.table()
    assert (t[:, :, 0, 0] == 16).sum() == int(np.ceil(g.num_layers * g.num_kv_heads / 8))
    hg = evaluate(model, plan, prepared[:1], progress=False)
    low = evaluate(model, named_plan("int2", model, modalities=MODS, residual_length=0), prepared[:1],
                   progress=False)
    assert hg["bpv"] > low["bpv"]


@pytest.mark.slow
@pytest.mark.parametrize("backend,bits", [("quanto", 2), ("hqq", 4)])
def test_quantized_cache_peers(smol, prepared, backend, bits):
    # hqq and optimum-quanto are in the test extra: a missing one fails here instead of skipping
    r = evaluate_peer(smol[0], backend, bits, prepared[:1], progress=False)
    assert r["kl"]["mean"] > 0
    assert bits < r["bpv"] < bits + 2  # codes + scales/zeros counted
    assert r["nbytes"]["codes"] > 0 and r["nbytes"]["scales_zeros"] > 0


@pytest.mark.parametrize("dtype, width", [("float32", 32), ("bfloat16", 16)])
def test_eval_states_a_baseline_at_the_width_kvplan_load_stores(dtype, width):
    """eval's baselines used to state their full-precision residual at 16 bits on an fp32 model, while
    kvplan.load (and the bytes eval measures) store it at 32: the same name had two bpvs."""
    import torch

    from kvplan.runtime.load import resolve_plan
    from tests.tiny_models import tiny_llama

    model = tiny_llama().to(getattr(torch, dtype))
    plan = named_plan("int4", model, modalities=MODS)
    assert plan.reference.full_precision_bits == width
    assert plan.bpv(context_len=300) == pytest.approx(resolve_plan("int4", model).bpv(context_len=300))
    g = Geometry.of(model)
    hg = headguard_from_sensitivity(model, np.arange(g.num_layers * g.num_kv_heads).reshape(g.num_layers, -1),
                                    modalities=MODS)
    assert hg.reference.full_precision_bits == width
    assert named_plan("int4", model, reference=plan.reference.__class__()).reference.full_precision_bits == 16
