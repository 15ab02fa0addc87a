"""kvplan.explain on a searched plan (with trial history) and on a bare plan file."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from kvplan.errors import KVPlanError
from kvplan.explain import FIGURE_NAMES, ExplainError, explain, write_figures
from kvplan.explain._report import baseline_labels
from kvplan.explain._sidecars import TrialHistory
from kvplan.plans import Plan, uniform_plan
from tests.explain_helpers import copy_plan, searched_plan
from tests.search.synthetic import GEOM, MODS, REF


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    return searched_plan(tmp_path_factory.mktemp("ex"))


@pytest.fixture(scope="module")
def full(searched, tmp_path_factory):
    """Text and JSON of one full explain run (importance on), with figures and HTML."""
    d = tmp_path_factory.mktemp("full")
    txt = explain(searched, out_dir=d / "figs", html=d / "r.html", context_lengths=[300, 1000, 4096, 32768],
                  batch_sizes=[1, 8])
    rep = json.loads(explain(searched, format="json", context_lengths=[300, 1000, 4096, 32768], batch_sizes=[1, 8]))
    return txt, rep, d


def test_text_report_with_history(full):
    txt, _, d = full
    for needle in ("honest bpv", "memory", "32768 tokens x batch 8", "GiB", "bpv by modality mix", "all text",
                   "between group boundaries", "allocation: mean bits K", "modality doc",
                   "measured on test (held-out): KL", "consensus importance", "% of consensus importance",
                   "K vs V", "effect of bits", "Pareto front", "budget line: 3 bpv", "figures:", "HTML report:"):
        assert needle in txt, needle
    assert "missing" not in txt and "warning" not in txt
    for f in FIGURE_NAMES:
        with open(d / "figs" / f"{f}.png", "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n", f
    assert not [n for n in os.listdir(d / "figs") if n.startswith(".tmp-")]


def test_json_keeps_the_figures_numbers(full, searched):
    _, rep, _ = full
    plan = Plan.from_yaml(searched)
    assert rep["budget"]["bpv"]["total"] <= 3.0 + 1e-9
    assert rep["missing"] == [] and rep["warnings"] == []
    # allocation figure: every slot's bits and correction flag
    assert np.array_equal(np.array(rep["allocation"]["bits"]), plan.table())
    assert np.array_equal(np.array(rep["allocation"]["corrected"]), plan.correction_table())
    assert rep["allocation"]["bits_used"] == sorted(set(plan.table().ravel().tolist()))
    # bpv curve: dense at short lengths (every token), exact, reference point marked
    c = rep["bpv_curve"]
    assert c["context_len"][:256] == list(range(1, 257)) and c["context_len"][-1] == 131072
    labels = [s["label"] for s in c["series"]]
    assert labels[:2] == ["this plan", "fp16"] and any(lab.startswith("uniform int2") for lab in labels)
    mine = dict(zip(c["context_len"], c["series"][0]["bpv"]))
    for T in (1, 300, 1000, 4096):
        assert mine[T] == plan.bpv(context_len=T).total
    assert c["reference"] == {"context_len": REF.context_len, "bpv": plan.bpv().total}
    assert max(mine[T] for T in range(257, 1100) if T in mine) > mine[1024] + 0.1  # sawtooth between groups
    # pareto: every trial point, distinct baseline labels, the plan on calibration and test
    h = rep["history"]
    assert len(h["points"]) == h["n_trials"] == 20
    bl = [b["label"] for b in h["baselines"]]
    assert len(bl) >= 2 and len(set(bl)) == len(bl)
    assert {d["label"] for d in rep["measured"]} == {"calibration", "test (held-out)"}
    imp = rep["importance"]
    assert sum(imp["kind"].values()) + sum(imp["quantizer"].values()) == pytest.approx(100.0, abs=1e-6)
    assert imp["kind"]["k"] > imp["kind"]["v"] * 0.5 and "%" in imp["units"]
    d = imp["direction"]
    assert d["slope"] and set(d["slope"]) <= set(imp["top_slots"])
    # the synthetic damage falls with bits: most top slots must say "more bits help"
    assert np.mean([v < 0 for v in d["slope"].values()]) > 0.7
    for s in d["scatter"].values():
        assert len(s["bits"]) == len(s["shap"]) == 20


def test_memory_in_user_units(full, searched):
    _, rep, _ = full
    plan = Plan.from_yaml(searched)
    g = plan.geometry
    rows = {(r["context_len"], r["batch"]): r for r in rep["memory"]}
    assert set(rows) == {(T, B) for T in (300, 1000, 4096, 32768, REF.context_len) for B in (1, 8)}
    for (T, B), r in rows.items():
        n_values = g.num_layers * g.num_kv_heads * 2 * T * g.head_dim
        assert r["bytes"] == pytest.approx(plan.bpv(context_len=T).total * n_values * B / 8, rel=1e-12)
        assert r["fp16_bytes"] == n_values * 2 * B and r["gib"] == r["bytes"] / 2**30
    assert rows[(300, 1)]["bpv"] > rows[(4096, 1)]["bpv"]  # 300 tokens: a part-filled group
    mix = {r["context_len"]: r for r in rep["bpv_by_mix"]["rows"]}
    assert mix[1000]["all text"] == plan.bpv(context_len=1000, modality_mix={"text": 1.0}).total
    assert mix[1000]["reference"] == rows[(1000, 1)]["bpv"]


def test_tables_count_the_measured_reference_layout(searched, tmp_path):
    """At the reference length every table uses the plan's measured token layout, as its honest bpv does."""
    import dataclasses

    src = Plan.from_yaml(searched)
    layout = (("text", 16), ("doc", 480), ("text", 48), ("doc", 480))  # the reference mix, interleaved
    plan = src.replace(reference=dataclasses.replace(src.reference, layout=layout), metrics={})
    p = tmp_path / "layout.yaml"
    plan.to_yaml(p)
    honest = plan.bpv().total
    assert honest != plan.bpv(modality_mix=REF.modality_mix).total  # the layout changes the count
    rep = json.loads(explain(p, format="json", importance=False, context_lengths=[1000]))
    assert rep["budget"]["bpv"]["total"] == honest
    row = {r["context_len"]: r for r in rep["memory"]}[REF.context_len]
    assert row["bpv"] == honest
    g = plan.geometry
    assert row["bytes"] == pytest.approx(honest * g.num_layers * g.num_kv_heads * 2 * REF.context_len * g.head_dim / 8)
    mix = {r["context_len"]: r for r in rep["bpv_by_mix"]["rows"]}
    assert mix[REF.context_len]["reference"] == honest
    assert mix[1000]["reference"] == plan.bpv(context_len=1000).total == {r["context_len"]: r["bpv"]
                                                                          for r in rep["memory"]}[1000]
    assert mix[REF.context_len]["all text"] == plan.bpv(modality_mix={"text": 1.0}).total
    assert f"{REF.context_len} tokens x batch 1  : {honest:.3f} bpv" in explain(p, importance=False)


def test_uniform_curves_keep_the_plans_window_copies(searched, tmp_path):
    """The "uniform intN (..., 16 recent copies, 8 heavy-hitter copies)" curves count those copies."""
    import dataclasses

    src = Plan.from_yaml(searched)
    q = dataclasses.replace(src.quantizer, recent_length=16, heavy_length=8)
    plan = src.replace(quantizer=q)
    p = tmp_path / "copies.yaml"
    plan.to_yaml(p)
    c = json.loads(explain(p, format="json", importance=False))["bpv_curve"]
    s = next(s for s in c["series"] if s["label"].startswith("uniform int4"))
    assert "16 recent copies" in s["label"] and "8 heavy-hitter copies" in s["label"]
    u = uniform_plan(GEOM, 4, 4, group_size=q.group_size, residual_length=q.residual_length, key_axis=q.key_axis,
                     value_axis=q.value_axis, sink_length=q.sink_length, modalities=MODS, reference=REF)
    u = u.replace(quantizer=dataclasses.replace(q, key_correction_rank=0))
    curve = dict(zip(c["context_len"], s["bpv"]))
    for T in (300, 4096):
        assert curve[T] == u.bpv(context_len=T).total
        bare = u.replace(quantizer=dataclasses.replace(u.quantizer, recent_length=0, heavy_length=0))
        assert curve[T] > bare.bpv(context_len=T).total


def test_html_and_figures_name_the_plans_full_precision(searched, tmp_path):
    """An fp32 plan with an 8-bit residual is not called fp16 or "full precision" in the page and figure labels."""
    import dataclasses

    from kvplan.explain._figures import bpv_title, kl_label

    src = Plan.from_yaml(searched)
    plan = src.replace(reference=dataclasses.replace(src.reference, full_precision_bits=32),
                       quantizer=dataclasses.replace(src.quantizer, residual_bits=8))
    p = tmp_path / "fp32.yaml"
    plan.to_yaml(p)
    page = tmp_path / "r.html"
    explain(p, html=page, importance=False)
    text = page.read_text()
    assert "(fp32 " in text and "next to fp32 (the unquantized cache)" in text
    assert "(fp16 " not in text and "next to fp16" not in text
    rep = json.loads(explain(p, format="json", importance=False))
    assert kl_label(rep) == "mean KL(P_fp32 || P_quant)"
    assert "tokens waiting as 8-bit per-token codes until" in bpv_title(rep) and "full precision" not in bpv_title(rep)
    fp16 = json.loads(explain(searched, format="json", importance=False))
    assert kl_label(fp16) == "mean KL(P_fp16 || P_quant)" and "waiting in full precision" in bpv_title(fp16)


def _hist(sources, sinks, numbers):
    n = len(sources)
    q = {"group_size": [64] * n, "residual_length": [0] * n, "sink_length": sinks, "recent_length": [0] * n,
         "key_axis": ["channel"] * n, "value_axis": ["token"] * n}
    return TrialHistory("h.csv", np.zeros((n, 1, 1, 2, 1), dtype=np.int64), [0.1] * n, [2.5] * n, sources,
                        numbers, q, n)


def test_baseline_labels_name_every_differing_field():
    h = _hist(["baseline:int2-g128-r0", "baseline:int2-g128-r0", "tpe", "baseline:k4v2-g32-r0"], [0, 1, 0, 0],
              [4, 5, 6, 7])
    assert baseline_labels(h) == {0: "int2-g128-r0 sink_length=0", 1: "int2-g128-r0 sink_length=1",
                                  3: "k4v2-g32-r0"}
    same = _hist(["baseline:int2", "baseline:int2"], [0, 0], [4, 9])
    assert baseline_labels(same) == {0: "int2 #4", 1: "int2 #9"}


def test_plan_file_alone_says_what_is_missing(searched, tmp_path):
    bare = tmp_path / "bare.yaml"
    shutil.copy(searched, bare)
    (tmp_path / "f2").mkdir()
    (tmp_path / "f2" / "pareto.png").write_bytes(b"stale")  # from an earlier run with a history
    txt = explain(bare, out_dir=tmp_path / "f2")
    assert "missing: trial history" in txt and "bare.trials.csv" in txt
    assert "measured on test (held-out)" in txt
    assert sorted(os.listdir(tmp_path / "f2")) == ["allocation.png", "bpv_context.png"]
    base = tmp_path / "int4.yaml"
    uniform_plan(GEOM, 4, 2, modalities=MODS, reference=REF).to_yaml(base)
    txt = explain(base)
    assert "missing: measured metrics" in txt and "protected heads: none" in txt


def test_metrics_values_the_schema_accepts(searched, tmp_path):
    plan = Plan.from_yaml(searched)
    odd = {"calibration": {"kl": "0.1", "nll": [1, 2], "kl_ci95_lo": {"a": 1}, "n_samples": True},
           "test": "not measured", "validation": [0.1], "search": {"n_trials": {"x": 1}, "granularity": None}}
    p = tmp_path / "odd.yaml"
    plan.replace(metrics=odd).to_yaml(p)
    txt = explain(p)
    assert "honest bpv" in txt
    for needle in ("metrics.calibration.kl: not shown: not a number (got '0.1')", "metrics.calibration.nll",
                   "metrics.test: not shown: not a mapping", "metrics.validation: not shown"):
        assert needle in txt, needle
    assert "measured on calibration: KL n/a" in txt
    rep = json.loads(explain(p, format="json", out_dir=tmp_path / "figs"))
    assert rep["metrics"] == odd and os.path.exists(tmp_path / "figs" / "allocation.png")


def test_figure_set_is_written_whole_or_not_at_all(tmp_path):
    out = tmp_path / "figs"
    with pytest.raises(TypeError):
        write_figures(str(out), {"allocation": b"\x89PNG", "pareto": None})  # the second write fails
    assert not out.exists()
    out.mkdir()
    (out / "allocation.png").write_bytes(b"old")
    with pytest.raises(TypeError):
        write_figures(str(out), {"allocation": b"new", "pareto": None})
    assert os.listdir(out) == ["allocation.png"] and (out / "allocation.png").read_bytes() == b"old"


def test_html_is_atomic(searched, tmp_path, monkeypatch):
    from kvplan.explain import _api

    p = copy_plan(searched, tmp_path)["plan"]
    html = tmp_path / "r.html"
    html.write_text("old")

    def boom(rep, pngs):
        raise RuntimeError("render failed")

    monkeypatch.setattr(_api, "render_html", boom)
    with pytest.raises(RuntimeError):
        explain(p, html=html, importance=False)
    assert html.read_text() == "old"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


def test_bad_options(searched, tmp_path):
    with pytest.raises(KVPlanError, match="format"):
        explain(searched, format="xml")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExplainError, match="--figures .*file: exists and is not a directory"):
        explain(searched, out_dir=tmp_path / "file")
    with pytest.raises(ExplainError, match="--html .*cannot write into"):
        explain(searched, html=tmp_path / "file" / "r.html")
    with pytest.raises(ExplainError, match="--context: must be an integer from 1"):
        explain(searched, context_lengths=[0])
    with pytest.raises(ExplainError, match="--batch"):
        explain(searched, batch_sizes=[10**9])


def _kvplan(*args):
    return subprocess.run([sys.executable, "-m", "kvplan.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_context_batch_html(searched, tmp_path):
    r = _kvplan("explain", searched, "--format", "json", "--no-importance", "--context", "300", "4096",
                "--batch", "1", "8", "--html", str(tmp_path / "r.html"))
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(r.stdout)
    assert {(m["context_len"], m["batch"]) for m in rep["memory"]} >= {(300, 8), (4096, 1)}
    assert rep["html"] == str(tmp_path / "r.html") and (tmp_path / "r.html").read_text().startswith("<!DOCTYPE")
    r = _kvplan("explain", searched, "--context", "0")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--context" in r.stderr
    r = _kvplan("explain", searched, "--html", str(tmp_path / "r.html" / "x.html"))
    assert r.returncode == 2 and r.stderr.startswith("kvplan: error: --html") and "Traceback" not in r.stderr


def test_text_report_names_the_slot_formats(tmp_path):
    import dataclasses

    from kvplan.kernels.formats import default_codebook

    base = uniform_plan(GEOM, 2, 2, modalities=MODS, reference=REF)
    q = dataclasses.replace(base.quantizer, value_scaling="absmax-e4m3",
                            codebooks=(("v", 2, default_codebook(2, "absmax-e4m3", 32)),))
    path = tmp_path / "p.yaml"
    base.replace(quantizer=q).to_yaml(path)
    txt = explain(str(path))
    assert "slot formats: keys minmax-fp16, uniform levels; values absmax-e4m3, Lloyd-Max codebooks at [2] bits" in txt
    v1 = tmp_path / "v1.yaml"
    base.to_yaml(v1)
    assert "slot formats" not in explain(str(v1))


@pytest.mark.parametrize("recorded", ["digest", "bpv only"])
def test_a_plan_edited_since_its_search_shows_its_metrics_as_another_plans(searched, tmp_path, recorded, capsys,
                                                                        monkeypatch):
    """A hand-edited plan showed the searched plan's KL as "this plan on test" beside its new bpv, with no
    word that the numbers were measured on other bits (the text; then the Pareto figure and the HTML cards)."""
    from kvplan.cli import main
    from kvplan.explain import _figures, _html
    from kvplan.explain._report import report

    def this_plan_points(path):
        """The Pareto figure's "this plan" legend entries and the HTML's KL cards of ``path``'s report."""
        import shutil

        for side in (".trials.csv", ".search.json"):  # the search's history beside the copy
            shutil.copy(str(searched)[: -len(".yaml")] + side, str(path)[: -len(".yaml")] + side)
        labels = []
        monkeypatch.setattr(_figures, "_png", lambda fig: labels.extend(
            lab for ax in fig.axes for lab in ax.get_legend_handles_labels()[1]) or b"")
        rep = report(str(path))
        _figures.pareto_figure(rep)
        return [lab for lab in labels if lab.startswith("this plan")], [c for c in _html._cards(rep) if "KL" in c[1]]

    plan = Plan.from_yaml(searched)
    assert plan.metrics["search"]["plan_digest"] == plan.content_digest() and plan.measurement_notes() == []
    if recorded == "bpv only":  # a plan written before the digest: its metrics.bpv tells the edit
        search = {k: v for k, v in plan.metrics["search"].items() if k != "plan_digest"}
        plan = plan.replace(metrics={**plan.metrics, "search": search})
    unedited = tmp_path / "unedited.yaml"
    plan.to_yaml(unedited)
    assert "edited since" not in explain(unedited) and "before it was edited" not in explain(unedited)
    points, cards = this_plan_points(unedited)
    assert any("test" in p for p in points) and any("test" in label for _, label in cards)
    table = plan.table()
    table[0] = 8  # the user raises layer 0 to 8 bits
    edited = plan.with_table(table).replace(target_bpv=None)
    edited.to_yaml(tmp_path / "edited.yaml")
    [note] = Plan.from_yaml(tmp_path / "edited.yaml").measurement_notes()
    assert note.startswith("edited since") and "re-measure it with kvplan eval" in note
    txt = explain(tmp_path / "edited.yaml")
    assert "measured on test (held-out) (the plan as searched, before it was edited): KL" in txt
    assert "this plan on test" not in txt and f"warning: plan {note}" in txt
    assert this_plan_points(tmp_path / "edited.yaml") == ([], [])
    assert main(["validate", str(tmp_path / "edited.yaml")]) == 0
    assert f"warning: {note}" in capsys.readouterr().err


def test_a_plan_over_its_target_bpv_is_flagged(tmp_path):
    plan = uniform_plan(GEOM, 4, 2, modalities=MODS, reference=REF)
    over = plan.replace(target_bpv=round(plan.bpv().total - 0.5, 1))
    assert over.measurement_notes() == [f"its honest bpv {plan.bpv().total:.4f} exceeds its budget.target_bpv "
                                        f"{over.target_bpv:g}"]
    assert plan.replace(target_bpv=plan.bpv().total).measurement_notes() == []


def test_slots_that_never_varied_are_left_out_of_the_rankings_and_counted(tmp_path):
    """Slots whose bits never changed across the trials (here the streamed heads, fixed before the search)
    were listed at 0.0% in "top slots" and "heads", as if measured unimportant: the trials say nothing of them."""
    from tests.search.test_streamed_search import StreamingScorer

    from kvplan.search import search

    out = tmp_path / "plan.yaml"
    search(budget="2.3", n_trials=24, scorer=StreamingScorer([(1, 0), (4, 1)]), stream_window=8, out=out,
           progress=False, seed=0, group_sizes=(128,), residual_lengths=(0,), sink_lengths=(1,), recent_lengths=(0,))
    rep = json.loads(explain(out, format="json"))
    imp = rep["importance"]
    fixed = imp["not_varied"]
    assert fixed["of"] == 24 and fixed["slots"] >= 4 and {"L01.H0", "L04.H1"} <= set(fixed["heads"])
    assert not {"L01.H0", "L04.H1"} & set(imp["head"])
    assert not any(s.startswith(("L01.H0.", "L04.H1.")) for s in imp["top_slots"])
    assert len(imp["top_slots"]) <= 24 - fixed["slots"]
    txt = explain(out, importance=True)
    assert f"not varied in the trials (no data: counted 0 and not ranked): {fixed['slots']} of 24 slots" in txt
    assert "(streamed heads count 0); formats used: streamed, " in txt  # read "0, 2, ... bits" before


def test_a_ranking_the_forest_cannot_predict_is_flagged():
    """A KL unrelated to every slot still got a ranking with no word beyond the OOB R2 figure."""
    from kvplan.explain._text import _importance

    lines = []
    _importance({"importance": {"n_trials": 40, "oob_r2": -0.2, "no_fit": True, "kind": {}, "modality": {},
                                "layer": {}, "head": {}, "quantizer": {}, "top_slots": {}}}, lines)
    assert any(line.startswith("  caution: the forest predicts out-of-bag trials no better") for line in lines)


def test_a_trial_history_that_lost_rows_is_flagged(searched, tmp_path):
    """A .trials.csv cut to 5 of its 20 rows was used silently: the importance and the Pareto front of 5
    trials, beside "20 trials" and a chosen trial missing from the front."""
    plan = Plan.from_yaml(searched)
    n, trial = plan.metrics["search"]["n_trials"], plan.metrics["search"]["trial"]
    stem = str(searched)[: -len(".yaml")]
    copy = tmp_path / "p.yaml"
    shutil.copy(searched, copy)
    shutil.copy(stem + ".search.json", tmp_path / "p.search.json")
    rows = open(stem + ".trials.csv").read().splitlines(keepends=True)
    kept = [r for r in rows[1:] if not r.startswith(f"{trial},")][:5]
    (tmp_path / "p.trials.csv").write_text(rows[0] + "".join(kept))
    warnings = json.loads(explain(copy, format="json"))["warnings"]
    assert any(f"holds 5 trial rows of the {n} the search recorded (metrics.search.n_trials)" in w for w in warnings)
    assert any(f"the plan's own trial {trial} (metrics.search.trial) is not among its rows" in w for w in warnings)
    shutil.copy(stem + ".trials.csv", tmp_path / "p.trials.csv")
    assert json.loads(explain(copy, format="json"))["warnings"] == []


def test_a_trial_row_with_an_absurd_quantizer_value_is_skipped_not_fed_to_the_forest(searched, tmp_path):
    """A residual_length of 1e300 in .trials.csv passed the row check (a finite whole number) and crashed the
    importance forest (sklearn: "Input X contains infinity") with an internal error."""
    import csv

    stem = str(searched)[: -len(".yaml")]
    copy = tmp_path / "p.yaml"
    shutil.copy(searched, copy)
    shutil.copy(stem + ".search.json", tmp_path / "p.search.json")
    with open(stem + ".trials.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    rows[3]["residual_length"] = "1e300"
    with open(tmp_path / "p.trials.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    rep = json.loads(explain(copy, format="json"))
    assert any("residual_length '1e300' is not a valid residual_length" in w for w in rep["warnings"])
    assert rep["importance"]["n_trials"] == len(rows) - 1


def test_a_figure_the_system_will_not_replace_leaves_the_old_set_and_names_the_figure(tmp_path, monkeypatch):
    """A rename that failed half-way (an immutable or otherwise unreplaceable pareto.png) left the figures renamed
    before it replaced, a `.tmp-pareto-*.png` behind (one more per run), and an error naming that temporary file."""
    import kvplan.plans._files as files

    out = tmp_path / "figs"
    out.mkdir()
    for name in ("allocation", "pareto"):
        (out / f"{name}.png").write_bytes(b"old " + name.encode())
    real_replace = os.replace

    def refuse_pareto(src, dst):
        if os.fspath(dst).endswith("pareto.png"):
            raise PermissionError(1, "Operation not permitted", os.fspath(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(files.os, "replace", refuse_pareto)
    with pytest.raises(KVPlanError, match=rf"^{out / 'pareto.png'}: cannot write \(Operation not permitted\)$"):
        write_figures(str(out), {"allocation": b"new allocation", "pareto": b"new pareto"})
    assert sorted(os.listdir(out)) == ["allocation.png", "pareto.png"]  # no temporary or second name left
    assert (out / "allocation.png").read_bytes() == b"old allocation"  # put back
    assert (out / "pareto.png").read_bytes() == b"old pareto"


def test_figures_and_html_are_one_set(searched, tmp_path, monkeypatch):
    """With an HTML page the system would not replace, `explain --figures DIR --html r.html` wrote the new figures,
    then failed on the page: figures of this run beside the page of the last."""
    import errno

    import kvplan.plans._files as files

    p = copy_plan(searched, tmp_path)["plan"]
    figs, html = tmp_path / "figs", tmp_path / "r.html"
    figs.mkdir()
    (figs / "allocation.png").write_bytes(b"old")
    html.write_text("old page")
    real_link = os.link

    def immutable_page(src, dst):
        if os.fspath(src) == str(html):
            raise PermissionError(errno.EPERM, "Operation not permitted", os.fspath(src))
        return real_link(src, dst)

    monkeypatch.setattr(files.os, "link", immutable_page)
    with pytest.raises(KVPlanError, match="r.html: cannot write"):
        explain(p, out_dir=figs, html=html, importance=False)
    assert os.listdir(figs) == ["allocation.png"] and (figs / "allocation.png").read_bytes() == b"old"
    assert html.read_text() == "old page"
    monkeypatch.setattr(files.os, "link", real_link)
    explain(p, out_dir=figs, html=html, importance=False)
    assert (figs / "allocation.png").read_bytes() != b"old" and html.read_text() != "old page"
