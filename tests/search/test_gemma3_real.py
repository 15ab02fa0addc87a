"""On Gemma-3-270M (second real model: 15 sliding-window layers of window 512, 3 global ones,
two RoPE bases): search with histories past the window, deploy, and a long generation that
stores less than the model's own DynamicCache at every length."""

import math

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def searched(gemma3, tmp_path_factory):
    from kvplan.search import search
    from kvplan.search.scorers import task_scorers

    torch.set_num_threads(1)
    scorers = task_scorers(gemma3, n_calibration=2, n_validation=1, n_test=1, history_tokens=640, eval_tokens=8,
                           progress=False)
    out = tmp_path_factory.mktemp("g") / "plan.yaml"
    r = search(budget="3bpv", n_trials=3, scorer=scorers.calibration, validation_scorer=scorers.validation,
               test_scorer=scorers.test, out=out, profile=False, progress=False, n_candidates=4, n_local=4)
    return gemma3, scorers, r, out


def test_geometry_and_plan_describe_the_hybrid_model(searched):
    from kvplan import Geometry, Plan
    from kvplan.models import rope_inv_freq

    (model, _), _, _, out = searched
    g = Geometry.of(model)
    assert g.model_type == "gemma3_text" and g.num_layers == 18 and g.sliding_window == 512
    assert g.layer_types == (("sliding",) * 5 + ("full",)) * 3
    plan = Plan.from_yaml(out)
    assert plan.geometry == g and plan.quantizer.key_pre_rope
    freqs = rope_inv_freq(model)
    assert plan.rope_inv_freq == freqs and freqs["sliding"] != freqs["full"]  # RoPE bases 10k and 1M


def test_searched_plan_deploys_at_its_kl_and_bpv(searched):
    """History 640 > window 512: the sliding layers freed their oldest groups; the exported plan
    scores the searched KL and its cache stores exactly the stated bpv."""
    from kvplan.evaluation.harness import evaluate
    from kvplan.plans import Plan

    (model, _), scorers, r, out = searched
    plan = Plan.from_yaml(out)
    assert plan.bpv().total <= 3 + 1e-9 and plan.reference.context_len == 640
    agg = evaluate(model, plan, scorers.calibration.prepared, progress=False)
    assert agg["kl"]["mean"] == pytest.approx(r.plan.metrics["calibration"]["kl"], rel=1e-6)
    assert agg["bpv_measured"] == plan.bpv().total
    full = 2 * 18 * 1 * 256 * 640 * len(scorers.calibration.prepared)
    assert agg["num_values"] < full  # sliding layers hold their window only


def test_long_generation_stores_less_than_dynamic_cache_at_every_length(searched):
    """kvplan.load, a 600-token prompt (past the window), then 48 greedy decode steps: at every length the
    plan's cache holds fewer bytes than DynamicCache (whose sliding layers keep 511 tokens) and
    exactly the plan's bpv."""
    import kvplan
    from kvplan.plans.accounting import sliding_kept_start
    from transformers import DynamicCache

    (model, tok), scorers, _, out = searched
    plan = kvplan.Plan.from_yaml(out)
    prompt = torch.tensor([scorers.test.prepared[0].sample.history_ids[:600]])
    kvplan.load(model, out)
    try:
        cache = kvplan.make_cache(model, out, prompt)
        fp = DynamicCache(config=model.config)
        x, agree = prompt, []
        with torch.no_grad():
            for _ in range(48):
                a = model(input_ids=x, cache=cache).logits[:, -1]
                b = model(input_ids=x, cache=fp).logits[:, -1]
                T = cache.get_seq_length()
                fp_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in fp.layers)
                assert cache.nbytes() < fp_bytes, T
                assert cache.bpv() == plan.bpv(context_len=T).total, T
                agree.append(bool(a.argmax() == b.argmax()))
                x = b.argmax(-1, keepdim=True)  # both follow the full-precision continuation
        G = plan.quantizer.group_size
        assert T == 647 and all(layer.dropped == sliding_kept_start(T, 512, G) > 0
                                for layer, t in zip(cache.layers, plan.geometry.layer_types) if t == "sliding")
        assert sum(agree) / len(agree) > 0.5
    finally:
        kvplan.unload(model)
    recorded = plan.metrics["test"]["kl"]
    assert recorded > 0 and math.isfinite(recorded)
