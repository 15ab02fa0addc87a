"""kvplan.explain on a searched plan (with trial history) and on a bare plan file."""

import json
import os
import shutil

import pytest

from kvplan.explain import explain
from kvplan.plans import uniform_plan
from kvplan.search import search
from tests.search.synthetic import GEOM, MODS, REF, SyntheticScorer


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    d = tmp_path_factory.mktemp("ex")
    out = d / "plan.yaml"
    search(budget="3.0bpv", n_trials=20, scorer=SyntheticScorer(), heldout_scorer=SyntheticScorer(), out=out,
           progress=False, n_candidates=6, n_local=10)
    return out


def test_text_report_with_history(searched, tmp_path):
    txt = explain(searched, out_dir=tmp_path / "figs")
    for needle in ("honest bpv", "memory", "32768 tokens", "allocation: mean bits K", "modality doc",
                   "measured on heldout: KL", "consensus importance", "K vs V", "Pareto front", "figures:"):
        assert needle in txt, needle
    assert "missing" not in txt
    for f in ("allocation.png", "pareto.png", "importance.png"):
        assert os.path.getsize(tmp_path / "figs" / f) > 1000


def test_json_report(searched):
    rep = json.loads(explain(searched, format="json"))
    assert rep["budget"]["bpv"]["total"] <= 3.0 + 1e-9
    imp = rep["importance"]
    assert sum(imp["kind"].values()) + sum(imp["quantizer"].values()) == pytest.approx(100.0, abs=1e-6)
    assert imp["kind"]["k"] > imp["kind"]["v"]  # the synthetic task makes keys ~8x more sensitive
    assert rep["missing"] == []


def test_plan_file_alone_says_what_is_missing(searched, tmp_path):
    bare = tmp_path / "bare.yaml"
    shutil.copy(searched, bare)
    txt = explain(bare, out_dir=tmp_path / "f2")
    assert "missing: trial history" in txt and "bare.trials.csv" in txt
    assert "measured on heldout" in txt
    assert os.path.exists(tmp_path / "f2" / "allocation.png")
    assert not os.path.exists(tmp_path / "f2" / "pareto.png")
    base = tmp_path / "int4.yaml"
    uniform_plan(GEOM, 4, 2, modalities=MODS, reference=REF).to_yaml(base)
    txt = explain(base)
    assert "missing: measured metrics" in txt and "protected heads: none" in txt


def test_bad_format(searched):
    with pytest.raises(Exception, match="format"):
        explain(searched, format="xml")
