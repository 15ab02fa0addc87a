"""End-to-end search on the synthetic scorer: feasibility, determinism, export, Pareto mode."""

import csv
import json
import os

import numpy as np
import optuna
import pytest
from optuna.trial import TrialState

from kvplan.errors import KVPlanError
from kvplan.plans import Plan
from kvplan.search import BudgetError, search
from tests.search.synthetic import SyntheticScorer

# the space before recent copies and coded residuals made more quantizers feasible: its seeds leave
# room for TPE and the surrogate in 30 trials
FAST = dict(n_candidates=6, n_local=10, progress=False, recent_lengths=(0,), residual_bits=16)


class Recorder(SyntheticScorer):
    """Records the bpv of every plan it is asked to score (profile plans separately)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.trial_bpv, self.profile_bpv = [], []

    def __call__(self, plan):
        (self.profile_bpv if plan.provenance.produced_by.endswith("profile") else self.trial_bpv).append(
            plan.bpv().total)
        return super().__call__(plan)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("s") / "plan.yaml"
    sc = Recorder()
    r = search(budget="2.8bpv", n_trials=30, seed=0, scorer=sc, heldout_scorer=SyntheticScorer(seed=0), out=out,
               **FAST)
    return r, sc, out


def test_never_evaluates_over_budget(run):
    r, sc, _ = run
    assert len(sc.trial_bpv) == 30 == r.n_real_evals
    assert max(sc.trial_bpv) <= 2.8 + 1e-9
    assert sc.profile_bpv and len(sc.profile_bpv) == r.n_profile_evals  # diagnostic, not trials
    for t in r.study.get_trials(states=(TrialState.COMPLETE,)):
        assert t.user_attrs["kvplan.bpv"] <= 2.8 + 1e-9
        # the COMPLETE trial's params are exactly the evaluated (repaired) plan
        assert r.space.plan_of(t.params, r.plan.reference).bpv().total == pytest.approx(t.user_attrs["kvplan.bpv"])
    roles = {t.user_attrs.get("kvplan.role") for t in r.study.get_trials(states=(TrialState.FAIL,))}
    assert roles <= {"repaired", "screened", "duplicate"}


def test_seeds_and_surrogate_used(run):
    r, _, _ = run
    sources = [t.user_attrs["kvplan.source"] for t in r.study.get_trials(states=(TrialState.COMPLETE,))]
    assert any(s.startswith("knapsack") for s in sources)
    assert any(s.startswith("baseline:int2") for s in sources)
    assert any(s.endswith("+surrogate") for s in sources)
    base = min(t.values[0] for t in r.study.get_trials(states=(TrialState.COMPLETE,))
               if t.user_attrs["kvplan.source"].startswith("baseline:"))
    assert r.plan.metrics["calibration"]["kl"] < base


def test_export_and_history(run):
    r, _, out = run
    plan = Plan.from_yaml(out)
    assert np.array_equal(plan.table(), r.plan.table())
    assert plan.target_bpv == 2.8
    assert plan.bpv().total <= 2.8 + 1e-9
    assert plan.metrics["test"]["kl"] > 0
    assert plan.metrics["bpv"]["total"] == pytest.approx(plan.bpv().total)
    assert plan.provenance.produced_by == "kvplan search" and plan.provenance.seed == 0
    with open(str(out).replace(".yaml", ".trials.csv")) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 30
    assert len(rows[0]["bits"].split()) == plan.table().size
    side = json.load(open(str(out).replace(".yaml", ".search.json")))
    assert side["space"]["granularity"] == "slot" and side["profile"] and side["curve"][-1][1] == pytest.approx(
        plan.metrics["calibration"]["kl"])


def test_same_seed_same_plan(run, tmp_path):
    r, _, _ = run
    r2 = search(budget="2.8bpv", n_trials=30, seed=0, scorer=Recorder(), out=None, **FAST)
    assert np.array_equal(r2.plan.table(), r.plan.table()) and r2.plan.quantizer == r.plan.quantizer
    assert r2.curve == r.curve


def test_given_profile_is_reused_and_gives_the_same_plan(run):
    """A profile measured before (result.profile) replaces the profile stage: no profile
    evaluation, the same seeds, hence the same search as the run that measured it."""
    r, _, _ = run
    sc = Recorder()
    r2 = search(budget="2.8bpv", n_trials=30, seed=0, scorer=sc, out=None, profile=dict(r.profile), **FAST)
    assert sc.profile_bpv == [] and r2.n_profile_evals == 0 and len(sc.trial_bpv) == 30
    assert any(".h" in name for name in r.profile)  # the per-head stage ran in the first search
    assert r2.curve == r.curve


def test_sink_length_is_searched_and_exported(run):
    r, _, out = run
    sinks = {r.space.quantizer_of(t.params).sink_length for t in r.study.get_trials(states=(TrialState.COMPLETE,))}
    assert sinks <= {0, 1, 4} and len(sinks) > 1
    assert Plan.from_yaml(out).quantizer.sink_length == r.plan.quantizer.sink_length


def test_infeasible_budget_fails_fast():
    sc = Recorder()
    with pytest.raises(BudgetError, match="cheapest reachable plan"):
        search(budget="2.0bpv", n_trials=5, scorer=sc, out=None, stream_window=0, **FAST)
    with pytest.raises(BudgetError, match="12 KV heads streamed with window 16"):
        search(budget="0.1bpv", n_trials=5, scorer=sc, out=None, **FAST)
    assert sc.calls == 0


def test_streamed_heads_reach_budgets_below_every_slot_at_the_lowest_bits():
    """2.0 bpv is below every slot at 2 bits here (2.2031); streaming some heads reaches it, and every
    scored trial and the exported plan are within it."""
    sc = Recorder()
    r = search(budget="2.0bpv", n_trials=12, scorer=sc, out=None, **FAST)
    assert r.plan.bpv().total <= 2.0 + 1e-9 and max(sc.trial_bpv) <= 2.0 + 1e-9
    assert (r.plan.code_table() == 0).any()  # streamed heads


def test_check_budgets_refuses_exactly_what_search_refuses():
    """``check_budgets`` (the CLI's check before the prefill) and search() read one space: same keywords,
    same defaults, same formats."""
    from kvplan.search import check_budgets

    geometry, reference = Recorder().geometry, Recorder().reference
    outcomes = []
    no_stream = {"stream_window": 0}
    for budget, options in [("2.0bpv", no_stream), ("2.25bpv", no_stream),
                            ("2.25bpv", {**no_stream, "value_scaling": "minmax-fp16"}), ("2.15bpv", no_stream),
                            ("2.15bpv", {**no_stream, "key_scaling": "absmax-e4m3"}),
                            # streamed heads go below every slot at 2 bits: the default streams, unless no profile
                            ("2.0bpv", {}), ("2.0bpv", {"profile": False}), ("0.1bpv", {})]:
        sc = Recorder()
        try:
            check_budgets(budget, geometry, reference, sc.modalities, **{**FAST, **options})
            refused_early = None
        except BudgetError as e:
            refused_early = str(e)
        try:
            search(budget=budget, n_trials=1, scorer=sc, out=None, **{**FAST, **options})
            refused = None
        except BudgetError as e:
            refused = str(e)
        assert refused_early == refused, (budget, options)
        outcomes.append(refused is None)
    assert outcomes == [False, True, False, False, True, True, False, False]  # formats and streaming decide


def test_residual_bits_reach_every_scored_plan_and_the_export(tmp_path):
    sc = Recorder()
    out = tmp_path / "plan.yaml"
    r = search(budget="2.8bpv", n_trials=10, seed=0, scorer=sc, out=out, profile=False, **{**FAST, "residual_bits": 8})
    assert r.plan.quantizer.residual_bits == 8 and Plan.from_yaml(out).quantizer.residual_bits == 8
    assert max(sc.trial_bpv) <= 2.8 + 1e-9  # the budget holds with the coded residual's bytes
    assert json.loads(out.with_suffix(".search.json").read_text())["space"]["residual_bits"] == 8


def test_heavy_copies_reach_every_scored_plan_and_are_paid_in_the_budget(tmp_path):
    sc = Recorder()
    out = tmp_path / "plan.yaml"
    r = search(budget="2.8bpv", n_trials=10, seed=0, scorer=sc, out=out, profile=False,
               **{**FAST, "residual_bits": 8, "heavy_length": 6})
    assert r.plan.quantizer.heavy_length == 6 and Plan.from_yaml(out).quantizer.heavy_length == 6
    assert max(sc.trial_bpv) <= 2.8 + 1e-9  # the copies' bytes count in every proposal
    assert json.loads(out.with_suffix(".search.json").read_text())["space"]["heavy_length"] == 6


@pytest.mark.parametrize("granularity", ["layer_kv", "kvtuner"])
def test_coarse_granularities(granularity):
    r = search(budget=3.0, granularity=granularity, n_trials=12, scorer=SyntheticScorer(), out=None, profile=False,
               **FAST)
    assert r.plan.bpv().total <= 3.0 + 1e-9
    assert r.space.levels_of_table(r.plan.table()) is not None


def test_pareto_mode_one_plan_per_budget(tmp_path):
    out = tmp_path / "p.yaml"
    r = search(budget=["2.6bpv", "3.2bpv"], n_trials=25, scorer=SyntheticScorer(), out=out, **FAST)
    assert sorted(r.plans) == [2.6, 3.2]
    for b, plan in r.plans.items():
        assert plan.bpv().total <= b + 1e-9
        assert os.path.exists(tmp_path / f"p-{b:g}bpv.yaml")
    assert r.plans[3.2].metrics["calibration"]["kl"] <= r.plans[2.6].metrics["calibration"]["kl"]
    kls = [p["kl"] for p in r.pareto]
    assert kls == sorted(kls, reverse=True)  # by increasing bpv, decreasing KL
    t = r.study.get_trials(states=(TrialState.COMPLETE,))[0]
    assert len(t.values) == 2


def test_resume_in_process(tmp_path):
    storage = str(tmp_path / "s.journal")
    r1 = search(budget=3.0, n_trials=10, scorer=SyntheticScorer(), storage=storage, study_name="x", out=None,
                worker=0, **FAST)
    first = {t.number: t.values[0] for t in r1.study.get_trials(states=(TrialState.COMPLETE,))}
    sc = SyntheticScorer()
    r2 = search(budget=3.0, n_trials=16, scorer=sc, storage=storage, study_name="x", out=None, worker=0, **FAST)
    done = {t.number: t.values[0] for t in r2.study.get_trials(states=(TrialState.COMPLETE,))}
    assert len(done) == 16 and all(done[k] == v for k, v in first.items())
    assert sc.calls == 6  # profile reused from the study, only the missing trials evaluated


def test_recent_copies_are_profiled_and_chosen_when_they_pay():
    """The profile measures what recent copies do to the lowest plan (here: 16 copies halve the KL,
    8 cut it by a third); the prior carries that factor, so the search finds a plan that pays for
    copies with slot bits, within the budget as the accounting counts them."""
    from kvplan.search.sensitivity import recent_factor

    r = search(budget="2.8bpv", n_trials=20, seed=0, scorer=SyntheticScorer(), **{
        **FAST, "recent_lengths": (0, 8, 16), "residual_bits": 8, "residual_lengths": (0,), "sink_lengths": (0,),
        "group_sizes": (128,)})
    assert {"lowest", "lowest+recent8", "lowest+recent16"} <= set(r.profile)
    assert recent_factor(r.profile, 16) == pytest.approx(0.5)
    assert recent_factor(r.profile, 8) == pytest.approx(2 / 3)
    assert recent_factor(r.profile, 0) == 1.0 and recent_factor(None, 16) == 1.0
    assert r.plan.quantizer.recent_length == 16
    assert r.plan.bpv().total <= 2.8 + 1e-9 and r.plan.bpv().residual > 0


class Interrupting(SyntheticScorer):
    """Ctrl-C after ``after`` trials (the profile's evaluations are not counted)."""

    def __init__(self, after, **kw):
        super().__init__(**kw)
        self.after, self.trials = after, 0

    def __call__(self, plan):
        if not plan.provenance.produced_by.endswith("profile"):
            self.trials += 1
            if self.trials > self.after:
                raise KeyboardInterrupt
        return super().__call__(plan)


def test_an_interrupted_search_keeps_its_trials_beside_out_and_the_same_call_resumes(tmp_path):
    """Without a storage, the study lived in memory: Ctrl-C lost every measured trial, and running the
    command again started from zero."""
    out = tmp_path / "plan.yaml"
    kw = dict(budget=3.0, n_trials=10, out=out, keep_trials=True, worker=0, **FAST)
    with pytest.raises(KeyboardInterrupt):
        search(scorer=Interrupting(after=4), **kw)
    assert (tmp_path / "plan.journal").exists() and not out.exists()
    # the interrupted trial was given back: the process lives on (a notebook), and a resume in it waited for
    # its own held slot until its heartbeat went stale (60 s), or forever without a heartbeat
    from kvplan.search import make_storage

    [held] = optuna.get_all_study_summaries(make_storage(str(tmp_path / "plan.journal")))
    study = optuna.load_study(study_name=held.study_name, storage=make_storage(str(tmp_path / "plan.journal")))
    assert not study.get_trials(states=(TrialState.RUNNING,))
    # the evaluation it held is back in the queue, as a dead worker's (RetryStale records which trial failed)
    assert sum("failed_trial" in t.system_attrs for t in study.get_trials(states=(TrialState.WAITING,))) == 1
    sc = SyntheticScorer()
    r = search(scorer=sc, **kw)
    assert r.n_study_trials == 10 and r.n_real_evals == 6 and out.exists()
    assert sc.calls < 10 + 3  # the 4 trials measured before the interruption are not measured again
    other = search(scorer=SyntheticScorer(), **{**kw, "budget": 2.8})  # another setup: its own study, same file
    assert other.n_real_evals == 10 and other.study.study_name != r.study.study_name
    assert r.study.study_name.startswith("kvplan-slot-3bpv-s0-")


def test_a_finished_search_run_again_writes_its_missing_files_back_as_recorded(tmp_path):
    """The same command run again after its plan was deleted (or overwritten by another search at the same
    ``out``) found the study's export, measured nothing, and wrote no file, saying the plan was written there."""
    out = tmp_path / "plan.yaml"
    kw = dict(budget=3.0, n_trials=5, out=out, keep_trials=True, worker=0, **FAST)
    first = search(scorer=SyntheticScorer(), **kw)
    assert first.export == "written"
    written = {f: (tmp_path / f).read_bytes() for f in ("plan.yaml", "plan.trials.csv", "plan.search.json")}
    sc = SyntheticScorer()
    intact = search(scorer=sc, **kw)  # run again, files in place: said to be this command's, at their path
    assert sc.calls == 0 and intact.export == "in place" and intact.paths["plan"] == str(out)
    assert {f: (tmp_path / f).read_bytes() for f in written} == written
    out.unlink()
    again = search(scorer=sc, **kw)
    assert sc.calls == 0 and again.finalized_by is not None and again.paths["plan"] == str(out)
    assert again.export == "rewritten"
    assert {f: (tmp_path / f).read_bytes() for f in written} == written  # the same export, the same run_id
    search(scorer=SyntheticScorer(), **{**kw, "budget": 2.8})  # another setup's study overwrites the files
    assert Plan.from_yaml(out).target_bpv == 2.8
    search(scorer=SyntheticScorer(), **kw)
    assert {f: (tmp_path / f).read_bytes() for f in written} == written
    assert first.plan.to_yaml() == Plan.from_yaml(out).to_yaml()
    for junk in (b"\xff\xfe not text", b"[" * 5000):  # a plan file replaced by anything: written back too
        out.write_bytes(junk)
        search(scorer=SyntheticScorer(), **kw)
        assert out.read_bytes() == written["plan.yaml"]


def test_a_second_search_on_the_same_out_at_once_is_refused(tmp_path):
    """Two searches writing one --out at the same time both ran, and the later export replaced the other's
    plan files without a word. The first holds its journal's lock while it runs; the second is refused."""
    import fcntl

    from kvplan.search.storage import StorageError

    out = tmp_path / "plan.yaml"
    kw = dict(budget=3.0, n_trials=3, out=out, keep_trials=True, **FAST)
    search(scorer=SyntheticScorer(), **kw)
    with open(tmp_path / "plan.journal", "rb") as running:  # what a search in progress holds
        fcntl.flock(running, fcntl.LOCK_EX | fcntl.LOCK_NB)
        sc = SyntheticScorer()
        with pytest.raises(StorageError, match="plan.journal: another kvplan search is running with this --out"):
            search(scorer=sc, **{**kw, "budget": 2.8})
        with pytest.raises(StorageError, match="another kvplan search is running"):  # before the model loads
            search(model="no-such-model-is-loaded", **{**kw, "budget": 2.8})
        assert sc.calls == 0 and Plan.from_yaml(out).target_bpv == 3.0
    assert search(scorer=SyntheticScorer(), **{**kw, "budget": 2.8}).plan.target_bpv == 2.8  # released: runs


def test_a_search_that_runs_out_of_new_plans_says_it_stopped_short_and_labels_repeats_as_duplicates():
    """A space with 7 plans within the budget, 30 trials asked: the search stopped at 7 without a word, and
    asked trials that repaired onto a measured plan were labelled "screened", as if the surrogate had
    rejected them."""
    with pytest.warns(UserWarning, match="the search stops at 7 of the 30 trials asked: 21 rounds in a row"):
        r = search(budget=2.4, granularity="layer", bits=(2, 3), group_sizes=(128,), residual_lengths=(0,),
                   sink_lengths=(0,), n_trials=30, seed=0, scorer=SyntheticScorer(), out=None, profile=False,
                   baselines=False, **FAST)
    assert r.n_real_evals == 7
    failed = r.study.get_trials(states=(TrialState.FAIL,))
    roles = [t.user_attrs.get("kvplan.role") for t in failed]
    screened = [t for t in failed if t.user_attrs.get("kvplan.role") == "screened"]
    assert roles.count("duplicate") > 0 and all("kvplan.pred_log_kl" in t.user_attrs for t in screened)


def test_without_keep_trials_or_out_no_journal_is_written(tmp_path):
    out = tmp_path / "plan.yaml"
    search(budget=3.0, n_trials=3, scorer=SyntheticScorer(), out=out, **FAST)
    assert sorted(os.listdir(tmp_path)) == ["plan.search.json", "plan.trials.csv", "plan.yaml"]


class InterruptingProfile(SyntheticScorer):
    """Ctrl-C at the ``after``-th profile evaluation."""

    def __init__(self, after, **kw):
        super().__init__(**kw)
        self.after, self.profiled = after, 0

    def __call__(self, plan):
        if plan.provenance.produced_by.endswith("profile"):
            self.profiled += 1
            if self.profiled > self.after:
                raise KeyboardInterrupt
        return super().__call__(plan)


def test_an_interrupted_profile_keeps_what_it_measured_and_the_rerun_measures_only_the_rest(tmp_path):
    """The sensitivity profile was saved only once complete: an interruption threw its measurements away."""
    from kvplan.search.sensitivity import PROFILE_SAVE_EVERY

    kw = dict(budget=3.0, n_trials=4, keep_trials=True, worker=0, **FAST)
    fresh = search(scorer=SyntheticScorer(), out=tmp_path / "a" / "plan.yaml", **kw)
    assert len([k for k in fresh.profile if not k.startswith("lowest")]) > 2 * PROFILE_SAVE_EVERY + 4
    with pytest.raises(KeyboardInterrupt):  # inside the sensitivity profile, 4 measurements after its second save
        search(scorer=InterruptingProfile(after=2 * PROFILE_SAVE_EVERY + 4), out=tmp_path / "b" / "plan.yaml", **kw)
    resumed = search(scorer=SyntheticScorer(), out=tmp_path / "b" / "plan.yaml", **kw)
    assert resumed.n_profile_evals == fresh.n_profile_evals - 2 * PROFILE_SAVE_EVERY
    assert resumed.profile == fresh.profile and resumed.plan.to_dict()["bits"] == fresh.plan.to_dict()["bits"]


def test_an_interrupted_streaming_calibration_keeps_its_first_evaluation(tmp_path):
    """The streaming calibration's two whole-plan evaluations were saved only with the finished profile: an
    interruption between them measured both again."""
    from kvplan.search.streaming import STREAM_PARTS_KEYS

    kw = dict(budget=2.4, n_trials=4, keep_trials=True, worker=0, **FAST)  # a budget that streams some heads
    fresh = search(scorer=SyntheticScorer(), out=tmp_path / "a" / "plan.yaml", **kw)
    assert all(k in fresh.profile for k in STREAM_PARTS_KEYS)
    with pytest.raises(KeyboardInterrupt):  # at the calibration's second evaluation, the profile's last
        search(scorer=InterruptingProfile(after=fresh.n_profile_evals - 1), out=tmp_path / "b" / "plan.yaml", **kw)
    resumed = search(scorer=SyntheticScorer(), out=tmp_path / "b" / "plan.yaml", **kw)
    assert resumed.n_profile_evals == 1
    assert resumed.profile == fresh.profile and resumed.plan.to_dict()["bits"] == fresh.plan.to_dict()["bits"]


def test_a_seeding_cut_short_queues_the_rest_of_the_seeds_on_the_rerun(tmp_path, monkeypatch):
    """The study was marked seeded before its seeds were queued: Ctrl-C after the second seed left the other
    seeds out of the study for good (and another worker could ask unseeded trials while seeds were queued)."""
    kw = dict(budget=3.0, n_trials=30, keep_trials=True, worker=0, **FAST)

    def seeds(r):
        return sorted(t.user_attrs["kvplan.source"] for t in r.study.get_trials()
                      if t.user_attrs.get("kvplan.source", "tpe").split("@")[0] in ("greedy", "knapsack")
                      or t.user_attrs.get("kvplan.source", "").startswith("baseline:"))

    fresh = search(scorer=SyntheticScorer(), out=tmp_path / "a" / "plan.yaml", **kw)
    assert len(seeds(fresh)) > 3
    enqueue, calls = optuna.Study.enqueue_trial, []

    def interrupted(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return enqueue(self, *a, **k)

    monkeypatch.setattr(optuna.Study, "enqueue_trial", interrupted)
    with pytest.raises(KeyboardInterrupt):
        search(scorer=SyntheticScorer(), out=tmp_path / "b" / "plan.yaml", **kw)
    monkeypatch.setattr(optuna.Study, "enqueue_trial", enqueue)
    resumed = search(scorer=SyntheticScorer(), out=tmp_path / "b" / "plan.yaml", **kw)
    assert seeds(resumed) == seeds(fresh)  # every seed once: the two queued before the cut are not queued again
    assert resumed.plan.to_dict()["bits"] == fresh.plan.to_dict()["bits"]


@pytest.mark.parametrize("n_trials", ["3", 0, -1, 2.5, True])
def test_a_trial_count_that_is_no_positive_integer_is_refused_before_any_work(n_trials):
    """``search(n_trials="3")`` failed after the model load with a TypeError, ``n_trials=0`` said the search had
    no successful evaluation, and ``2.5`` ran."""
    sc = SyntheticScorer()
    with pytest.raises(KVPlanError, match=f"n_trials={n_trials!r}: must be an integer of at least 1"):
        search(budget=3.0, n_trials=n_trials, scorer=sc, **FAST)
    assert sc.calls == 0


@pytest.mark.parametrize("budget", [[], ()])
def test_an_empty_budget_list_is_refused_as_a_budget(budget):
    """It failed after the model load with ``max() arg is an empty sequence``."""
    sc = SyntheticScorer()
    with pytest.raises(BudgetError, match=r"budget=.*: no budget given"):
        search(budget=budget, n_trials=3, scorer=sc, **FAST)
    assert sc.calls == 0


def test_resumable_measurements_take_what_was_saved_and_save_every_few_and_at_the_end():
    from kvplan.search.sensitivity import PROFILE_SAVE_EVERY, ResumableMeasurements

    scored, saves = [], []
    plans = {f"p{i}": i for i in range(2 * PROFILE_SAVE_EVERY + 5)}
    run = ResumableMeasurements(lambda plan: scored.append(plan) or {"kl": plan / 10}, len(plans),
                                done={"p0": 9.0, "p1": 9.0}, save=saves.append)
    run.measure(plans)
    out = run.finish()
    assert out["p0"] == 9.0 and out["p2"] == 0.2 and scored == list(range(2, len(plans)))
    assert [len(s) for s in saves] == [PROFILE_SAVE_EVERY + 2, 2 * PROFILE_SAVE_EVERY + 2, len(plans)]


def test_a_search_kept_in_its_own_journal_measures_what_the_same_search_in_memory_measures(tmp_path):
    """The journal beside --out used to seed the sampler from the process id, as a shared study's workers do:
    the CLI's default search was no longer reproducible run to run, nor equal to the in-memory one."""
    kw = dict(budget=3.0, n_trials=30, seed=0, **FAST)  # enough trials for TPE's own samples to count
    kept = search(scorer=SyntheticScorer(), out=tmp_path / "a" / "plan.yaml", keep_trials=True, **kw)
    memory = search(scorer=SyntheticScorer(), out=tmp_path / "b" / "plan.yaml", **kw)
    assert os.path.exists(tmp_path / "a" / "plan.journal") and not os.path.exists(tmp_path / "b" / "plan.journal")

    def trials(r):
        return [(t.params, t.values) for t in r.study.get_trials(states=(TrialState.COMPLETE,))]

    assert trials(kept) == trials(memory) and kept.plan.to_dict()["bits"] == memory.plan.to_dict()["bits"]


def test_a_worker_with_another_profile_setting_is_refused_by_a_shared_study(tmp_path):
    """The identity recorded the profile setting but the check did not compare it: a worker asking for a
    profile joined a study set up without one and searched without it, saying nothing."""
    kw = dict(budget=2.6, n_candidates=6, n_local=10, progress=False, study_name="x", stream_window=0)  # one space
    search(n_trials=6, scorer=SyntheticScorer(), profile=False, storage=str(tmp_path / "s.journal"), **kw)
    with pytest.raises(KVPlanError, match="another sensitivity profile than the study \\(profile: study 'off', "
                                          "this worker None\\)"):
        search(n_trials=8, scorer=SyntheticScorer(), storage=str(tmp_path / "s.journal"), **kw)
    search(n_trials=4, scorer=SyntheticScorer(), profile_head_units=2, storage=str(tmp_path / "t.journal"), **kw)
    with pytest.raises(KVPlanError, match="another head profile than the study \\(head_profile: study 2, "
                                          "this worker 3\\)"):
        search(n_trials=5, scorer=SyntheticScorer(), profile_head_units=3, storage=str(tmp_path / "t.journal"), **kw)


def test_a_study_resumed_at_another_token_layout_is_refused_or_kept_apart(tmp_path):
    """The study's identity left out the reference's measured layout: a rerun stating the same data as one
    run per modality (--context) resumed a study measured on the interleaved runs, chose by the bpv its
    trials recorded there, and exported a plan over its budget (2.71875 for 2.6)."""
    from kvplan.plans import Reference
    from tests.search.synthetic import REF

    interleaved = Reference(REF.context_len, REF.modality_mix, REF.full_precision_bits, layout=(
        ("doc", 1), ("text", 16), ("doc", 17), ("text", 16), ("doc", 17), ("text", 16), ("doc", 17), ("text", 16),
        ("doc", 908)))
    kw = dict(budget=2.6, n_candidates=6, n_local=10, progress=False, recent_lengths=(0,), residual_bits=16,
              profile=False)
    storage = str(tmp_path / "s.journal")
    search(n_trials=12, scorer=SyntheticScorer(reference=REF), storage=storage, study_name="x", **kw)
    with pytest.raises(KVPlanError, match="another budget reference than the study \\(reference.layout: study None"):
        search(n_trials=13, scorer=SyntheticScorer(reference=interleaved), storage=storage, study_name="x", **kw)
    out = tmp_path / "plan.yaml"  # the journal beside --out: each layout its own study
    first = search(n_trials=12, scorer=SyntheticScorer(reference=REF), out=out, keep_trials=True, **kw)
    other = search(n_trials=13, scorer=SyntheticScorer(reference=interleaved), out=out, keep_trials=True, **kw)
    assert other.study.study_name != first.study.study_name and other.n_real_evals == 13
    assert other.plan.bpv().total <= 2.6 and other.plan.reference.layout == interleaved.layout


def test_several_budgets_say_that_the_tightest_chooses_the_streamed_heads(capsys):
    """The streamed heads are chosen once, at the tightest budget, for every budget's plan (documented): at
    budgets 1 and 3 the 3 bpv plan kept 8 of 12 heads streamed, 16x the KL of a search at 3 alone. The
    search now says so where it says how many heads stream."""
    r = search(budget=[1.0, 3.0], n_trials=4, scorer=SyntheticScorer(), n_candidates=6, n_local=10, progress=True)
    assert r.plans[3.0].streamed_heads()
    assert "chosen at the tightest budget, 1 bpv, and stay streamed in every budget's plan" in capsys.readouterr().err


def test_a_rerun_with_another_profile_setting_gets_its_own_study(tmp_path):
    """The profile was not part of a study's identity: at layer granularity a rerun without --no-profile
    resumed the profile-less study (its setup done), never measured the profile, and exported from it."""
    kw = dict(budget=3.0, out=tmp_path / "plan.yaml", keep_trials=True, granularity="layer", progress=False,
              recent_lengths=(0,), residual_bits=16, n_candidates=4, n_local=8)
    off = search(scorer=SyntheticScorer(), profile=False, n_trials=6, **kw)
    on = search(scorer=SyntheticScorer(), profile=True, n_trials=8, **kw)
    assert on.study.study_name != off.study.study_name and on.profile is not None and on.n_profile_evals > 0
    units = search(scorer=SyntheticScorer(), profile=True, profile_head_units=1, n_trials=8, **kw)
    assert units.study.study_name not in (on.study.study_name, off.study.study_name)
    again = search(scorer=SyntheticScorer(), profile=True, n_trials=8, **kw)  # the same setup resumes its study
    assert again.study.study_name == on.study.study_name and again.n_real_evals == 0


class NonFiniteEvery(SyntheticScorer):
    """Every ``every``-th trial measurement returns a NaN KL (an fp16 overflow, a failing scorer)."""

    def __init__(self, every, **kw):
        super().__init__(**kw)
        self.every, self.trial_calls, self.nan = every, 0, 0

    def __call__(self, plan):
        res = super().__call__(plan)
        if plan.provenance.produced_by.endswith("profile"):
            return res
        self.trial_calls += 1
        if self.trial_calls % self.every:
            return res
        self.nan += 1
        return {**res, "kl": float("nan")}


def test_a_measurement_whose_kl_is_not_finite_is_kept_as_a_failed_trial_and_not_counted_as_one():
    """A NaN KL was counted among the run's real trials (29 'real trials by this run (20 in the study)' below),
    and when repair had changed the asked plan, nothing in the study said that plan was measured and failed."""
    sc = NonFiniteEvery(3)
    with pytest.warns(UserWarning, match="calibration KL is nan"):
        r = search(budget="2.8bpv", n_trials=20, seed=0, scorer=sc, **FAST)
    assert sc.nan > 0 and sc.trial_calls == 20 + sc.nan
    assert r.n_real_evals == 20 == len(r.study.get_trials(states=(TrialState.COMPLETE,)))
    assert r.n_non_finite_evals == sc.nan
    failed = [t for t in r.study.get_trials(states=(TrialState.FAIL,))
              if t.user_attrs.get("kvplan.role") == "non-finite"]
    assert len(failed) == sc.nan
    for t in failed:  # each the plan that was measured, within the budget
        assert r.space.plan_of(t.params, r.plan.reference).bpv().total == pytest.approx(t.user_attrs["kvplan.bpv"])
        assert t.user_attrs["kvplan.bpv"] <= 2.8 + 1e-9
    assert any(not t.user_attrs["kvplan.source"].startswith(("knapsack", "greedy", "baseline")) for t in failed)


def test_a_search_whose_every_kl_is_not_finite_says_so():
    with pytest.warns(UserWarning, match="measured no plan with a finite KL"):
        with pytest.raises(KVPlanError, match="the KL of each of the 21 plans measured was not finite"):
            search(budget="2.8bpv", n_trials=20, seed=0, scorer=NonFiniteEvery(1), **FAST)


def test_a_budget_that_constrains_nothing_is_warned_about_once(monkeypatch):
    """The warning came twice: from the check before the task's prefills and again from the one before the study."""
    import warnings

    import kvplan.search.scorers as scorers
    from tests.search.synthetic import GEOM, MODS, REF

    class Closing(SyntheticScorer):
        geometry, modalities, reference = GEOM, MODS, REF

        def close(self):
            pass

    def fake_task_scorers(*a, before_prefill=None, **k):
        before_prefill(GEOM, REF, MODS)
        return scorers.TaskScorers(Closing(), None, None)

    monkeypatch.setattr(scorers, "task_scorers", fake_task_scorers)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        search(budget=40.0, n_trials=2, profile=False, out=None, **FAST)
    said = [w for w in seen if "budget 40 bpv is at or above the dearest plan" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in seen]


def test_a_trial_failed_by_another_worker_while_it_is_asked_is_asked_again(monkeypatch):
    """A shared study's other worker fails an ownerless RUNNING trial as orphaned once it outlives the grace
    period; an ask slower than that (a loaded SQLite storage) ended this worker on Optuna's
    ``UpdateFinishedTrialError: Trial#16 has already finished`` (seen in a CI run)."""
    import optuna

    from kvplan.search import _search

    real_ask, calls = _search.quiet_ask, []

    def ask_lost_once(study, dists=None):
        calls.append(1)
        if len(calls) == 2:  # the second ask: its trial is failed under it, as the other worker would
            t = real_ask(study, dists)
            study.tell(t, state=optuna.trial.TrialState.FAIL)
            raise optuna.exceptions.UpdateFinishedTrialError(f"Trial#{t.number} has already finished")
        return real_ask(study, dists)

    monkeypatch.setattr(_search, "quiet_ask", ask_lost_once)
    with pytest.warns(UserWarning, match="a trial was failed by another worker while this one asked for it"):
        r = search(budget=3.0, n_trials=6, scorer=SyntheticScorer(), out=None, **FAST)
    assert r.plan is not None and len(calls) >= 3
