"""Search with the key correction: the space's corrected level, exact bpv, profile, export."""

import json

import numpy as np
import pytest

from kvplan import Geometry, KVPlanError, Plan
from kvplan.explain import explain
from kvplan.plans import CORRECTED
from kvplan.search import BpvModel, SearchSpace, query_basis, search
from tests.search.synthetic import MODS, REF, SyntheticScorer
from tests.tiny_models import tiny_llama

FAST = dict(n_candidates=6, n_local=10, progress=False)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(num_layers=6, num_kv_heads=2, head_dim=64)


def test_query_basis_is_orthonormal_and_reproducible(model):
    ids = [list(range(5, 40)), list(range(50, 90))]
    U = query_basis(model, ids, 4)
    assert U.shape == (6, 2, 64, 4) and U.dtype == np.float32
    gram = np.einsum("lhdr,lhds->lhrs", U, U)
    np.testing.assert_allclose(gram, np.broadcast_to(np.eye(4), gram.shape), atol=1e-5)
    np.testing.assert_array_equal(U, query_basis(model, ids, 4))
    with pytest.raises(KVPlanError, match="rank 65"):
        query_basis(model, ids, 65)


@pytest.mark.skipif("fork" not in __import__("multiprocessing").get_all_start_methods(), reason="needs fork")
def test_query_moments_in_processes_are_the_serial_sums(model):
    from kvplan.search.key_basis import query_second_moments

    ids = [list(range(5, 40)), list(range(50, 90)), list(range(7, 70, 2))]
    serial = query_second_moments(model, ids)
    assert serial.shape == (6, 2, 64, 64) and np.abs(serial).sum() > 0
    np.testing.assert_array_equal(query_second_moments(model, ids, processes=2), serial)
    np.testing.assert_array_equal(query_second_moments(model, ids, processes=3), serial)


def test_space_offers_the_corrected_level_on_keys_only_and_bpv_is_exact(model):
    g = Geometry.of(model)
    basis = np.linalg.qr(np.random.default_rng(0).standard_normal((6, 2, 64, 64)))[0][..., :4]
    space = SearchSpace(g, MODS, "slot", key_basis=basis)
    kinds = {grp.name.split(".")[2]: grp.level_bits[:, 0].tolist() for grp in space.groups}
    assert kinds == {"k": [2, 2 + CORRECTED, 3, 4, 8, 16], "v": [2, 3, 4, 8, 16]}
    bm = BpvModel(space, REF)
    rng = np.random.default_rng(1)
    for q in space.quantizers()[:6]:
        assert q.key_correction_rank == 4
        levels = np.array([rng.integers(0, grp.n_levels) for grp in space.groups])
        params = space.params_of(levels, q)
        plan = space.plan_of(params, REF)
        assert plan.key_basis is not None and plan.correction_table().any()
        assert bm.bpv(levels, q) == pytest.approx(plan.bpv().total, abs=1e-12)
        assert Plan.from_yaml(plan.to_yaml()) == plan
    # the corrected level costs more than 2 bits and less than 3
    t = bm.terms(space.quantizers()[0])
    k0 = [i for i, grp in enumerate(space.groups) if grp.name.endswith(".k.doc")][0]
    assert t.group_cost[k0, 0] < t.group_cost[k0, 1] < t.group_cost[k0, 2]


class CorrectionScorer(SyntheticScorer):
    """The synthetic scorer (corrected key slots do 5x less damage) with a model and calibration
    sequences, so the search can learn query bases."""

    def __init__(self, model, **kw):
        super().__init__(**kw)
        self.model = model

    def calibration_sequences(self):
        return [list(range(3 + i, 70 + i)) for i in range(2)]


def test_search_uses_and_exports_the_correction(model, tmp_path):
    sc = CorrectionScorer(model)
    out = tmp_path / "plan.yaml"
    r = search(budget="2.6bpv", n_trials=16, seed=0, scorer=sc, out=out, key_correction_rank=4, **FAST)
    plan = Plan.from_yaml(out)
    assert plan.quantizer.key_correction_rank == 4 and plan.key_basis.shape == (6, 2, 64, 4)
    assert plan.bpv().total <= 2.6 + 1e-9
    assert {"keys", "keys+correction"} <= set(r.profile)
    assert plan.correction_table().any()
    assert plan.bpv().correction > 0
    # explain reads the trial history, whose bit columns hold format codes (2 + CORRECTED = 102)
    txt = explain(out)
    for needle in ("key correction: key slots marked", "+ key correction", "key correction on", "pre-RoPE frame",
                   "consensus importance"):
        assert needle in txt, needle
    rep = json.loads(explain(out, format="json"))
    assert len(rep["allocation"]["corrected_keys"]) == int(plan.correction_table().sum())


def test_correction_needs_a_scorer_with_the_model():
    with pytest.raises(KVPlanError, match="key_correction_rank=0"):
        search(budget="2.6bpv", n_trials=4, scorer=SyntheticScorer(), out=None, key_correction_rank=4, **FAST)


def test_default_rank_follows_the_scorer(model):
    from kvplan.search import DEFAULT_KEY_CORRECTION_RANK

    with_queries = search(budget="2.6bpv", n_trials=3, scorer=CorrectionScorer(model), out=None, profile=False,
                          **FAST)
    assert with_queries.plan.quantizer.key_correction_rank == DEFAULT_KEY_CORRECTION_RANK > 0
    without = search(budget="2.6bpv", n_trials=3, scorer=SyntheticScorer(), out=None, profile=False, **FAST)
    assert without.plan.quantizer.key_correction_rank == 0 and without.plan.key_basis is None


class RecordingScorer(CorrectionScorer):
    def __init__(self, model, **kw):
        super().__init__(model, **kw)
        self.scored = []

    def __call__(self, plan):
        self.scored.append(plan)
        return super().__call__(plan)


def test_rotations_follow_the_model_and_can_be_turned_off(model):
    from kvplan.models import rope_inv_freq

    sc = RecordingScorer(model)
    on = search(budget="2.6bpv", n_trials=3, scorer=sc, out=None, profile_head_units=2, **FAST)
    assert on.plan.quantizer.rotation == "hadamard" and on.plan.quantizer.key_pre_rope
    assert on.plan.rope_inv_freq == rope_inv_freq(model)
    # every plan scored, the sensitivity profile's included, uses the codec the plans will use
    assert len(sc.scored) == on.n_profile_evals + on.n_real_evals > on.n_real_evals
    assert all(p.quantizer.rotation == "hadamard" and p.quantizer.key_pre_rope for p in sc.scored)
    off = search(budget="2.6bpv", n_trials=3, scorer=CorrectionScorer(model), out=None, profile=False,
                 rotation="none", key_pre_rope=False, **FAST)
    assert off.plan.quantizer.rotation == "none" and not off.plan.quantizer.key_pre_rope
    assert off.plan.rope_inv_freq is None
    # a scorer without a model: Hadamard still (head_dim 64), no pre-RoPE frame, asked for it fails
    plain = search(budget="2.6bpv", n_trials=3, scorer=SyntheticScorer(), out=None, profile=False, **FAST)
    assert plain.plan.quantizer.rotation == "hadamard" and not plain.plan.quantizer.key_pre_rope
    with pytest.raises(KVPlanError, match="key_pre_rope=False"):
        search(budget="2.6bpv", n_trials=3, scorer=SyntheticScorer(), out=None, profile=False, key_pre_rope=True,
               **FAST)


def test_hadamard_on_a_non_power_of_two_head_dim_fails_at_once():
    g = Geometry(2, 2, 48, ("full",) * 2, "llama")
    with pytest.raises(KVPlanError, match="power-of-two head_dim; this model's is 48"):
        SearchSpace(g, MODS, "slot", rotation="hadamard")
    assert SearchSpace(g, MODS, "slot").fixed_fields["rotation"] == "none"


def test_error_feedback_metric_is_learned_exported_and_can_be_turned_off(model, tmp_path):
    """Default with a model: every scored plan (profile included) and the export carry the metric learned
    from the calibration queries and o_proj; explain says so; error_feedback=False carries none; a scorer
    without a model cannot learn one."""
    from kvplan.runtime.cache import plan_rotations
    from kvplan.search.feedback_metric import feedback_metric, output_projections
    from kvplan.search.key_basis import query_second_moments

    sc = RecordingScorer(model)
    out = tmp_path / "plan.yaml"
    on = search(budget="2.6bpv", n_trials=3, scorer=sc, out=out, profile_head_units=0, **FAST)
    plan = Plan.from_yaml(out)
    assert plan.feedback_metric is not None and plan.feedback_metric == on.plan.feedback_metric
    q = plan.quantizer
    assert plan.feedback_metric.frame == {"rotation": q.rotation, "key_pre_rope": q.key_pre_rope}
    assert all(p.feedback_metric == plan.feedback_metric for p in sc.scored)
    want = feedback_metric(query_second_moments(model, sc.calibration_sequences()), output_projections(model, 6),
                           lambda layer: plan_rotations(plan, "cpu", layer), REF.context_len)
    np.testing.assert_array_equal(plan.feedback_metric.array, want.astype(np.float16))
    assert "error feedback: slot codes are chosen" in explain(out)
    assert json.loads(out.with_suffix(".search.json").read_text())["space"]["error_feedback"]["metric_sha256"]
    off = search(budget="2.6bpv", n_trials=3, scorer=CorrectionScorer(model), out=None, profile=False,
                 error_feedback=False, **FAST)
    assert off.plan.feedback_metric is None
    with pytest.raises(KVPlanError, match="error_feedback=False"):
        search(budget="2.6bpv", n_trials=3, scorer=SyntheticScorer(), out=None, profile=False, error_feedback=True,
               key_correction_rank=0, **FAST)
