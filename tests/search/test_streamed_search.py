"""search(stream_window=W): the profile measures each KV head streamed alone, the damage model picks the
streamed heads at the budget, and the search allocates the other slots."""

from dataclasses import replace

import numpy as np
import pytest

from kvplan import KVPlanError
from kvplan.search import search
from kvplan.plans import STREAMED, Reference
from kvplan.search.streaming import stream_key
from tests.search.synthetic import GEOM, SyntheticScorer

REF = Reference(512, (("text", 1.0),))


class StreamingScorer(SyntheticScorer):
    """The synthetic KL, plus ``stream_damage[l, h]`` for every streamed head (its slots read as exact)."""

    def __init__(self, cheap):
        super().__init__(modalities=("text",), reference=REF)
        self.stream_damage = np.full((GEOM.num_layers, GEOM.num_kv_heads), 5.0)  # most heads: far too costly
        for lh in cheap:
            self.stream_damage[lh] = 1e-6

    def __call__(self, plan):
        codes = plan.code_table()
        streamed = (codes == STREAMED)[:, :, 0, 0]
        out = super().__call__(plan.with_table(np.where(codes == STREAMED, 16, codes)))
        out["kl"] += float(self.stream_damage[streamed].sum())
        out["bpv"] = plan.bpv().total
        return out


def test_cheap_heads_are_streamed_and_the_rest_searched(tmp_path):
    cheap = [(1, 0), (4, 1)]
    scorer = StreamingScorer(cheap)
    # one quantizer setting (few seeds) and 24 trials: the forest screens candidates with the streamed
    # slots among its features
    fixed = dict(group_sizes=(128,), residual_lengths=(0,), sink_lengths=(1,), recent_lengths=(0,))
    result = search(budget="2.3", n_trials=24, scorer=scorer, stream_window=8, out=tmp_path / "plan.yaml",
                    progress=False, seed=0, **fixed)
    sources = {t.user_attrs.get("kvplan.source", "") for t in result.study.get_trials()}
    assert any("surrogate" in s for s in sources), sources
    plan = result.plan
    streamed = {tuple(int(i) for i in x) for x in np.argwhere((plan.code_table() == STREAMED)[:, :, 0, 0])}
    assert streamed == set(cheap)
    assert plan.quantizer.stream_window == 8 and plan.bpv().total <= 2.3 + 1e-9
    assert all(stream_key(l, h) in result.profile for l in range(GEOM.num_layers) for h in range(GEOM.num_kv_heads))
    # explain reads the trial history (streamed slots say 0) into its importance ranking
    from kvplan.explain import render_text, report

    rep = report(tmp_path / "plan.yaml")
    assert rep.get("importance"), "the trial history was not read"
    # the streaming damages were calibrated by two real evaluations, and explain says by how much
    scale = result.profile["streaming.scale"]
    assert f"streamed heads chosen with the streaming damages scaled by {scale:.3g}" in render_text(rep)
    # every real evaluation of the study kept the same heads streamed
    for t in result.study.get_trials():
        assert not any(name.startswith(("L01.H0", "L04.H1")) for name in t.params), t.params
    # the same search with streaming turned off streams nothing and reads worse under this scorer
    plain = search(budget="2.3", n_trials=24, scorer=StreamingScorer(cheap), stream_window=0, out=None,
                   progress=False, seed=0, **fixed)
    assert not (plain.plan.code_table() == STREAMED).any()
    assert scorer(plan)["kl"] < scorer(plain.plan)["kl"]


def test_streaming_is_on_by_default_where_the_search_can_stream():
    from kvplan.search.space import DEFAULT_STREAM_WINDOW

    fixed = dict(group_sizes=(128,), residual_lengths=(0,), sink_lengths=(1,), recent_lengths=(0,), progress=False)
    cheap = [(1, 0), (4, 1)]
    on = search(budget="2.3", n_trials=4, scorer=StreamingScorer(cheap), **fixed)
    assert on.plan.quantizer.stream_window == DEFAULT_STREAM_WINDOW > 0
    assert {tuple(int(i) for i in x) for x in np.argwhere((on.plan.code_table() == STREAMED)[:, :, 0, 0])} == set(cheap)
    # where it cannot stream, the default is off (no error): layer granularity, heavy copies, no profile
    for kw in (dict(granularity="layer"), dict(heavy_length=2), dict(profile=False)):
        off = search(budget="2.3", n_trials=4, scorer=StreamingScorer(cheap), **fixed, **kw)
        assert not (off.plan.code_table() == STREAMED).any() and off.plan.quantizer.stream_window == 0, kw
        assert not any(".stream.h" in k for k in (off.profile or {})), kw
    with pytest.raises(KVPlanError, match="stream_window: streamed heads are chosen from the sensitivity profile"):
        search(budget="2.3", n_trials=2, scorer=StreamingScorer(cheap), stream_window=8, profile=False, **fixed)


def test_stream_window_needs_slot_granularity_and_no_heavy_copies():
    with pytest.raises(KVPlanError, match="granularity 'slot'"):
        search(budget="2.3", n_trials=2, scorer=StreamingScorer([]), stream_window=8, granularity="layer",
               progress=False)
    with pytest.raises(KVPlanError, match="not supported together"):
        search(budget="2.3", n_trials=2, scorer=StreamingScorer([]), stream_window=8, heavy_length=2,
               progress=False)


def test_sliding_layers_stream_where_their_window_holds_the_copies():
    """A hybrid model (full, sliding with window 48): a space may fix streamed heads of the sliding layer
    when every quantizer setting keeps a streamed head's copies and the tokens not committed yet inside
    the window (32 + 0 + 4 + 8 <= 48), not when one setting does not (group 64); the streaming profile
    measures the full layer's heads only (validation chose it on Gemma-3-270M, bench/gemma3.md)."""
    from kvplan import Geometry
    from kvplan.search.space import SearchSpace
    from kvplan.search.streaming import streaming_plans

    hybrid = Geometry(2, 2, 64, ("full", "sliding"), "llama", 48)
    kw = dict(residual_lengths=(0,), sink_lengths=(1,), recent_lengths=(0, 4))
    fits = SearchSpace(hybrid, ("text",), "slot", group_sizes=(32,), **kw)
    assert fits.streamable_layers(8) == (0, 1) and fits.streamable_layers(13) == (0,)
    assert set(streaming_plans(fits, REF, 8)) == {stream_key(0, h) for h in (0, 1)}
    assert SearchSpace(hybrid, ("text",), "slot", group_sizes=(32,), streamed_heads=[(1, 0)], stream_window=8,
                       **kw).streamed_heads == ((1, 0),)
    too_long = SearchSpace(hybrid, ("text",), "slot", group_sizes=(32, 64), **kw)
    assert too_long.streamable_layers(8) == (0,)
    with pytest.raises(KVPlanError, match="layer 1 is a sliding layer of window 48"):
        SearchSpace(hybrid, ("text",), "slot", group_sizes=(32, 64), streamed_heads=[(1, 0)], stream_window=8, **kw)


class CompoundingScorer(StreamingScorer):
    """Each head streamed alone does half its slots' 2-bit damage; several streamed together do
    ``factor`` times the sum (an interaction the single-head profile cannot see)."""

    def __init__(self, factor):
        super().__init__([])
        self.factor = factor
        two_bits = 1e-3 * 2.0 * (self.w[:, :, 0, 0] + self.w[:, :, 1, 0])  # group 128: sqrt(128 / 32)
        self.stream_damage = 0.5 * two_bits

    def __call__(self, plan):
        codes = plan.code_table()
        streamed = (codes == STREAMED)[:, :, 0, 0]
        out = SyntheticScorer.__call__(self, plan.with_table(np.where(codes == STREAMED, 16, codes)))
        out["kl"] += float(self.stream_damage[streamed].sum()) * (self.factor if streamed.sum() > 1 else 1.0)
        return out


def test_calibration_scales_the_streaming_damage_by_two_real_evaluations():
    """calibrate_streaming scores the damage model's optimum in two parts (its quantized slots with the
    streamed heads at 16 bits, its streamed heads with every other slot at 16 bits) and scales the
    streaming damages by how far each part's prediction missed; where streamed heads compound, the
    calibrated model streams fewer heads and its optimum reads lower real KL."""
    from kvplan.search.sensitivity import run_profile
    from kvplan.search.space import SearchSpace
    from kvplan.search.streaming import (STREAM_PARTS_KEYS, STREAM_SCALE_KEY, calibrate_streaming, choose_streamed,
                                         run_streaming_profile, streaming_optimum)

    scorer = CompoundingScorer(factor=4.0)
    space = SearchSpace(GEOM, ("text",), "slot", group_sizes=(128,), residual_lengths=(0,), sink_lengths=(1,))
    profile = run_profile(scorer, space, REF)
    profile.update(run_streaming_profile(scorer, space, REF, 8))
    budget = 2.3
    plain = streaming_optimum(space, REF, profile, 8, budget)
    assert len(plain.heads) >= 2
    calls = scorer.calls
    cal = calibrate_streaming(scorer, space, REF, profile, 8, budget)
    assert scorer.calls == calls + 2
    streamed_part = cal[STREAM_PARTS_KEYS[1]]
    assert streamed_part == pytest.approx(4.0 * plain.streamed_damage)
    quantized = np.where(plain.table == STREAMED, 16, plain.table)
    assert cal[STREAM_PARTS_KEYS[0]] == pytest.approx(scorer(space.plan_of_table(quantized, plain.quantizer, REF))["kl"])
    want = (streamed_part / plain.streamed_damage) / (cal[STREAM_PARTS_KEYS[0]] / plain.quantized_damage)
    assert cal[STREAM_SCALE_KEY] == pytest.approx(want) and cal[STREAM_SCALE_KEY] > 1
    calibrated = streaming_optimum(space, REF, profile, 8, budget, cal[STREAM_SCALE_KEY])
    assert choose_streamed(space, REF, {**profile, **cal}, 8, budget) == calibrated.heads
    assert len(calibrated.heads) < len(plain.heads)

    def real(opt):
        return scorer(space.plan_of_table(opt.table, replace(opt.quantizer, stream_window=8), REF))["kl"]

    assert real(calibrated) < real(plain)
    # nothing to compare where the optimum streams no head
    assert calibrate_streaming(scorer, space, REF, {k: v for k, v in profile.items() if ".stream." not in k}, 8,
                               budget) == {}


class InterruptingStreamProfile(StreamingScorer):
    """Ctrl-C at the ``after``-th plan with a streamed head (the streaming profile's evaluations)."""

    def __init__(self, cheap, after):
        super().__init__(cheap)
        self.after, self.streamed_plans = after, 0

    def __call__(self, plan):
        if (plan.code_table() == STREAMED).any():
            self.streamed_plans += 1
            if self.streamed_plans > self.after:
                raise KeyboardInterrupt
        return super().__call__(plan)


def test_an_interrupted_streaming_profile_keeps_both_profiles_measurements(tmp_path):
    """The streaming profile after the sensitivity profile was measured whole again after an interruption,
    and the sensitivity profile with it (saved only when both were done)."""
    cheap = [(1, 0), (4, 1)]
    kw = dict(budget="2.3", n_trials=3, stream_window=8, progress=False, seed=0, keep_trials=True,
              group_sizes=(128,), residual_lengths=(0,), sink_lengths=(1,), recent_lengths=(0,))
    fresh = search(scorer=StreamingScorer(cheap), out=tmp_path / "a" / "plan.yaml", **kw)
    sensitivity = [k for k in fresh.profile if ".stream.h" not in k and not k.startswith("streaming.")]
    assert len(sensitivity) > 20
    with pytest.raises(KeyboardInterrupt):  # 8 of the 12 heads streamed alone measured
        search(scorer=InterruptingStreamProfile(cheap, after=8), out=tmp_path / "b" / "plan.yaml", **kw)
    resumed = search(scorer=StreamingScorer(cheap), out=tmp_path / "b" / "plan.yaml", **kw)
    assert resumed.n_profile_evals == fresh.n_profile_evals - len(sensitivity)  # none of those measured again
    assert resumed.profile == fresh.profile
