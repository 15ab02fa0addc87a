"""The kvplan console script, run for real in a subprocess."""

import os
import subprocess
import sys

import pytest

from kvplan import Geometry, baseline_plan

GEOM = Geometry(30, 3, 64, ("full",) * 30, "llama")


def _kvplan(*args, timeout=600):
    exe = os.path.join(os.path.dirname(sys.executable), "kvplan")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)


def test_validate_good_plan(tmp_path):
    path = tmp_path / "p.yaml"
    baseline_plan("k4v2", GEOM).to_yaml(path)
    r = _kvplan("validate", str(path))
    assert r.returncode == 0, r.stderr
    assert "valid kvplan plan for llama" in r.stdout and "honest bpv 4.3750" in r.stdout


@pytest.mark.parametrize("content,fragment", [
    ("schema_version: 1\nmodel: {}\nbits: {default: 4}\n", "model.model_type: missing required key"),
    ("not: [valid\n", "<yaml>: not valid YAML"),
    (None, "bits.default: must be one of"),
])
def test_validate_bad_plan_one_line_exit_2(tmp_path, content, fragment):
    path = tmp_path / "bad.yaml"
    if content is None:
        content = baseline_plan("int4", GEOM).to_yaml().replace("default: 4", "default: 5")
    path.write_text(content)
    r = _kvplan("validate", str(path))
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert lines[0].startswith(f"kvplan: error: {path}: ") and fragment in lines[0]


def test_missing_plan_file_exit_2(tmp_path):
    r = _kvplan("validate", str(tmp_path / "nope.yaml"))
    assert r.returncode == 2 and "cannot read plan file" in r.stderr


@pytest.mark.slow
def test_generate_on_default_model_prints_reply_and_bytes():
    r = _kvplan("generate", "--plan", "k4v2", "--max-new-tokens", "12")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "reply:" in r.stdout
    line = next(x for x in r.stdout.splitlines() if x.startswith("kvplan cache:"))
    bpv = float(line.split(" = ")[-1].split()[0])
    # k4v2 over an ~890-token prompt: 4/2-bit codes + fp16 scales, plus the 128-token fp32 residual
    assert 4 < bpv < 10
    native = next(x for x in r.stdout.splitlines() if x.startswith("without kvplan this model caches float32"))
    assert abs(float(native.split("uses ")[1].split("%")[0]) - 100 * bpv / 32) < 0.1  # vs 32-bit values


@pytest.mark.slow
def test_plan_for_other_model_rejected_with_field(tmp_path):
    path = tmp_path / "other.yaml"
    baseline_plan("int4", Geometry(30, 3, 64, ("full",) * 30, "qwen2")).to_yaml(path)
    r = _kvplan("validate", str(path), "--model", "smollm2-135m")
    assert r.returncode == 2
    assert "model.model_type: plan was made for 'qwen2' but the model has 'llama'" in r.stderr


def test_eval_refuses_a_plan_for_another_model_before_the_prefills(tmp_path, monkeypatch):
    """The geometry check came only when the first sample was scored, after every full-precision prefill."""
    from kvplan.errors import PlanError
    from kvplan.evaluation import runs

    path = tmp_path / "other.yaml"
    baseline_plan("int4", Geometry(30, 3, 64, ("full",) * 30, "qwen2")).to_yaml(path)

    def no_prefill(*a, **k):
        raise AssertionError("prefilled before the plan was checked against the model")

    monkeypatch.setattr(runs, "prepare_samples", no_prefill)
    with pytest.raises(PlanError, match="other.yaml: .*model.model_type: plan was made for 'qwen2'"):
        runs.run_eval(path, samples=1, progress=False, verbose=False)


@pytest.mark.slow
def test_search_then_explain_then_load(tmp_path, smollm2):
    import json

    import kvplan
    from kvplan import Plan

    out = tmp_path / "plan.yaml"
    r = _kvplan("--threads", "1", "search", "--budget", "3.5bpv", "--samples", "2", "--validation-samples", "2", "--test-samples", "2",
                "--history-tokens", "96", "--eval-tokens", "8", "--trials", "4", "--head-profile", "0", "--quiet",
                "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    plan = Plan.from_yaml(out)
    # 30 layers x K/V + keys with/without correction + the lowest plan with 0 / 4 / 8 recent copies, and the
    # streaming profile (on by default: each of the 30 x 3 KV heads streamed alone) and its calibration
    # (the damage model's optimum scored in two parts)
    assert plan.metrics["search"]["n_profile_evals"] == 65 + 90 + 2
    assert plan.bpv().total <= 3.5 and plan.target_bpv == 3.5
    assert plan.provenance.produced_by.startswith("kvplan search")
    assert plan.metrics["test"]["kl"] > 0 and plan.metrics["validation"]["kl"] > 0
    assert plan.feedback_metric is not None  # error feedback is on by default (--no-error-feedback)
    r = _kvplan("explain", str(out), "--format", "json", "--figures", str(tmp_path / "fig"))
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["error_feedback"] is True
    assert report and (tmp_path / "fig").is_dir() and any(p.suffix == ".png" for p in (tmp_path / "fig").iterdir())
    model, tok = smollm2
    from kvplan.evaluation.tasks import doc_sources

    prompt = tok(doc_sources()[0][1][:1500], return_tensors="pt")  # a few hundred tokens: whole groups commit
    kvplan.load(model, str(out))
    try:
        gen = model.generate(**prompt, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    finally:
        kvplan.unload(model)
    T = gen.cache.get_seq_length()
    assert gen.sequences.shape[1] == prompt.input_ids.shape[1] + 4 == T + 1
    assert min(layer.committed for layer in gen.cache.layers) >= plan.quantizer.group_size  # codes were written
    assert gen.cache.bpv() == plan.bpv(context_len=T).total  # the plan's accounting, on the deployed cache


@pytest.mark.slow
def test_a_budget_given_twice_is_refused_before_it_can_overwrite_an_input(tmp_path, capsys):
    """``--budget 3 3 --task t.jsonl --out t.jsonl`` passed the check that --out is no input (it checked the
    two budgets' files, t-3bpv.jsonl) and the export, one plan per distinct budget, wrote t.jsonl itself."""
    from kvplan.cli import main

    task = tmp_path / "t.jsonl"
    task.write_text('{"history": "h", "question": "q"}\n')
    before = task.read_bytes()
    assert main(["search", "--quiet", "--budget", "3", "3bpv", "--task", str(task), "--out", str(task)]) == 2
    err = capsys.readouterr().err
    assert "budget 3 bpv is given more than once (3, 3): each budget gets one plan" in err
    assert len(err.strip().splitlines()) == 1 and task.read_bytes() == before


@pytest.mark.parametrize("command", [["search"], ["eval", "int4"], ["sweep"]])
@pytest.mark.parametrize("seed", ["-1", "4294967296"])
def test_a_seed_numpy_cannot_take_is_one_line_before_any_work(monkeypatch, capsys, command, seed):
    """--seed -1 (or 2**32) loaded the model, ran the whole search or evaluation, then failed in numpy's or
    Optuna's generator with an internal-error traceback; --seed 4294967295 crashed on a resume."""
    import kvplan.models
    from kvplan.cli import main

    def no_work(*a, **k):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(kvplan.models, "load_model", no_work)
    with pytest.raises(SystemExit) as e:  # argparse's one line
        main(command + ["--quiet", "--seed", seed])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1
    assert f"argument --seed: must be at {'least 0' if seed == '-1' else 'most 4294967295'}, got {seed}" in err


def test_a_context_length_no_plan_can_state_is_one_line_before_the_model_loads(monkeypatch, capsys):
    """--context 99999999999 loaded the model and the task (about 30 s here) before the plan's own check refused
    budget.reference.context_len."""
    import kvplan.models
    from kvplan.cli import main

    def no_work(*a, **k):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(kvplan.models, "load_model", no_work)
    with pytest.raises(SystemExit) as e:
        main(["search", "--quiet", "--context", "99999999999"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "argument --context: must be at most 16777216, got 99999999999" in err


def test_the_search_api_refuses_a_seed_out_of_range_and_resumes_at_the_largest():
    from kvplan.errors import KVPlanError
    from kvplan.search import search
    from tests.search.synthetic import SyntheticScorer

    fast = dict(budget=3.0, n_trials=3, scorer=SyntheticScorer(), out=None, profile=False, progress=False,
                n_candidates=4, n_local=8)
    with pytest.raises(KVPlanError, match="seed: must be a whole number from 0 to 4294967295, got -1"):
        search(seed=-1, **fast)
    assert search(seed=4294967295, **fast).n_real_evals == 3


def test_search_budget_below_cheapest_fails_fast():
    r = _kvplan("search", "--budget", "0.1bpv", "--samples", "2", "--history-tokens", "96", "--quiet")
    assert r.returncode == 2
    assert "cheapest reachable plan" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("value,expected", [("all", None), ("0", 0), ("7", 7), (None, "unset")])
def test_search_head_profile_option_reaches_the_search(monkeypatch, tmp_path, value, expected):
    """``--head-profile all`` asks for every unit (``None``), a number for that many; without it the
    search's own default applies (the option passes nothing)."""
    import kvplan.search
    from kvplan.cli import main

    seen = []
    monkeypatch.setattr(kvplan.search, "search", _fake_search(seen))
    argv = ["search", "--quiet", "--out", str(tmp_path / "p.yaml")] + ([] if value is None else ["--head-profile", value])
    assert main(argv) == 0
    assert seen[-1].get("profile_head_units", "unset") == expected


@pytest.mark.parametrize("flags,refused", [
    (["--stream-window", "0"], None), (["--stream-window", "0", "--value-scaling", "minmax-fp16"], "2.3750"),
    (["--stream-window", "0", "--key-scaling", "absmax-e4m3", "--budget", "2.15bpv"], None),
    (["--stream-window", "0", "--budget", "2.15bpv"], "2.1875"),
    (["--budget", "2.15bpv"], None),  # the default search streams KV heads, which go lower
    (["--budget", "2.15bpv", "--no-profile"], "2.1875"),  # ... chosen from the profile
    (["--budget", "0.2bpv"], "0.2822")])
def test_search_budget_check_before_prefill_uses_the_searched_formats(monkeypatch, tmp_path, capsys, flags, refused):
    """The budget check before the prefill reads the space search() will search (formats and streamed heads
    included): without streaming the default formats reach 2.1875 bpv on the default model's geometry (values
    absmax-e4m3), fp16 value scales 2.3750, and every head streamed 0.2822; it once used fp16 scales for values
    and no streaming whatever the search would use, refusing 2.3 bpv."""
    import kvplan.search.scorers
    from kvplan.cli import main
    from kvplan.plans import Reference

    geometry = Geometry(30, 3, 64, ("full",) * 30, "llama")  # SmolLM2-135M's

    reached = []

    def fake_scorers(*a, before_prefill=None, **k):
        before_prefill(geometry, Reference(512, (("text", 1.0),)), ("text",))
        reached.append(True)  # the budget passed the check: the prefills would start here
        raise RuntimeError("no prefill in this test")

    monkeypatch.setattr(kvplan.search.scorers, "task_scorers", fake_scorers)
    rc = main(["search", "--quiet", "--budget", "2.3bpv", "--out", str(tmp_path / "p.yaml")] + flags)
    err = capsys.readouterr().err
    if refused is None:
        assert reached and "no prefill in this test" in err and "cheapest reachable plan" not in err, err
    else:
        assert rc == 2 and not reached and "cheapest reachable plan" in err and refused in err, err


def test_search_refuses_a_stream_window_without_a_profile_before_the_prefill(monkeypatch, tmp_path, capsys):
    import kvplan.search.scorers
    from kvplan.cli import main
    from kvplan.plans import Reference

    def fake_scorers(*a, before_prefill=None, **k):
        before_prefill(Geometry(30, 3, 64, ("full",) * 30, "llama"), Reference(512, (("text", 1.0),)), ("text",))
        raise AssertionError("prefill reached")

    monkeypatch.setattr(kvplan.search.scorers, "task_scorers", fake_scorers)
    rc = main(["search", "--quiet", "--stream-window", "8", "--no-profile", "--out", str(tmp_path / "p.yaml")])
    err = capsys.readouterr().err
    assert rc == 2 and "stream_window: streamed heads are chosen from the sensitivity profile" in err, err


def test_search_head_profile_rejects_a_negative_count():
    r = _kvplan("search", "--head-profile", "-1")
    assert r.returncode == 2 and "--head-profile" in r.stderr and "must be at least 0" in r.stderr


def _unchanged_after(path, run):
    """Run ``run()`` and assert the file at ``path`` holds the same bytes afterwards; returns what it returned."""
    before = path.read_bytes()
    out = run()
    assert path.read_bytes() == before
    return out


@pytest.mark.parametrize("case", ["explain --html plan", "explain --html trials", "eval --out plan",
                                  "search --out storage", "search --out task", "search --out storage, 2 budgets"])
def test_no_command_writes_over_its_own_input(monkeypatch, tmp_path, capsys, case):
    """A file a command would write that is one of its inputs is refused before any work (one line, exit 2),
    and the input is left as it was."""
    import kvplan.evaluation.runs
    import kvplan.search.scorers
    from kvplan.cli import main

    def no_work(*a, **k):
        raise AssertionError("the work started")

    monkeypatch.setattr(kvplan.search.scorers, "task_scorers", no_work)
    monkeypatch.setattr(kvplan.evaluation.runs, "_prepared_task", no_work)
    plan = tmp_path / "p.yaml"
    baseline_plan("int4", Geometry(30, 3, 64, ("full",) * 30, "llama")).to_yaml(plan)
    trials = tmp_path / "p.trials.csv"
    trials.write_text("number,kl\n")
    task = tmp_path / "t.jsonl"
    task.write_text('{"history": "x", "question": "q", "choices": ["a", "b"], "answer": 0}\n')
    journal = tmp_path / "j.log"
    search = ["search", "--quiet", "--trials", "1", "--no-profile"]
    argv, target, what, option = {
        "explain --html plan": (["explain", str(plan), "--no-importance", "--html", str(plan)], plan, "plan",
                                "--html"),
        "explain --html trials": (["explain", str(plan), "--no-importance", "--html", str(trials)], trials,
                                  "trial history", "--html"),
        "eval --out plan": (["eval", str(plan), "--samples", "1", "--quiet", "--out", str(plan)], plan, "plan",
                            "--out"),
        "search --out storage": (search + ["--storage", str(journal), "--study-name", "s", "--out", str(journal)],
                                 journal, "storage", "--out"),
        "search --out task": (search + ["--budget", "3", "--task", str(task), "--out", str(task)], task, "task file",
                              "--out"),
        "search --out storage, 2 budgets": (search + ["--budget", "3", "2.5", "--storage", str(tmp_path / "p-3bpv.log"),
                                                      "--study-name", "s", "--out", str(tmp_path / "p.log")],
                                            tmp_path / "p-3bpv.log", "storage", "--out's 3 bpv plan"),
    }[case]
    if not target.exists():  # the journal: made when the storage opens
        target.write_text("")
    rc = _unchanged_after(target, lambda: main(argv))
    err = capsys.readouterr().err
    assert rc == 2 and f"is the {what} this run reads" in err and "would overwrite" in err, err
    assert err.startswith(f"kvplan: error: {option} {target}: "), err  # the option, not an internal name
    assert len(err.strip().splitlines()) == 1


def test_argument_errors_come_before_the_work(monkeypatch, tmp_path, capsys):
    """sweep's --out-dir, eval's plan file and peer bits, search's journal and generate's token count are
    checked before any model loads: one line, exit 2, no traceback."""
    import kvplan.evaluation.runs
    import kvplan.models
    from kvplan.cli import main

    def no_work(*a, **k):
        raise AssertionError("the work started")

    monkeypatch.setattr(kvplan.evaluation.runs, "_prepared_task", no_work)
    monkeypatch.setattr(kvplan.models, "load_model", no_work)  # the search's scorer loads its model by it
    a_file = tmp_path / "results"
    a_file.write_text("not a folder")
    journal = tmp_path / "bad.log"
    journal.write_text('{"op_code": 0, "worker_id": "w", "study_name": "s"\n')  # a line cut off mid-object
    for argv, fragment in [
        (["sweep", "--samples", "1", "--quiet", "--out-dir", str(a_file)], "exists and is not a directory"),
        (["eval", str(tmp_path / "none.yaml"), "--samples", "1", "--quiet"], "none.yaml"),
        (["eval", "quanto-int3", "--samples", "1", "--quiet"], "stores [2, 4] bits, not 3"),
        (["search", "--quiet", "--storage", str(journal), "--study-name", "s", "--out", str(tmp_path / "p.yaml")],
         "line 1 is not an Optuna journal record"),
        (["search", "--budget", "-1"], "budget must be a positive number"),
        (["search", "--quiet", "--out", str(a_file / "p.yaml")], f"--out {a_file / 'p.yaml'}: cannot write into"),
        (["eval", "int4", "--samples", "1", "--quiet", "--out", str(a_file / "e.json")], "cannot write into"),
        (["eval", "int4", "--split", "all", "--samples", "1", "--quiet"], "split 'all' is for JSONL tasks"),
        # an empty path, or one naming a folder, used to pass here and crash once the work was done
        (["search", "--quiet", "--out", f"{tmp_path / 'new'}/"], f"--out {tmp_path / 'new'}/: ends with a path sep"),
        (["search", "--quiet", "--out", ""], "--out: the path is empty"),
        (["eval", "int4", "--samples", "1", "--quiet", "--out", f"{tmp_path}/"], "ends with a path separator"),
        (["eval", "int4", "--samples", "1", "--quiet", "--out", ""], "--out: the path is empty"),
        (["sweep", "--samples", "1", "--quiet", "--out-dir", ""], "--out-dir: the path is empty"),
        (["sweep", "--split", "all", "--samples", "1", "--quiet"], "split 'all' is for JSONL tasks"),
    ]:
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2 and fragment in err and "Traceback" not in err, (argv, err)
    # whole JSON lines that are no journal record failed inside Optuna's replay, as internal errors
    for line, why in [("1", "not an object with a known op_code"), ('{"op_code": 99, "worker_id": "w"}', "known op_"),
                      ("[" * 100_000 + "]" * 100_000, "recursion")]:
        journal.write_text(line + "\n")
        rc = main(["search", "--quiet", "--storage", str(journal), "--study-name", "s",
                   "--out", str(tmp_path / "p.yaml")])
        err = capsys.readouterr().err
        assert rc == 2 and "line 1 is not an Optuna journal record" in err and why in err, err
    # a FIFO where a journal is read blocked the search forever (after the model load, beside --out)
    fifo_dir = tmp_path / "fifo"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "plan.journal")
    os.mkfifo(fifo_dir / "s.journal")
    for argv, fragment in [
        (["search", "--quiet", "--out", str(fifo_dir / "plan.yaml")],
         f"--out's study journal {fifo_dir / 'plan.journal'}: is a FIFO, not a journal file"),
        (["search", "--quiet", "--storage", str(fifo_dir / "s.journal"), "--study-name", "s",
          "--out", str(tmp_path / "q.yaml")], f"--storage {fifo_dir / 's.journal'}: is a FIFO, not a journal file"),
    ]:
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2 and fragment in err and len(err.strip().splitlines()) == 1, (argv, err)
    for option in (["generate", "--max-new-tokens", "0"], ["search", "--key-correction-rank", "-1"]):
        with pytest.raises(SystemExit) as e:
            main(option)
        assert e.value.code == 2 and "must be at least" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--granularity", "layer"], ["--no-profile"]])
def test_search_head_profile_where_no_head_is_profiled_is_refused(capsys, flags):
    """--head-profile asks the profile to measure KV heads; a layer-granularity search or one without a
    profile measures none, so the option would be ignored: refused in one line instead."""
    from kvplan.cli import main

    assert main(["search", "--quiet", "--head-profile", "5"] + flags) == 2
    err = capsys.readouterr().err
    assert "--head-profile 5: the profile measures KV heads one by one only" in err and flags[-1] in err


def _fake_search(seen=None, **result):
    """A stand-in for kvplan.search.search that records its keyword arguments in ``seen``; ``result``: fields
    of its SearchResult other than the defaults."""
    import types

    def fake(**kwargs):
        if seen is not None:
            seen.append(kwargs)
        fields = dict(finalized_by=None, plans={}, paths={}, n_real_evals=0, n_study_trials=0, n_profile_evals=0,
                      n_non_finite_evals=0, elapsed_s=0.0, study=types.SimpleNamespace(study_name="s"))
        return types.SimpleNamespace(**{**fields, **result})
    return fake


def test_search_says_how_many_measurements_were_not_finite(monkeypatch, tmp_path, capsys):
    """They were counted among the real trials, which then read '29 real trials by this run (20 in the study)'."""
    import kvplan.search
    from kvplan.cli import main

    monkeypatch.setattr(kvplan.search, "search", _fake_search(n_real_evals=20, n_study_trials=20, n_non_finite_evals=9))
    assert main(["search", "--quiet", "--out", str(tmp_path / "p.yaml")]) == 0
    out = capsys.readouterr().out
    assert "20 real trials (and 9 measurement(s) whose KL was not finite, kept as FAILed trials)" in out


def test_search_keeps_its_study_in_a_journal_beside_out_unless_told_not_to(monkeypatch, tmp_path, capsys):
    import kvplan.search
    from kvplan.cli import main

    seen = []
    monkeypatch.setattr(kvplan.search, "search", _fake_search(seen))
    assert main(["search", "--quiet", "--out", str(tmp_path / "p.yaml")]) == 0
    assert seen[-1]["keep_trials"] and f"kept in {tmp_path / 'p.journal'}: the same command resumes it" in \
        capsys.readouterr().out
    assert main(["search", "--quiet", "--no-journal", "--out", str(tmp_path / "p.yaml")]) == 0
    assert not seen[-1]["keep_trials"] and "kept in" not in capsys.readouterr().out
    assert main(["search", "--quiet", "--storage", str(tmp_path / "s.journal"), "--out", str(tmp_path / "p.yaml")]) == 0
    assert seen[-1]["storage"] is not None and "kept in" not in capsys.readouterr().out


@pytest.mark.parametrize("export,paths,says", [
    ("elsewhere", {}, "finalized by another worker (host h, pid 7, worker None), which wrote"),
    ("rewritten", {"plan": "p.yaml"}, "its plan files were missing here and are written again"),
    ("in place", {"plan": "p.yaml"}, "by this command; its plan files are in place, as recorded")])
def test_search_says_who_exported_a_finished_study_and_whether_it_was_written_again(monkeypatch, capsys, export,
                                                                                    paths, says):
    """A finished study's export reused: written by another worker, or this command's own earlier run, whose
    missing files were written again here or are still in place (both were reported as another worker's)."""
    import types

    import kvplan.search
    from kvplan.cli import main

    result = types.SimpleNamespace(finalized_by={"host": "h", "pid": 7}, plans={}, paths=paths, n_real_evals=0,
                                   n_study_trials=5, n_profile_evals=0, n_non_finite_evals=0, elapsed_s=0.0,
                                   study=types.SimpleNamespace(study_name="s"), export=export)
    monkeypatch.setattr(kvplan.search, "search", lambda **kw: result)
    assert main(["search", "--quiet", "--no-journal"]) == 0
    assert says in capsys.readouterr().out


def test_quiet_turns_off_transformers_progress_bars(monkeypatch, tmp_path):
    """--quiet also silences transformers' own bars (its "Loading weights" bar when a model loads)."""
    import kvplan.search
    from kvplan.cli import main
    from transformers.utils import logging as transformers_logging

    monkeypatch.setattr(kvplan.search, "search", _fake_search())
    transformers_logging.enable_progress_bar()
    try:
        assert main(["search", "--out", str(tmp_path / "p.yaml")]) == 0
        assert transformers_logging.is_progress_bar_enabled()
        assert main(["search", "--quiet", "--out", str(tmp_path / "p.yaml")]) == 0
        assert not transformers_logging.is_progress_bar_enabled()
    finally:
        transformers_logging.enable_progress_bar()


@pytest.mark.parametrize("field, kind", [("images", "image"), ("video", "frame")])
def test_a_missing_image_of_a_task_record_is_named_before_any_model_loads(monkeypatch, tmp_path, capsys, field, kind):
    """Media paths used to be opened only once the model had loaded and the prompts were built."""
    import json

    import kvplan.models
    from kvplan.cli import main

    def no_work(*a, **k):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(kvplan.models, "load_model", no_work)
    (tmp_path / "there.png").write_bytes(b"")  # exists: only the missing one is named
    recs = [{"history": f"h{i}", "question": "q", field: ["there.png"]} for i in range(7)]
    recs.append({"history": "h", "question": "q", field: ["there.png", "nope.png"]})
    (tmp_path / "task.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["search", "--quiet", "--task", str(tmp_path / "task.jsonl"), "--out", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"task.jsonl:8: field '{field}': {kind} file not found: {tmp_path / 'nope.png'}" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("plan", ["does-not-exist.yaml", "int5"])
def test_generate_checks_its_plan_before_the_model_loads(monkeypatch, tmp_path, capsys, plan):
    """``kvplan generate --plan missing.yaml`` (or an unknown baseline name) loaded the model first."""
    import kvplan.models
    from kvplan.cli import main

    def no_work(*a, **k):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(kvplan.models, "load_model", no_work)
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "--plan", plan]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvplan: error: {plan}: ") and "plan file" in err and len(err.strip().splitlines()) == 1


BUILT_IN = "not a built-in plan: fp16, int8, int4, int2, k4v2 (optionally with -g32/-g64/-g128)"


def test_plan_names_and_task_lengths_are_checked_before_the_model_loads(monkeypatch, tmp_path, capsys):
    """A baseline with a group size plans do not take (``int4-g7``) failed after the model load and the
    prefills, without its name; ``4``, ``-`` or ``int3`` read as YAML gave '<root>: must be a mapping (got 4)';
    ``--history-tokens`` / ``--eval-tokens`` given with a JSONL task were ignored without a word."""
    import kvplan.evaluation.runs
    import kvplan.models
    from kvplan.cli import main

    def no_work(*a, **k):
        raise AssertionError("the work started")

    monkeypatch.setattr(kvplan.evaluation.runs, "_prepared_task", no_work)
    monkeypatch.setattr(kvplan.models, "load_model", no_work)
    monkeypatch.chdir(tmp_path)
    task = tmp_path / "t.jsonl"
    task.write_text("".join(f'{{"history": "Record {i} holds {7 * i}.", "question": "Which?", "answer": "{7 * i}"}}\n'
                            for i in range(8)))
    group = "plan: group size 7 is not one plans take (32, 64 or 128) (got 'int4-g7')"
    lengths = (f"history_tokens=100 (--history-tokens): sets the built-in task's samples only; the records of the "
               f"task file {task} hold their own history and evaluated tokens")
    for argv, message in [
        (["eval", "int4-g7", "--samples", "1", "--quiet"], group),
        (["generate", "--plan", "int4-g7"], group),
        (["generate", "--plan", "k4v2-g0"], "plan: group size 0 is not one plans take (32, 64 or 128) (got 'k4v2-g0')"),
        (["eval", "4", "--samples", "1", "--quiet"], f"4: no such plan file, and {BUILT_IN}; also headguard, "
                                                     "quanto-int2/4, hqq-int1/2/3/4/8"),
        (["eval", "INT4", "--samples", "1", "--quiet"], f"INT4: no such plan file, and {BUILT_IN}; also "),
        (["generate", "--plan", "int3"], f"int3: no such plan file, and {BUILT_IN}"),
        (["validate", "-"], "-: no such plan file (nor the YAML text of a plan)"),
        (["validate", "4"], "4: no such plan file (nor the YAML text of a plan)"),
        (["eval", "int4", "--task", str(task), "--history-tokens", "100", "--quiet"], lengths),
        (["sweep", "--task", str(task), "--history-tokens", "100", "--quiet"], lengths),
        (["search", "--task", str(task), "--history-tokens", "100", "--quiet", "--no-journal",
          "--out", str(tmp_path / "p.yaml")], lengths),
        (["search", "--task", str(task), "--eval-tokens", "3", "--quiet", "--no-journal",
          "--out", str(tmp_path / "p.yaml")], lengths.replace("history_tokens=100 (--history-tokens)",
                                                              "eval_tokens=3 (--eval-tokens)")),
    ]:
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith(f"kvplan: error: {message}"), (argv, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "p.yaml").exists()


def test_the_built_in_task_says_which_length_leaves_too_few_windows():
    """'only 0 windows of 100478 tokens ... ask for fewer samples or a shorter history' when the evaluated
    tokens were what was too long."""
    from kvplan.errors import KVPlanError
    from kvplan.evaluation.tasks import default_task_samples
    from kvplan.models import load_model

    _, tok = load_model()
    with pytest.raises(KVPlanError) as e:
        default_task_samples(tok, split="test", n=1, eval_tokens=100_000)
    assert "(a 4" in str(e.value) and "-token document window of the 512-token history + 100000 evaluated tokens)" \
        in str(e.value) and "fewer evaluated tokens (--eval-tokens)" in str(e.value)


def test_a_full_disk_under_stdout_is_one_line_not_an_internal_error(tmp_path):
    """`kvplan validate plan.yaml > /dev/full` printed a traceback and "internal error: this is a bug"."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    plan = tmp_path / "p.yaml"
    baseline_plan("int4", Geometry(2, 2, 64, ("full", "full"), "llama")).to_yaml(plan)
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "kvplan.cli", "validate", str(plan)], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == ("kvplan: error: cannot write: No space left on device (a search "
                                "keeps its finished trials in its journal; the same command resumes it once there "
                                "is room)")


def test_sigterm_stops_a_command_as_ctrl_c_does():
    """SIGTERM killed a search without its Ctrl-C path: no message, the journal lock left behind (the next run
    waited 30 s for it) and the held trials not given back. It now raises like Ctrl-C, and says so."""
    script = ("import os, signal, sys, time\n"
              "import kvplan.cli as cli\n"
              "def work(args):\n"
              "    try:\n"
              "        os.kill(os.getpid(), signal.SIGTERM)\n"
              "        time.sleep(30)\n"
              "    finally:\n"
              "        print('cleanup ran', flush=True)\n"
              "cli._cmd_validate = work\n"
              "sys.exit(cli.main(['validate', 'any.yaml']))\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 143 and "cleanup ran" in r.stdout, (r.returncode, r.stderr)
    assert r.stderr.strip() == "kvplan: terminated (SIGTERM)"


def test_forked_sample_workers_end_on_sigterm_as_by_default():
    """The CLI's SIGTERM handler (raise like Ctrl-C) was inherited by the forked sample workers, whose parent stops
    them with terminate() (SIGTERM) on its error paths: they would unwind through the handler instead of ending."""
    script = ("import signal, sys\n"
              "import kvplan.cli as cli\n"
              "from kvplan.evaluation.parallel import map_forked\n"
              "cli._raise_on_sigterm()\n"
              "def handler_here(_):\n"
              "    return signal.getsignal(signal.SIGTERM) is signal.SIG_DFL\n"
              "print(map_forked(handler_here, [0, 1, 2, 3], processes=2), handler_here(0))\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    results, parent = r.stdout.strip().rsplit(" ", 1)
    assert parent == "False" and "True" in results, r.stdout  # the workers' items: default; the parent's: the CLI's
