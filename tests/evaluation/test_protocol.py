"""Protocol invariants of the historical-cache harness on the real default model."""

import numpy as np
import pytest
import torch

from dataclasses import replace

from kvplan import PlanError
from kvplan.evaluation import (ProtocolError, bootstrap_ci, bootstrap_ratio, build_plan_cache, cache_stats,
                               condition_plan, doc_split_topics, evaluate, prepare_sample, prepare_samples,
                               score_cache)
from kvplan.evaluation.tasks import TaskError, doc_sources, split_of
from kvplan.models import Geometry
from kvplan.plans import committed_length, uniform_plan

MODS = ("text",)


def test_three_splits_never_share_a_topic():
    splits = {s: set(doc_split_topics(s)) for s in ("calibration", "validation", "test")}
    assert all(len(t) >= 10 for t in splits.values())  # 59 topics in all
    assert not splits["calibration"] & splits["validation"]
    assert not splits["calibration"] & splits["test"] and not splits["validation"] & splits["test"]
    assert set.union(*splits.values()) == {t for t, _ in doc_sources()}
    assert set(doc_split_topics("heldout")) == splits["test"]  # the old name of the test split
    with pytest.raises(TaskError, match="unknown split 'train'"):
        doc_split_topics("train")
    assert split_of("specialnames") in splits and split_of("specialnames") == split_of("specialnames")
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

    again = default_task_samples(smol[1], split="test", n=3, history_tokens=256, eval_tokens=16)
    assert [s.history_ids for s in again] == [s.history_ids for s in doc_samples]
    assert [(s.options, s.answer) for s in again] == [(s.options, s.answer) for s in doc_samples]
    for s in doc_samples:
        assert len(s.history_ids) == 256 and len(s.eval_ids) == 16
        # a text model's prompt tokens are all 'text' at deployment: so are the task's
        assert s.history_labels == ["text"] * 256
        assert len(s.options) == 4 and s.options[s.answer] is not None
    with pytest.raises(TaskError, match="only .* windows"):
        default_task_samples(smol[1], split="test", n=100000, history_tokens=256)
    with pytest.raises(TaskError, match="--history-tokens 40 is too short"):
        default_task_samples(smol[1], split="test", n=1, history_tokens=40)


@pytest.mark.slow
def test_labels_the_runtime_cannot_reproduce_are_refused(smol, doc_samples):
    s = doc_samples[0]
    forged = replace(s, history_labels=["text"] * 40 + ["doc"] * (len(s.history_ids) - 40))
    with pytest.raises(ProtocolError, match="history token 40 is labelled 'doc' but kvplan.load labels it 'text'"):
        prepare_sample(smol[0], forged)


@pytest.mark.slow
def test_fp16_plan_is_exactly_fp(smol, prepared):
    plan = condition_plan(Geometry.of(smol[0]), MODS, 16, None, None)  # residual 0: history goes through segments
    # the dequantize route runs the model's own attention on exact copies: bit-identical to FP
    fp_prepared = prepare_samples(smol[0], [p.sample for p in prepared], progress=False, attention="dequantize")
    r = evaluate(smol[0], plan, fp_prepared, progress=False, attention="dequantize")
    assert r["kl"]["mean"] == 0.0 and r["kl_max"]["mean"] == 0.0
    assert r["top1"]["mean"] == 1.0 and r["delta_nll"]["mean"] == 0.0
    assert r["bpv"] == 16.0 and r["quantized_tokens"] == {}
    # the deployed route (16 evaluated tokens: the chunked kernel) differs only by its float rounding
    r = evaluate(smol[0], plan, prepared, progress=False)
    assert 0.0 <= r["kl"]["mean"] < 1e-6 and r["top1"]["mean"] == 1.0


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
    assert stats["bpv_accounting"] == stats["bpv_measured"]  # accounting at the model's fp32 storage
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
def test_cache_stats_count_a_coded_residual_as_coded(smol, prepared):
    """With quantizer.residual_bits the waiting tokens are codes, not model-dtype values: the measured bpv
    (fp32 storage) and the 16-bit-equivalent bpv both equal the plan's accounting."""
    g = Geometry.of(smol[0])
    base = uniform_plan(g, 2, modalities=MODS, group_size=128, residual_length=16)  # 256 tokens: 128 wait
    plan = base.replace(quantizer=replace(base.quantizer, residual_bits=8))
    p = prepared[0]
    stats = cache_stats(build_plan_cache(smol[0], plan, p), p, plan)
    T = p.history_len
    assert stats["nbytes"]["residual"] > 0
    assert stats["bpv_measured"] == plan.bpv(context_len=T, full_precision_bits=32).total
    assert stats["bpv"] == plan.bpv(context_len=T, full_precision_bits=16).total
    assert stats["bpv"] < base.bpv(context_len=T, full_precision_bits=16).total


@pytest.mark.slow
@pytest.mark.parametrize("residual_bits", [16, 8])
def test_cache_stats_of_streamed_heads_equal_the_plans_accounting_and_count_nothing_streamed_as_quantized(
        smol, prepared, residual_bits):
    """A streamed head's window copies held at full precision were left out of the bytes re-counted at 16
    bits (eval's headline bpv read 2.655 for a 2.588 bpv plan), and the tokens a streamed head does not
    store were counted as quantized."""
    from kvplan.plans import STREAMED
    from kvplan.runtime import attention_route

    model = smol[0]
    base = uniform_plan(Geometry.of(model), 2, modalities=MODS, group_size=32, residual_length=16)
    base = base.replace(quantizer=replace(base.quantizer, residual_bits=residual_bits, stream_window=12))
    table = base.code_table().copy()
    table[3, 1] = table[20, 0] = STREAMED
    plan = base.with_table(table)
    p = prepared[0]
    with attention_route(model, "auto", plan):
        stats = cache_stats(build_plan_cache(model, plan, p), p, plan)
    T = p.history_len
    assert stats["bpv_measured"] == pytest.approx(plan.bpv(context_len=T, full_precision_bits=32).total, rel=1e-12)
    assert stats["bpv"] == pytest.approx(plan.bpv(context_len=T, full_precision_bits=16).total, rel=1e-12)
    g = Geometry.of(model)
    coded = stats["token_bits"]["k"]["text"]["2"] * g.num_layers * g.num_kv_heads
    assert stats["quantized_tokens"]["k"]["text"] * g.num_layers * g.num_kv_heads == pytest.approx(coded)
    streamed = stats["token_bits"]["k"]["text"]["0"] * g.num_layers * g.num_kv_heads
    assert streamed > 0 and stats["streamed_tokens"]["k"]["text"] * g.num_layers * g.num_kv_heads == pytest.approx(
        streamed)


def test_kl_in_row_chunks_equals_the_whole_formula():
    from kvplan.evaluation import harness

    g = torch.Generator().manual_seed(0)
    for V in (1000, 300_000):  # many rows per chunk; one row per chunk (a 262k-vocabulary row is 2 MiB)
        lp = torch.log_softmax(torch.randn(2, 5, V, generator=g) * 3, -1)
        lq = torch.log_softmax(lp + 0.1 * torch.randn(2, 5, V, generator=g), -1)
        whole = (lp.double().exp() * (lp.double() - lq.double())).sum(-1).clamp_min(0.0)
        got = harness.kl_divergence(lp, lq)
        assert got.shape == (2, 5) and got.dtype == torch.float64
        assert torch.allclose(got, whole, rtol=1e-12, atol=0) and (got > 0).all()
        assert harness.kl_divergence(lp, lp).abs().max() == 0


@pytest.mark.slow
def test_multiple_choice_rows_project_only_the_positions_read(smol, prepared):
    """The option rows skip the vocabulary projection of the question's positions (``logits_to_keep``);
    the answer-position distribution and the option log-likelihoods are those of every position's logits."""
    from kvplan.evaluation.harness import _forward_rows, _score_rows

    model, p = smol[0], prepared[0]
    s = p.sample
    assert s.options and len(s.question_ids) > 1
    plan = uniform_plan(Geometry.of(model), 2, modalities=MODS, residual_length=0)
    got = _score_rows(model, build_plan_cache(model, plan, p), p.rows, p.position_ids, s)
    cache = build_plan_cache(model, plan, p)
    n = len(s.eval_ids)
    _forward_rows(model, cache, p.rows[:1, :n], p.position_ids[..., :1, :n])
    cache.crop(-n)
    cache.batch_repeat_interleave(len(s.options))
    full = _forward_rows(model, cache, p.rows[1:], p.position_ids[..., 1:, :])  # [n_opt, L, V]: every position
    q = len(s.question_ids)
    # fp32 logits of magnitude ~20 from projections of another shape: their GEMM blocking, which follows the
    # host's CPU, rounds them differently (2.7e-5 apart on an Intel Xeon, within 1e-5 on the AMD EPYC before)
    assert torch.allclose(got["answer_pos"], full[0, q - 1], rtol=5e-6, atol=1e-5)
    want = torch.stack([full[i, torch.arange(q - 1, q - 1 + len(o)), torch.tensor(o)].sum()
                        for i, o in enumerate(s.options)])
    assert torch.allclose(got["option_ll"], want, rtol=0, atol=1e-4)
    assert not torch.allclose(full[0, q - 2], full[0, q - 1], atol=1e-2)  # a shifted read would be seen


@pytest.mark.slow
def test_zero_quantized_condition_raises(smol, prepared):
    g = Geometry.of(smol[0])
    # the whole history sits in the full-precision residual: nothing can be quantized
    plan = uniform_plan(g, 16, modalities=MODS, residual_length=4096)
    t = plan.table()
    t[:, :, 0, 0] = 2
    with pytest.raises(ProtocolError, match="quantized zero"):
        evaluate(smol[0], plan.with_table(t), prepared[:1], progress=False)
    # a plan for modalities this model's labelling never produces is refused, naming them
    plan3 = condition_plan(g, ("text", "doc", "visual"), 2, "visual", "k")
    with pytest.raises(PlanError, match=r"\['doc', 'visual'\] cannot be produced by the token labelling"):
        evaluate(smol[0], plan3, prepared[:1], progress=False)


@pytest.mark.slow
def test_same_samples_same_numbers(smol, prepared):
    plan = condition_plan(Geometry.of(smol[0]), MODS, 4, "text", "k")
    a = evaluate(smol[0], plan, prepared, progress=False)
    b = evaluate(smol[0], plan, prepared, progress=False)
    assert a == b
    assert a["quantized_tokens"]["k"]["text"] > 0 and "v" not in a["quantized_tokens"]


def test_eval_settings_default_to_the_plans_search_on_the_same_task_only():
    """kvplan eval measured every plan at seed 0 and 512 + 32 tokens: a plan searched with --seed 3 or
    --history-tokens 256 read another split, or other lengths, than its own metrics.test."""
    from kvplan.evaluation.runs import eval_settings

    plan = uniform_plan(Geometry(2, 2, 64, ("full", "full"), "llama"), 4, modalities=MODS)
    searched = plan.replace(metrics={"search": {"seed": 3, "task": {"name": "default", "history_tokens": 256,
                                                                    "eval_tokens": 16}}})
    assert eval_settings(searched, "default", None, None, None) == (
        {"seed": 3, "history_tokens": 256, "eval_tokens": 16}, ["seed", "history_tokens", "eval_tokens"])
    assert eval_settings(searched, "default", 1, 128, None) == (
        {"seed": 1, "history_tokens": 128, "eval_tokens": 16}, ["eval_tokens"])
    plain = {"seed": 0, "history_tokens": 512, "eval_tokens": 32}
    assert eval_settings(searched, "mine.jsonl", None, None, None) == (plain, [])  # searched on another task
    assert eval_settings(plan, "default", None, None, None) == (plain, [])  # no search recorded
    assert eval_settings(None, "default", None, None, None) == (plain, [])  # a baseline


def test_eval_measures_as_many_samples_as_the_plans_search_did():
    """A plan searched with --test-samples 2 recorded metrics.test on 2 samples, and `kvplan eval plan.yaml` (said
    to re-measure metrics.test) measured 16: KL 0.0415 against the recorded 0.0653 (0.0653 with --samples 2)."""
    from kvplan.evaluation.runs import eval_sample_count

    plan = uniform_plan(Geometry(2, 2, 64, ("full", "full"), "llama"), 4, modalities=MODS)
    searched = plan.replace(metrics={"search": {"seed": 0, "task": {"name": "default"}},
                                     "test": {"kl": 0.06, "n_samples": 2.0}, "validation": {"n_samples": 3}})
    assert eval_sample_count(searched, "default", "test", None) == (2, True)
    assert eval_sample_count(searched, "default", "heldout", None) == (2, True)  # the test split's old name
    assert eval_sample_count(searched, "default", "validation", None) == (3, True)
    assert eval_sample_count(searched, "default", "test", 5) == (5, False)  # given wins
    assert eval_sample_count(searched, "mine.jsonl", "test", None) == (None, False)  # another task: every record
    jsonl = searched.replace(metrics={**searched.metrics, "search": {"task": {"name": "mine.jsonl"}}})
    assert eval_sample_count(jsonl, "mine.jsonl", "test", None) == (2, True)
    assert eval_sample_count(jsonl, "mine.jsonl", "all", None) == (None, False)  # every record of the task
    assert eval_sample_count(plan, "default", "test", None) == (16, False)  # no search recorded
    assert eval_sample_count(None, "default", "test", None) == (16, False)  # a baseline
    odd = searched.replace(metrics={**searched.metrics, "test": {"n_samples": 2.5}})
    assert eval_sample_count(odd, "default", "test", None) == (16, False)


def test_eval_headguard_says_before_its_head_profile_that_its_histories_commit_nothing(monkeypatch):
    """`kvplan eval headguard --history-tokens 128` ran its 180-evaluation head profile (2.5 min here) before the
    harness found that 128-token histories commit no token under its group 32 + residual 128; a baseline such as
    k4v2-g64 failed at once. The quantizer does not depend on the protected heads, so it is said first."""
    import kvplan.evaluation.runs as runs
    from kvplan.evaluation.harness import Sample, check_commits_any

    def no_profile(*a, **k):
        raise AssertionError("the head profile ran")

    monkeypatch.setattr(runs, "head_sensitivity", no_profile)
    with pytest.raises(ProtocolError, match="headguard: condition meant to quantize keys of modality 'text' would "
                                            "quantize zero of its tokens: histories of 128 tokens commit none at "
                                            "group_size 32 \\+ residual_length 128"):
        runs.run_eval("headguard", samples=1, history_tokens=128, progress=False, verbose=False)
    plan = uniform_plan(Geometry(2, 2, 64, ("full", "full"), "llama"), 2, group_size=32, residual_length=128)
    short = Sample(list(range(159)), ["text"] * 159, [1, 2])
    with pytest.raises(ProtocolError, match="histories of 159 tokens commit none"):
        check_commits_any(plan, [short])
    check_commits_any(plan, [short, Sample(list(range(160)), ["text"] * 160, [1, 2])])  # 32 committed
