"""The historical-cache protocol and the search on sliding-window models (tiny random Gemma 3 and
Mistral, histories longer than the window): the FP reference is the model's own DynamicCache,
plans are scored as deployed and stored at their stated bpv."""

import math

import numpy as np
import pytest
import torch

import kvplan
from kvplan import Geometry, Plan
from kvplan.evaluation.harness import Sample, evaluate, prepare_samples
from kvplan.plans import QuantizerSettings, Reference
from kvplan.search import search
from kvplan.search.scorers import HarnessScorer
from tests.tiny_models import tiny_gemma3, tiny_llama

W = 40
HISTORY = 100  # 2.5 windows


def samples(n, seed, options=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, 250, (HISTORY + 8,), generator=g).tolist()
        kw = {}
        if options and i == 0:
            kw = dict(question_ids=[7, 8, 9], options=[[10, 11], [12], [13, 14]], answer=1)
        out.append(Sample(ids[:HISTORY], ["text"] * HISTORY, ids[HISTORY:], meta={"id": i}, **kw))
    return out


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def model(request):
    return tiny_gemma3(sliding_window=W) if request.param == "gemma3" else tiny_llama(
        model_type="mistral", sliding_window=W, num_layers=3)


def fp16_plan(model):
    g = Geometry.of(model)
    return Plan.from_table(np.full((g.num_layers, g.num_kv_heads, 2, 1), 16), g,
                           quantizer=QuantizerSettings(residual_length=0))


def test_fp16_plan_scores_exactly_the_models_own_cache(model):
    prepared = prepare_samples(model, samples(2, 0, options=True), progress=False, attention="dequantize")
    assert all(k.shape[-2] == HISTORY for k, _ in prepared[0].kv)  # the whole history, every layer
    r = evaluate(model, fp16_plan(model), prepared, progress=False, attention="dequantize")
    assert r["kl"]["mean"] == 0.0 and r["kl_answer"]["mean"] == 0.0 and r["choice_agree"]["mean"] == 1.0
    # and the FP reference is what a plain forward on the model's DynamicCache gives
    from transformers import DynamicCache

    s = prepared[1].sample
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([s.history_ids]), cache=cache)
        lp = torch.log_softmax(model(input_ids=torch.tensor([s.eval_ids]), cache=cache).logits[0].float(), -1)
    assert torch.allclose(lp, prepared[1].fp["scored"]["eval"], atol=1e-5)


def test_quantized_plan_is_stored_at_its_stated_bpv(model):
    g = Geometry.of(model)
    plan = kvplan.uniform_plan(g, 2, 4, residual_length=4).replace(
        reference=Reference(HISTORY, (("text", 1.0),), 32))
    prepared = prepare_samples(model, samples(2, 1), progress=False)
    r = evaluate(model, plan, prepared, progress=False)
    assert r["kl"]["mean"] > 0
    assert r["bpv_measured"] == r["bpv_accounting"] == plan.bpv().total
    # the sliding layers freed the groups that left the window: fewer values than T per layer
    n_full = 2 * g.num_kv_heads * g.head_dim * HISTORY * g.num_layers * len(prepared)
    assert r["num_values"] < n_full


def test_search_on_a_sliding_model_deploys_as_searched(model, tmp_path):
    """A short search with the default codec (Hadamard, pre-RoPE keys with each layer type's
    RoPE base, key correction): the exported plan loads, measures the searched KL through the
    harness, and kvplan.load's cache on the same history stores its stated bpv."""
    prepared = prepare_samples(model, samples(2, 2), progress=False)
    ref = Reference(HISTORY, (("text", 1.0),), 32)
    scorer = HarnessScorer(model, prepared, ref, ("text",), "calibration", "sha256:test")
    out = tmp_path / "plan.yaml"
    r = search(model, budget="6bpv", n_trials=3, seed=0, scorer=scorer, out=out, profile=False,
               n_candidates=4, n_local=4, progress=False, reference=ref, group_sizes=(32,),
               residual_lengths=(0, 8))
    plan = Plan.from_yaml(out)
    assert plan.quantizer.key_pre_rope and plan.geometry.sliding_window == W
    if Geometry.of(model).model_type == "gemma3_text":
        assert set(plan.rope_inv_freq) == {"full", "sliding"}
    assert plan.bpv().total <= 6 + 1e-9
    agg = evaluate(model, plan, prepared, progress=False)
    assert math.isclose(agg["kl"]["mean"], r.plan.metrics["calibration"]["kl"], rel_tol=1e-6)
    assert agg["bpv_measured"] == plan.bpv().total
    kvplan.load(model, out)
    try:
        s = prepared[0].sample
        cache = kvplan.make_cache(model, out, torch.tensor([s.history_ids]))
        with torch.no_grad():
            model(input_ids=torch.tensor([s.history_ids]), cache=cache)
        assert cache.bpv() == plan.bpv().total
    finally:
        kvplan.unload(model)
