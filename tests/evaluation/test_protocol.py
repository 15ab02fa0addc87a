"""Protocol invariants of the historical-cache harness on the real default model."""

import numpy as np
import pytest
import torch

from kvplan.evaluation import (ProtocolError, bootstrap_ci, bootstrap_ratio, build_plan_cache, cache_stats,
                               condition_plan, doc_split_topics, evaluate, score_cache)
from kvplan.evaluation.tasks import doc_sources, split_of
from kvplan.models import Geometry
from kvplan.plans import committed_length, uniform_plan

MODS = ("text", "doc")


def test_splits_never_share_a_topic():
    cal, held = set(doc_split_topics("calibration")), set(doc_split_topics("heldout"))
    assert cal and held and not cal & held
    assert all(split_of(t) in ("calibration", "heldout") for t, _ in doc_sources())
    names = [t for t, _ in doc_sources()]
    assert "customization" not in names  # duplicated inside 'specialnames'


def test_bootstrap_is_seeded():
    x = np.random.default_rng(1).normal(size=40)
    assert bootstrap_ci(x, seed=3) == bootstrap_ci(x, seed=3)
    m, lo, hi = bootstrap_ci(x)
    assert lo <= m <= hi
    r, lo, hi = bootstrap_ratio(np.abs(x) * 4, np.abs(x))
    assert r == pytest.approx(4.0) and lo == pytest.approx(4.0) and hi == pytest.approx(4.0)


@pytest.mark.slow
def test_samples_deterministic_and_labelled(smol, doc_samples):
    from kvplan.evaluation import default_task_samples

    again = default_task_samples(smol[1], split="heldout", n=3, history_tokens=256, eval_tokens=16)
    assert [s.history_ids for s in again] == [s.history_ids for s in doc_samples]
    assert [(s.options, s.answer) for s in again] == [(s.options, s.answer) for s in doc_samples]
    for s in doc_samples:
        assert len(s.history_ids) == 256 and len(s.eval_ids) == 16
        assert s.history_labels[0] == "text" and s.history_labels[-1] == "doc"
        assert 0 < s.history_labels.count("text") < 64
        assert len(s.options) == 4 and s.options[s.answer] is not None


@pytest.mark.slow
def test_fp16_plan_is_exactly_fp(smol, prepared):
    plan = condition_plan(Geometry.of(smol[0]), MODS, 16, None, None)  # residual 0: history goes through segments
    r = evaluate(smol[0], plan, prepared, progress=False)
    assert r["kl"]["mean"] == 0.0 and r["kl_max"]["mean"] == 0.0
    assert r["top1"]["mean"] == 1.0 and r["delta_nll"]["mean"] == 0.0
    assert r["bpv"] == 16.0 and r["quantized_tokens"] == {}


@pytest.mark.slow
def test_int2_worse_than_int4_worse_than_fp(smol, prepared):
    g = Geometry.of(smol[0])
    kl = {b: evaluate(smol[0], uniform_plan(g, b, modalities=MODS, residual_length=0), prepared,
                      progress=False)["kl"]["mean"] for b in (4, 2)}
    assert kl[2] > kl[4] > 0


@pytest.mark.slow
def test_fp_multiple_choice_well_above_chance(prepared):
    acc = np.mean([p.fp["correct"] for p in prepared])
    assert acc >= 2 / 3


@pytest.mark.slow
def test_only_history_is_quantized(smol, prepared):
    """Evaluated/question tokens reach attention at full precision; only history tokens are stored quantized."""
    from transformers import DynamicCache

    model = smol[0]
    p = prepared[0]
    plan = uniform_plan(Geometry.of(model), 2, modalities=MODS, residual_length=0)
    cache = build_plan_cache(model, plan, p)
    T = p.history_len
    stats = cache_stats(cache, p, plan)
    committed = committed_length(T, 0, 32)
    assert sum(stats["quantized_tokens"]["k"].values()) == committed <= T
    assert stats["bpv_accounting"] == pytest.approx(stats["bpv"])
    # reference: a plain DynamicCache holding the *dequantized* history, evaluated tokens in full precision
    ref = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        ref.layers[i].update(layer._read("k").clone(), layer._read("v").clone())
    R = p.rows.shape[0]
    ref.batch_repeat_interleave(R)
    with torch.no_grad():
        want = model(input_ids=p.rows, cache=ref, position_ids=p.position_ids).logits
    m = score_cache(model, p, cache)
    # the harness' metrics come from the same logits as the reference
    lp = torch.log_softmax(want.float(), -1)[0, : len(p.sample.eval_ids)]
    kl_ref = float((p.fp["scored"]["eval"].double().exp() * (p.fp["scored"]["eval"].double() - lp.double()))
                   .sum(-1).clamp_min(0).mean())
    assert m["kl"] == pytest.approx(kl_ref, rel=1e-4, abs=1e-7)


@pytest.mark.slow
def test_zero_quantized_condition_raises(smol, prepared):
    g = Geometry.of(smol[0])
    # the whole history sits in the full-precision residual: nothing of 'doc' can be quantized
    plan = uniform_plan(g, 16, modalities=MODS, residual_length=4096)
    t = plan.table()
    t[:, :, 0, 1] = 2
    with pytest.raises(ProtocolError, match="quantized zero"):
        evaluate(smol[0], plan.with_table(t), prepared[:1], progress=False)
    # a modality absent from the history cannot be 'meant' and silently pass either
    plan3 = condition_plan(g, ("text", "doc", "visual"), 2, "visual", "k")
    with pytest.raises(ProtocolError, match="visual"):
        evaluate(smol[0], plan3, prepared[:1], expect_quantized=[("k", "visual")], progress=False)


@pytest.mark.slow
def test_same_samples_same_numbers(smol, prepared):
    plan = condition_plan(Geometry.of(smol[0]), MODS, 4, "doc", "k")
    a = evaluate(smol[0], plan, prepared, progress=False)
    b = evaluate(smol[0], plan, prepared, progress=False)
    assert a == b
    assert a["quantized_tokens"]["k"]["doc"] > 0 and "v" not in a["quantized_tokens"]
