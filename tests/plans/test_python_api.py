"""Plans built and edited in Python: what a plan file may not hold is refused when the plan is built (or, for
a file that would not read back, when it is written), with the file reader's words, never written and then
refused on load; the helpers do not truncate fractional bits or wrap negative indices."""

import numpy as np
import pytest

from kvplan import Geometry, Plan, uniform_plan
from kvplan.errors import PlanError
from kvplan.plans import Provenance, headguard_plan, layerwise_plan

G = Geometry(2, 2, 16, ("full", "full"), "llama")


@pytest.mark.parametrize("build,says", [
    (lambda: uniform_plan(G, 4, 2).replace(name=5), "name: must be a non-empty string"),
    (lambda: uniform_plan(G, 4, 2).replace(name=""), "name: must be a non-empty string"),
    (lambda: uniform_plan(Geometry(2, 2, 16, ("full", "full"), 5), 4), "model.model_type: must be a non-empty"),
    (lambda: uniform_plan(Geometry(2, 2, 16, ("full", "full"), ""), 4), "model.model_type: must be a non-empty"),
    (lambda: uniform_plan(G, 4, 2).replace(provenance=Provenance(seed="x")), "provenance.seed: must be an integer"),
    (lambda: uniform_plan(G, 4, 2).replace(provenance=Provenance(produced_by=3)), "provenance.produced_by: must be a"),
    (lambda: uniform_plan(G, 4, 2).replace(provenance=Provenance(data_hash=3)), "provenance.data_hash: must be a"),
    (lambda: uniform_plan(G, 4, 2).replace(provenance={"seed": 1}), "provenance: must be a kvplan.plans.Provenance"),
])
def test_what_a_plan_file_may_not_hold_is_refused_when_the_plan_is_built(build, says):
    """These were accepted, written by to_yaml, and refused only when the file was read back."""
    with pytest.raises(PlanError, match=says):
        build()


def test_a_plan_whose_file_would_not_read_back_is_not_written(tmp_path):
    """Sliding layers without their window (a Geometry built without one, or a version-1 file's plan): the
    file was written, and reading it said the window was missing."""
    plan = uniform_plan(Geometry(2, 2, 16, ("sliding", "full"), "mistral"), 4)
    with pytest.raises(PlanError, match="model.sliding_window: missing: .*give the Geometry its sliding_window"):
        plan.to_yaml(tmp_path / "p.yaml")
    assert not (tmp_path / "p.yaml").exists()
    windowed = uniform_plan(Geometry(2, 2, 16, ("sliding", "full"), "mistral", 64), 4)
    assert Plan.from_yaml(windowed.to_yaml(tmp_path / "w.yaml")) == windowed


@pytest.mark.parametrize("build", [
    lambda: uniform_plan(G, 2.9),
    lambda: uniform_plan(G, 4, 2.5),
    lambda: layerwise_plan(G, [(4.9, 2.2), (8, 8)]),
    lambda: headguard_plan(G, [(0, 0)], protected_key_bits=8.6),
    lambda: Plan.from_table(np.full((2, 2, 2, 1), 3.99), G),
    lambda: uniform_plan(G, 4).with_table(np.full((2, 2, 2, 1), np.nan)),
])
def test_fractional_bits_are_refused_not_truncated(build):
    """uniform_plan(g, 2.9) made a 2-bit plan, Plan.from_table(3.99...) a 3-bit one, without a word."""
    with pytest.raises(PlanError, match="bits: per-slot bits must be whole numbers"):
        build()


def test_whole_bits_given_as_floats_or_numpy_integers_still_build():
    assert uniform_plan(G, 4.0, np.int64(2)).table()[0, 0].ravel().tolist() == [4, 2]
    assert Plan.from_table(np.full((2, 2, 2, 1), 3.0), G).default_bits == 3


@pytest.mark.parametrize("protected,modality,says", [
    ([(5, 0)], None, r"protected\[0\] layer: must be in \[0, 1\]"),
    ([(0, -1)], None, r"protected\[0\] KV head: must be in \[0, 1\]"),
    ([(0,)], None, r"protected\[0\]: must be a \(layer, KV head\) pair"),
    ([(0, 0)], "visual", r"protected_modality: must be one of the plan's modalities \['text'\]"),
])
def test_headguard_plan_names_a_protected_head_or_modality_it_cannot_have(protected, modality, says):
    """``[(5, 0)]`` was an IndexError, ``[(0, -1)]`` silently protected head 1, an absent modality a ValueError
    from tuple.index."""
    with pytest.raises(PlanError, match=says):
        headguard_plan(G, protected, protected_modality=modality)
    assert headguard_plan(G, [(np.int64(1), np.int64(0))]).slot_bits(1, 0, "k", "text") == 16


def test_slot_bits_refuses_an_index_the_plan_does_not_have():
    plan = uniform_plan(G, 4, 2)
    assert plan.slot_bits(1, 1, "v", "text") == 2
    for args, says in (((-1, 0, "k", "text"), "layer: must be in"), ((0, 2, "k", "text"), "head: must be in"),
                       ((0, 0, "q", "text"), "kind: must be one of"), ((0, 0, "k", "visual"), "modality: must be")):
        with pytest.raises(PlanError, match=says):
            plan.slot_bits(*args)


def test_bpv_given_a_length_where_the_geometry_goes_says_how_to_ask_for_a_length():
    """``plan.bpv(768)`` (the README's shorthand) failed with "'int' object has no attribute 'num_layers'"."""
    plan = uniform_plan(G, 4, 2)
    with pytest.raises(PlanError, match=r"geometry: must be a kvplan.Geometry \(a context length is "
                                        r"plan.bpv\(context_len=N\)\)"):
        plan.bpv(768)
    assert plan.bpv(G, 768) == plan.bpv(context_len=768)


def test_plans_hash_and_equal_plans_hash_alike():
    """The generated __hash__ hashed the metrics dict: hash(plan) and {plan} always raised."""
    a, b = uniform_plan(G, 4, 2), uniform_plan(G, 4, 2)
    assert a == b and hash(a) == hash(b) and len({a, b, uniform_plan(G, 4, 4)}) == 2
    with_metrics = a.replace(metrics={"test": {"kl": 0.1}})
    assert hash(with_metrics) == hash(with_metrics.replace())


def test_a_plan_files_provenance_reads_back_as_written(tmp_path):
    """Provenance checks its own fields now; the reader still passes every one of them through."""
    prov = Provenance(kvplan_version="0.0.1", produced_by="search", seed=7, data_hash="sha256:abc")
    plan = uniform_plan(G, 4, 2).replace(provenance=prov)
    assert Plan.from_yaml(plan.to_yaml(tmp_path / "p.yaml")).provenance == prov
