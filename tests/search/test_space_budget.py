"""Search space <-> tables, honest-bpv model, budget parsing, repair and the knapsack seed."""

import dataclasses
import warnings

import numpy as np
import pytest
from optuna.distributions import CategoricalDistribution, IntDistribution

from kvplan.models import Geometry
from kvplan.plans import Plan, QuantizerSettings, Reference
from kvplan.search import (
    BpvModel,
    BudgetError,
    SearchSpace,
    group_damage,
    knapsack_seed,
    parse_budget,
    repair,
)
from tests.search.synthetic import GEOM, MODS, REF


@pytest.mark.parametrize("granularity,n_groups", [("slot", 6 * 2 * 2 * 2), ("layer_kv", 12), ("layer", 6),
                                                   ("kvtuner", 6)])
def test_space_groups_and_roundtrip(granularity, n_groups):
    sp = SearchSpace(GEOM, MODS, granularity)
    assert len(sp.groups) == n_groups
    dists = sp.distributions()
    assert all(isinstance(dists[g.name], IntDistribution) for g in sp.groups)  # ordinal bit levels
    assert isinstance(dists["q.group_size"], CategoricalDistribution)
    assert "q.key_axis" not in dists  # one choice: fixed
    rng = np.random.default_rng(0)
    for _ in range(5):
        lv = np.array([rng.integers(g.n_levels) for g in sp.groups])
        table = sp.table_of_levels(lv)
        assert table.shape == (6, 2, 2, 2)
        assert np.array_equal(sp.levels_of_table(table), lv)
        q = sp.quantizers()[int(rng.integers(len(sp.quantizers())))]
        params = sp.params_of(lv, q)
        assert sp.quantizer_of(params) == q
        assert np.array_equal(sp.table_of(params), table)


def test_level_order_is_bit_order():
    sp = SearchSpace(GEOM, MODS, "slot", bits=(16, 2, 8, 4, 3))
    assert sp.bits == (2, 3, 4, 8, 16)
    assert list(sp.groups[0].level_bits[:, 0]) == [2, 3, 4, 8, 16]
    kv = SearchSpace(GEOM, MODS, "kvtuner")
    costs = [k + v for k, v in kv.pairs]
    assert costs == sorted(costs)


def test_coarse_space_cannot_express_mixed_heads():
    sp = SearchSpace(GEOM, MODS, "layer_kv")
    t = sp.table_of_levels(np.zeros(len(sp.groups), dtype=int))
    t[0, 0, 0, 0] = 8
    assert sp.levels_of_table(t) is None


@pytest.mark.parametrize("text,value", [("2.5bpv", 2.5), ("2.5", 2.5), (" 3 bpv", 3.0), (2.5, 2.5), (4, 4.0),
                                        ("2.5BPV", 2.5)])
def test_parse_budget(text, value):
    assert parse_budget(text) == value


@pytest.mark.parametrize("bad", ["abc", "-1", "0bpv", "", None, True, "2.5 bytes"])
def test_parse_budget_rejects(bad):
    with pytest.raises(BudgetError):
        parse_budget(bad)


FORMAT_SPACES = {"v1": {}, "formats": {"key_scaling": "minmax-e4m3", "value_scaling": "absmax-e4m3",
                                       "codebooks": ("k", "v")},
                 "residual8": {"residual_bits": 8}, "residual4": {"residual_bits": 4},
                 # copies of the newest committed tokens: fewer than, as many as and more than the
                 # committed tokens after a sink (the reference commits 384 or 256 of 512)
                 "recent": {"residual_bits": 8, "recent_lengths": (0, 5, 300, 600)},
                 # sink positions as 8-bit per-token codes (quantizer.sink_bits)
                 "sink8": {"sink_bits": 8},
                 # heavy-hitter copies per KV head of full layers: fewer and more than the committed tokens
                 "heavy": {"residual_bits": 8, "heavy_length": 7}, "heavy600": {"heavy_length": 600}}


@pytest.mark.parametrize("formats", list(FORMAT_SPACES))
@pytest.mark.parametrize("granularity", ["slot", "layer_kv", "kvtuner"])
def test_bpv_model_equals_accounting(granularity, formats):
    # sink lengths inside the first group, across a group and across the text/doc boundary (64)
    sp = SearchSpace(GEOM, MODS, granularity, key_axes=("channel", "token"), sink_lengths=(0, 3, 70),
                     **FORMAT_SPACES[formats])
    if formats == "recent":
        assert {q.recent_length for q in sp.quantizers()} == {0, 5, 300, 600}
    if formats.startswith("residual"):  # the residual (up to 128 + 127 tokens at this reference) is coded
        assert all(q.residual_bits == FORMAT_SPACES[formats]["residual_bits"] for q in sp.quantizers())
        plain = BpvModel(SearchSpace(GEOM, MODS, granularity, key_axes=("channel", "token"),
                                     sink_lengths=(0, 3, 70)), REF)
        q = next(q for q in sp.quantizers() if q.residual_length == 128)
        assert BpvModel(sp, REF).floor(q) < plain.floor(dataclasses.replace(q, residual_bits=16))
    elif formats == "sink8":
        assert all(q.sink_bits == 8 for q in sp.quantizers())
    elif formats.startswith("heavy"):
        assert all(q.heavy_length == FORMAT_SPACES[formats]["heavy_length"] for q in sp.quantizers())
    elif formats not in ("v1", "recent"):  # every quantizer of the space carries its formats and group-length codebooks
        assert all(q.value_scaling == "absmax-e4m3" and len(q.codebooks) == 6 for q in sp.quantizers())
        assert all(sp.contains_quantizer(q) for q in sp.quantizers())
    model = BpvModel(sp, REF)
    rng = np.random.default_rng(1)
    for q in sp.quantizers():
        lv = np.array([rng.integers(g.n_levels) for g in sp.groups])
        plan = Plan.from_table(sp.table_of_levels(lv), GEOM, MODS, quantizer=q, reference=REF)
        assert model.bpv(lv, q) == pytest.approx(plan.bpv().total, abs=1e-9)
        assert model.floor(q) == pytest.approx(
            Plan.from_table(sp.table_of_levels(np.zeros_like(lv)), GEOM, MODS, quantizer=q,
                            reference=REF).bpv().total, abs=1e-9)


def test_infeasible_budget_names_cheapest():
    sp = SearchSpace(GEOM, MODS, "slot")
    model = BpvModel(sp, REF)
    lo, q = model.cheapest()
    # 2-bit codes + g128 K scales (+ one split group at the text/doc boundary) + 64-wide V groups, no residual
    assert 2.375 <= lo < 2.4 and q.group_size == 128 and q.residual_length == 0
    with pytest.raises(BudgetError, match=f"{lo:.4f} bpv"):
        model.check_budget(2.0)
    model.check_budget(lo)


def test_a_budget_every_plan_fits_is_warned_about():
    sp = SearchSpace(GEOM, MODS, "slot")
    model = BpvModel(sp, REF)
    top = np.array([g.n_levels - 1 for g in sp.groups])
    hi = max(model.bpv(top, q) for q in model.feasible_quantizers(float("inf")))
    assert model.dearest() == pytest.approx(hi, abs=1e-9) == 16.0  # every slot at 16 bits, nothing else stored
    with pytest.warns(UserWarning, match=f"budget 100 bpv is at or above the dearest plan .*{hi:.4f} bpv"):
        model.warn_if_unconstrained(100.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.warn_if_unconstrained(hi - 0.01)


def test_a_streaming_search_at_a_real_budget_is_not_warned_about():
    """The budget check weighs the space with every streamable head streamed (the cheapest plan): its
    dearest plan is not the search's, so a 2.5 bpv budget is no cause for the every-plan-fits warning."""
    from kvplan.search import check_budgets

    geometry = Geometry(30, 3, 64, ("full",) * 30, "llama")
    fixed = dict(group_sizes=(128,), residual_lengths=(0,), sink_lengths=(1,), recent_lengths=(0,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_budgets("2.5bpv", geometry, Reference(512), **fixed)
    with pytest.warns(UserWarning, match="budget 40 bpv is at or above the dearest plan"):
        check_budgets("40bpv", geometry, Reference(512), **fixed)


def test_repair_reaches_budget_and_keeps_feasible():
    sp = SearchSpace(GEOM, MODS, "slot")
    model = BpvModel(sp, REF)
    dmg = group_damage(sp, None)
    top = np.array([g.n_levels - 1 for g in sp.groups])
    q = QuantizerSettings(group_size=32, residual_length=128)  # floor above 2.6 at context 1024
    assert model.floor(q) > 2.6
    lv, q2, changed = repair(model, top, q, 2.6, dmg)
    assert changed and model.bpv(lv, q2) <= 2.6 + 1e-9 and model.floor(q2) <= 2.6
    # an already feasible proposal is untouched
    lv3, q3, changed3 = repair(model, lv, q2, 2.6, dmg)
    assert not changed3 and q3 == q2 and np.array_equal(lv3, lv)


def test_repair_lowers_least_sensitive_first():
    sp = SearchSpace(GEOM, MODS, "layer_kv")
    model = BpvModel(sp, REF)
    sens = np.ones(int(np.prod(sp.shape)))
    t = np.zeros(sp.shape)
    t[0, :, 0, :] = 1000.0  # layer 0 keys very sensitive
    sens = sens + t.ravel()
    dmg = group_damage(sp, sens)
    top = np.full(len(sp.groups), 3)  # all 8 bits
    q = QuantizerSettings(group_size=128, residual_length=0)
    lv, _, _ = repair(model, top, q, 3.2, dmg)
    names = [g.name for g in sp.groups]
    assert lv[names.index("L00.k")] == lv.max()  # the sensitive group keeps the most bits


def test_knapsack_seed_feasible_and_beats_uniform():
    sp = SearchSpace(GEOM, MODS, "slot")
    model = BpvModel(sp, REF)
    rng = np.random.default_rng(0)
    sens = rng.lognormal(0, 1.5, size=int(np.prod(sp.shape)))
    dmg = group_damage(sp, sens)
    q = QuantizerSettings(group_size=128, residual_length=0)
    lv = knapsack_seed(model, q, 3.0, dmg)
    assert model.bpv(lv, q) <= 3.0 + 1e-9
    uni = np.zeros(len(sp.groups), dtype=int)  # all 2-bit fits; 3-bit does not at g128? check damage only
    idx = np.arange(len(lv))
    assert dmg[idx, lv].sum() < dmg[idx, uni].sum()


def test_head_profile_finds_hot_heads_and_improves_the_seed():
    """The per-head profile stage measures the heads of the worst (layer, kind) units, the
    prior concentrates on the hot head, and the knapsack seed built on it scores better."""
    from kvplan.search import run_profile, slot_sensitivity
    from tests.search.synthetic import SyntheticScorer

    sp = SearchSpace(GEOM, MODS, "slot")
    sc = SyntheticScorer(seed=3)
    coarse = run_profile(sc, sp, REF, n_head_units=0)
    fine = run_profile(sc, sp, REF, n_head_units=4)
    assert set(coarse) < set(fine) and len(fine) - len(coarse) == 4 * GEOM.num_kv_heads
    worst = sorted((v, n) for n, v in coarse.items() if n.startswith("L"))[-4:]
    assert {f"{n}.h{h}" for _, n in worst for h in range(2)} == set(fine) - set(coarse)
    # the head split follows the scorer's own weights of that unit (sum over modalities)
    _, name = worst[-1]
    layer, kind = int(name[1:3]), "kv".index(name[-1])
    truth = sc.w[layer, :, kind].sum(axis=-1)
    measured = np.array([fine[f"{name}.h{h}"] for h in range(2)])
    assert np.argmax(measured) == np.argmax(truth)
    s = slot_sensitivity(sp, fine).reshape(sp.shape)
    assert s[layer, :, kind].sum() == pytest.approx(coarse[name] * 1.0, rel=1e-9)  # the layer total is kept
    assert np.argmax(s[layer, :, kind].sum(axis=-1)) == np.argmax(truth)

    model = BpvModel(sp, REF)
    q = QuantizerSettings(group_size=128, residual_length=0)
    kl = {}
    for label, prof in (("coarse", coarse), ("fine", fine)):
        lv = knapsack_seed(model, q, 2.6, group_damage(sp, slot_sensitivity(sp, prof)))
        assert model.bpv(lv, q) <= 2.6 + 1e-9
        kl[label] = sc(sp.plan_of(sp.params_of(lv, q), REF))["kl"]
    assert kl["fine"] < kl["coarse"]


def test_head_profile_default_measures_every_unit_and_counts_its_progress():
    """The default (``None``) measures every head of every (layer, kind) unit; a count above the
    number of units is capped; the progress total is the number of evaluations actually made."""
    from kvplan.search import run_profile
    from tests.search.synthetic import SyntheticScorer

    sp = SearchSpace(GEOM, MODS, "slot")
    coarse = run_profile(SyntheticScorer(), sp, REF, n_head_units=0)
    totals = []
    every = run_profile(SyntheticScorer(), sp, REF, progress=lambda done, total: totals.append((done, total)))
    n_heads = 2 * GEOM.num_layers * GEOM.num_kv_heads
    assert len(every) - len(coarse) == n_heads
    assert {f"L{l:02d}.{k}.h{h}" for l in range(GEOM.num_layers) for k in "kv"
            for h in range(GEOM.num_kv_heads)} == set(every) - set(coarse)
    assert totals[-1] == (len(every), len(every)) and {t for _, t in totals} == {len(every)}
    capped = run_profile(SyntheticScorer(), sp, REF, n_head_units=10 * GEOM.num_layers)
    assert capped == every


def test_head_profile_only_where_heads_are_searched():
    from kvplan.search import run_profile
    from tests.search.synthetic import SyntheticScorer

    sp = SearchSpace(GEOM, MODS, "layer_kv")
    prof = run_profile(SyntheticScorer(), sp, REF, n_head_units=4)
    assert not any(".h" in n for n in prof)


def test_the_profile_measures_a_quantizer_of_the_space_with_its_codebooks():
    """The profile's plans carried no Lloyd-Max codebooks while every searched plan's values had them: the
    value damages it measured were another codec's (2x to 4x the searched codec's on some layers of the
    default model), and they shape the seeds, the surrogate's prior and the streamed heads."""
    from kvplan.search.space import DEFAULT_FORMATS
    from kvplan.search.sensitivity import profile_quantizer

    space = SearchSpace(GEOM, MODS, "slot", group_sizes=(32, 128), **DEFAULT_FORMATS)
    q = profile_quantizer(space)
    assert q.codebooks and {kind for kind, _, _ in q.codebooks} == set(DEFAULT_FORMATS["codebooks"])
    assert space.contains_quantizer(q)
