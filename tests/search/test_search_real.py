"""On the real default model: what is searched is what is deployed."""

import math

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    from kvplan.evaluation import get_model
    from kvplan.search import search
    from kvplan.search.scorers import task_scorers

    model, tok = get_model()
    scorers = task_scorers((model, tok), n_calibration=2, n_validation=2, n_test=3, history_tokens=160,
                           eval_tokens=8, progress=False)
    out = tmp_path_factory.mktemp("s") / "plan.yaml"
    r = search(budget="3.3bpv", n_trials=5, scorer=scorers.calibration, validation_scorer=scorers.validation,
               test_scorer=scorers.test, out=out, profile=False, progress=False)
    return model, tok, scorers, r, out


def test_searched_kl_equals_exported_plan_kl(searched):
    from kvplan.evaluation.harness import evaluate
    from kvplan.plans import Plan

    model, _, scorers, r, out = searched
    plan = Plan.from_yaml(out)
    assert plan.bpv().total <= 3.3 + 1e-9
    assert plan.modalities == ("text",) and plan.reference.full_precision_bits == 32  # the fp32 model's storage
    agg = evaluate(model, plan, scorers.calibration.prepared, progress=False)
    assert agg["kl"]["mean"] == pytest.approx(r.plan.metrics["calibration"]["kl"], rel=1e-6)
    # the cache stores what the plan states, at the history length it is stated for
    assert agg["bpv_measured"] == plan.bpv().total
    # the final plan was chosen on validation among the best calibration trials
    cands = plan.metrics["search"]["validation_candidates"]
    assert len(cands) >= 2 and plan.metrics["validation"]["kl"] == min(c["validation_kl"] for c in cands)


def test_test_kl_in_plan_is_what_kvplan_load_gives(searched):
    """A user's path: kvplan.load, a fresh cache labelled from the prompt's token ids, prefill the
    history, run the continuation; KL against a plain full-precision run, on the test split."""
    import kvplan
    from transformers import DynamicCache

    model, _, scorers, _, out = searched
    plan = kvplan.Plan.from_yaml(out)
    kvplan.load(model, out)  # attention="auto": the chunked kernel on CPU
    kls = []
    try:
        with torch.no_grad():
            for p in scorers.test.prepared:
                hist = torch.tensor([p.sample.history_ids])
                cont = torch.tensor([p.sample.eval_ids])
                cache = kvplan.make_cache(model, out, hist)
                assert cache.attention_kernel is not None
                model(input_ids=hist, cache=cache)
                assert 8 * cache.nbytes() / cache.num_values() == plan.bpv().total
                lq = torch.log_softmax(model(input_ids=cont, cache=cache).logits[0].float(), -1).double()
                fp = DynamicCache(config=model.config)
                model(input_ids=hist, cache=fp)
                lp = torch.log_softmax(model(input_ids=cont, cache=fp).logits[0].float(), -1).double()
                kls.append(float((lp.exp() * (lp - lq)).sum(-1).clamp_min(0).mean()))
    finally:
        kvplan.unload(model)
    recorded = plan.metrics["test"]["kl"]
    assert recorded > 0 and math.isclose(sum(kls) / len(kls), recorded, rel_tol=1e-4)


def test_plan_with_labels_the_runtime_cannot_produce_is_refused(searched, tmp_path):
    import kvplan

    model, *_ = searched
    other = kvplan.uniform_plan(kvplan.Geometry.of(model), 2, modalities=("text", "doc"))
    with pytest.raises(kvplan.PlanError, match=r"\['doc'\] cannot be produced by the token labelling"):
        kvplan.load(model, other)
