"""On the real default model: what is searched is what is deployed."""

import pytest

pytestmark = pytest.mark.slow


def test_searched_kl_equals_exported_plan_kl(tmp_path):
    from kvplan.evaluation.harness import evaluate
    from kvplan.plans import Plan
    from kvplan.search import search
    from kvplan.search.scorers import harness_scorers

    cal, held = harness_scorers(n_calibration=1, n_heldout=1, history_tokens=160, eval_tokens=8, progress=False)
    out = tmp_path / "plan.yaml"
    r = search(budget="3.3bpv", n_trials=4, scorer=cal, heldout_scorer=held, out=out, profile=False,
               progress=False)
    plan = Plan.from_yaml(out)
    assert plan.bpv().total <= 3.3 + 1e-9
    agg = evaluate(cal.model, plan, cal.prepared, progress=False)
    assert agg["kl"]["mean"] == pytest.approx(r.plan.metrics["calibration"]["kl"], rel=1e-6)
    assert agg["bpv"] == pytest.approx(plan.bpv().total, abs=1e-9)  # the cache stores what the plan states
