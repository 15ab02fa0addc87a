"""kvplan search on the user's own data: a text JSONL task (CLI) and a tiny-VLM JSONL task with
real images (Python API), each exported plan deployed through kvplan.load at its stated bpv."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow


def _kvplan(*args, timeout=900):
    exe = os.path.join(os.path.dirname(sys.executable), "kvplan")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)


def _text_task(path, n=9):
    from kvplan.evaluation.tasks import doc_sources

    recs = []
    for name, text in doc_sources()[:n]:
        recs.append({"id": name, "history": text[:900], "question": "Which Python topic is this section about?",
                     "answer": name})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_cli_search_on_a_text_jsonl_task_deploys_at_its_bpv(tmp_path):
    import kvplan
    from kvplan.evaluation import get_model, read_jsonl, split_records
    from kvplan.evaluation.tasks import task_file_digest

    task = _text_task(tmp_path / "docs.jsonl")
    out = tmp_path / "plan.yaml"
    # the ~200-token records would make a 3 bpv budget unreachable (their fp32 tail of a partial group);
    # the budget is stated at the deployment context instead
    r = _kvplan("--threads", "1", "search", "--task", str(task), "--budget", "3bpv", "--context", "2048",
                "--samples", "2", "--trials", "4", "--no-profile", "--quiet", "--out", str(out), "--seed", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    plan = kvplan.Plan.from_yaml(out)
    assert plan.metrics["search"]["n_profile_evals"] == 0  # --no-profile
    assert plan.modalities == ("text",) and plan.bpv().total <= 3 and plan.reference.context_len == 2048
    assert plan.metrics["test"]["n_samples"] == 2 and plan.metrics["validation"]["n_samples"] == 2
    assert plan.metrics["search"]["task"] == {"name": str(task), "sha256": task_file_digest(task)}
    assert plan.metrics["search"]["seed"] == 3
    # kvplan eval, no --seed: the plan's own test split (seed 0 would split the records another way, and
    # could measure the plan on records the search calibrated on), also from a copy of the task file
    from kvplan.evaluation import run_eval

    copy = tmp_path / "elsewhere" / "renamed.jsonl"
    copy.parent.mkdir()
    copy.write_bytes(task.read_bytes())
    for spelled in (task, copy):
        measured = run_eval(out, task=str(spelled), progress=False, verbose=False)
        assert measured["task"]["seed"] == 3 and measured["kl"]["mean"] == plan.metrics["test"]["kl"], spelled
    model, tok = get_model()
    # a test record, as a user would run it: kvplan.load, then generate on its history
    rec = split_records(read_jsonl(task), "test", seed=3)[0]
    inputs = tok(rec["history"], return_tensors="pt")
    kvplan.load(model, out)
    try:
        gen = model.generate(**inputs, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    finally:
        kvplan.unload(model)
    T = gen.cache.get_seq_length()
    assert gen.cache.bpv() == plan.bpv(context_len=T).total  # bytes held == the plan's accounting at T


def test_library_search_refuses_an_unreachable_budget_before_the_prefill(monkeypatch):
    """kvplan.search() building its own scorers checks the budget once the task's layout is known, before
    the full-precision prefills (as the CLI does), on the space it would search."""
    from kvplan.evaluation import get_model, harness
    from kvplan.search import BudgetError, search

    def prefill(*a, **k):
        raise AssertionError("prefilled before the budget check")

    monkeypatch.setattr(harness, "prepare_samples", prefill)
    with pytest.raises(BudgetError, match=r"0\.1 bpv.*cheapest"):
        search(get_model(), budget="0.1bpv", n_trials=2, progress=False)
    with pytest.raises(BudgetError, match=r"2\.1 bpv.*cheapest"):  # no streaming: every slot at 2 bits is the floor
        search(get_model(), budget="2.1bpv", n_trials=2, progress=False, stream_window=0)


def test_library_search_stops_the_scorers_it_built_when_it_fails(tmp_path, monkeypatch):
    """An error after search() built its scorers (here: finalize without a study to finalize) still stops
    their worker processes."""
    from kvplan.errors import KVPlanError
    from kvplan.evaluation import get_model
    from kvplan.search import scorers, search

    closed = []
    monkeypatch.setattr(scorers.HarnessScorer, "close", lambda self: closed.append(self.name))
    task = _text_task(tmp_path / "docs.jsonl")
    with pytest.raises(KVPlanError, match="finalize: needs the --storage"):
        search(get_model(), budget="3bpv", task=str(task), context_len=2048, n_trials=2, profile=False,
               progress=False, finalize=True)
    assert sorted(closed) == ["calibration", "test", "validation"]


def test_library_search_takes_the_sample_counts_the_cli_offers(monkeypatch):
    """search(samples=, validation_samples=, test_samples=, history_tokens=, eval_tokens=) shapes the
    scorers it builds, as the CLI's options of the same names do (the CLI passes them through); with
    your own scorer they are refused."""
    from kvplan.errors import KVPlanError
    from kvplan.evaluation import get_model
    from kvplan.search import scorers, search

    real, asked = scorers.task_scorers, []
    monkeypatch.setattr(scorers, "task_scorers", lambda *a, **k: asked.append(k) or real(*a, **k))
    result = search(get_model(), budget="3bpv", context_len=2048, n_trials=2, profile=False, progress=False,
                    samples=2, validation_samples=1, test_samples=1, history_tokens=200, eval_tokens=8)
    assert {k: asked[0][k] for k in ("n_calibration", "n_validation", "n_test", "history_tokens", "eval_tokens")} \
        == {"n_calibration": 2, "n_validation": 1, "n_test": 1, "history_tokens": 200, "eval_tokens": 8}
    m = result.plan.metrics
    assert m["validation"]["n_samples"] == 1 and m["test"]["n_samples"] == 1
    with pytest.raises(KVPlanError, match="samples= .* shape the scorers search builds"):
        search(get_model(), budget="3bpv", scorer=lambda plan: {"kl": 0.0}, samples=4)


@pytest.mark.parametrize("keyword,value", [("samples", 0), ("samples", -1), ("samples", 2.5), ("samples", True),
                                           ("validation_samples", -1), ("test_samples", "4"),
                                           ("history_tokens", 0), ("eval_tokens", -3)])
def test_library_search_refuses_a_bad_sample_count_in_one_line(monkeypatch, keyword, value):
    """A bad count is named before any data or model is touched (samples=-1 once ran, sliced from the end)."""
    from kvplan.errors import KVPlanError
    from kvplan.search import scorers, search

    monkeypatch.setattr(scorers, "task_scorers", lambda *a, **k: pytest.fail("scorers built"))
    expected = "^" + re.escape(f"{keyword}={value!r}") + ": must be an integer of at least [01]$"
    with pytest.raises(KVPlanError, match=expected):
        search("smollm2-135m", budget="2.5bpv", n_trials=2, progress=False, **{keyword: value})


def _main_error(capsys, *argv):
    """``kvplan <argv>`` in-process: (exit status, stderr lines)."""
    from kvplan.cli import main

    code = main(list(argv))
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("bad,fragment", [
    ('{"history": "x"}\n', "missing field 'question'"),
    ('{"history": "x", "question": "q", "answer": "z", "choices": ["a", "b"]}\n', "answer is not one of the choices"),
    ('{"history": 3, "question": "q"}\n', "field 'history' must be a non-empty string"),
    ("not json\n", "not valid JSON"),
    ('{"history": "x", "question": "q", "video": []}\n', "field 'video' must be a non-empty list of frame image paths"),
    (None, "task file not found"),
])
def test_bad_task_file_is_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch, bad, fragment):
    import kvplan.models

    path = tmp_path / "t.jsonl"
    if bad is not None:
        path.write_text(bad)
    monkeypatch.setattr(kvplan.models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    for argv in (("search", "--task", str(path), "--budget", "3bpv", "--quiet"),
                 ("eval", "int4", "--task", str(path), "--quiet")):
        code, lines = _main_error(capsys, *argv)
        assert code == 2 and len(lines) == 1 and lines[0].startswith("kvplan: error: ") and fragment in lines[0]


def test_more_samples_than_the_split_holds_is_one_line(tmp_path, capsys):
    task = _text_task(tmp_path / "docs.jsonl")
    code, lines = _main_error(capsys, "search", "--task", str(task), "--samples", "50", "--quiet")
    assert code == 2 and lines == [f"kvplan: error: {task}: 50 samples asked but the calibration split has 5 of the "
                                   "task's 9 records (calibration gets half, validation and test a quarter each)"]
    code, lines = _main_error(capsys, "eval", "int4", "--task", str(task), "--split", "test", "--samples", "3")
    assert code == 2 and "3 samples asked but the test split has 2" in lines[0]


@pytest.mark.parametrize("count", [-1, 2.5, True, "3"], ids=["negative", "fraction", "bool", "string"])
def test_task_scorers_refuse_a_bad_sample_count_before_the_model_loads(tmp_path, monkeypatch, count):
    """The lower-level API the bench scripts use checks counts where the tasks read them (before,
    n_calibration=-1 sliced from the end of the split), on the built-in task and on a JSONL one."""
    import kvplan.models
    from kvplan.evaluation.tasks import TaskError, default_task_samples
    from kvplan.search.scorers import task_scorers

    monkeypatch.setattr(kvplan.models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    jsonl = _text_task(tmp_path / "docs.jsonl")
    for task, where in (("default", "the built-in task's validation split"),
                        (str(jsonl), f"{jsonl}: the validation split")):
        with pytest.raises(TaskError) as e:
            task_scorers("smollm2-135m", task, n_validation=count, progress=False)
        assert str(e.value) == (f"{where}: {count!r} samples asked; the count must be a whole number of at least 0"
                                + (" (or None: all)" if task != "default" else ""))
    with pytest.raises(TaskError, match=r"the built-in task's test split: -1 samples asked"):
        default_task_samples(None, split="test", n=-1)  # checked before the tokenizer is used


def test_bad_task_file_from_the_console_script(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"history": "x", "question": "q"}\n[1, 2]\n')
    r = _kvplan("eval", "int4", "--task", str(path), timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"kvplan: error: {path}:2: a task record must be a JSON object "
                                             "(got 'list')"]


def _deployed_cache(model, plan_path, sample, max_new_tokens: int):
    """The cache ``kvplan.load(model, plan_path)`` gives ``generate`` on ``sample``'s prompt and images."""
    import kvplan

    ids = torch.tensor([sample.history_ids])
    kvplan.load(model, plan_path)
    try:
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **sample.prefill_inputs,
                              max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True).cache
    finally:
        kvplan.unload(model)


@pytest.fixture(scope="module")
def vlm_task(tmp_path_factory):
    import skimage.data
    from PIL import Image

    d = tmp_path_factory.mktemp("vlm")
    names = ["astronaut", "coffee", "chelsea", "rocket", "camera", "coins"]
    recs = []
    for i, name in enumerate(names):
        img = getattr(skimage.data, name)()
        Image.fromarray(img).convert("RGB").resize((112, 112)).save(d / f"{name}.png")
        others = [f"{n}.png" for n in names if n != name][:3]
        recs.append({"id": name, "history": f"Photo number {i}, from the scikit-image samples, and three others.",
                     "images": [f"{name}.png"] + others, "question": "What is shown first?", "answer": name})
    (d / "task.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d / "task.jsonl"


def test_search_on_a_tiny_vlm_task_stores_each_modality_at_its_bits(vlm_task, tmp_path):
    import kvplan
    from kvplan.evaluation import read_jsonl, split_records
    from kvplan.evaluation.tasks import encode_user_record
    from kvplan.search import search
    from tests.evaluation.test_vlm_tasks import _tiny_llava_ov

    from kvplan.evaluation import get_model

    model, proc = _tiny_llava_ov(get_model()[1])
    out = tmp_path / "vlm.yaml"
    # the budget is stated where the user deploys (4096 tokens at the data's modality mix), not at the
    # 50-token records, whose bytes are mostly the not-yet-quantized tail
    r = search((model, proc), budget="4bpv", task=str(vlm_task), context_len=4096, n_trials=4, profile=False,
               residual_lengths=(0, 32), out=out, progress=False)
    plan = kvplan.Plan.from_yaml(out)
    assert plan.modalities == ("text", "visual") and plan.reference.context_len == 4096
    assert plan.bpv().total <= 4 + 1e-9
    assert plan.quantizer.key_pre_rope  # LLaVA-OV's decoder has 1-D RoPE; Qwen2.5-VL's M-RoPE turns it off
    mix = dict(plan.reference.modality_mix)
    assert mix["visual"] > 0.5 and set(mix) == {"text", "visual"}
    assert plan.metrics["test"]["kl"] > 0 and r.plan.metrics["calibration"]["kl"] > 0
    # deploy: generate with the images of a test record; every committed token at its modality's bits
    rec = split_records(read_jsonl(vlm_task), "test")[0]
    sample = encode_user_record(rec, model, proc)
    cache = _deployed_cache(model, out, sample, max_new_tokens=2)
    table = plan.table()  # [L, H, 2, M]
    labels = sample.history_labels
    sink = plan.quantizer.sink_length
    for layer in range(plan.geometry.num_layers):
        for k, kind in enumerate(("k", "v")):
            for h, bits in enumerate(cache.token_bits(layer, kind)):
                for t, b in enumerate(bits):
                    want = 16 if t < sink else table[layer, h, k, plan.modalities.index(labels[t])]
                    assert b == want, (layer, kind, h, t)
    assert len(cache.token_bits(0, "k")[0]) >= 128  # most of the history was committed


def test_vlm_search_at_the_default_context_states_bpv_on_a_real_prompt_layout(vlm_task, tmp_path):
    """At the default context (the median calibration history) the plan's reference records that
    history's own interleaved text / image runs, and deploying that record's prompt through
    kvplan.load stores exactly the plan's stated bpv."""
    import kvplan
    from kvplan.evaluation import get_model, read_jsonl, split_records
    from kvplan.evaluation.tasks import encode_user_record
    from kvplan.plans.accounting import label_runs
    from kvplan.search import search
    from tests.evaluation.test_vlm_tasks import _tiny_llava_ov

    model, proc = _tiny_llava_ov(get_model()[1])
    out = tmp_path / "vlm.yaml"
    search((model, proc), budget="8bpv", task=str(vlm_task), n_trials=3, profile=False, residual_lengths=(0,),
           group_sizes=(32,), out=out, progress=False)
    plan = kvplan.Plan.from_yaml(out)
    layout = plan.reference.layout
    assert layout is not None and len(layout) > 2  # several interleaved runs, not one run per modality
    cal = [encode_user_record(r, model, proc) for r in split_records(read_jsonl(vlm_task), "calibration")]
    sample = next(s for s in cal if tuple((lab, n) for lab, _, n in label_runs(s.history_labels)) == layout)
    cache = _deployed_cache(model, out, sample, max_new_tokens=1)
    assert cache.get_seq_length() == plan.reference.context_len
    assert cache.bpv() == plan.bpv().total


def test_cli_search_on_a_saved_tiny_vlm_with_images_and_a_video(vlm_task, tmp_path):
    """As a VLM user runs it: a model directory (weights, config, the real LLaVA-OneVision processor
    as ``save_pretrained`` writes it), ``kvplan search --model DIR --task`` with images and a video
    clip, ``kvplan validate --model DIR``, then the plan deployed with the clip at its stated bpv."""
    import kvplan
    from kvplan.evaluation import get_model
    from kvplan.evaluation.tasks import encode_user_record
    from tests.evaluation.test_vlm_tasks import _tiny_llava_ov

    model, proc = _tiny_llava_ov(get_model()[1])
    model_dir = tmp_path / "tiny-llava-ov"
    model.save_pretrained(model_dir)
    proc.save_pretrained(model_dir)
    frames = sorted(p.name for p in vlm_task.parent.glob("*.png"))[:4]
    task = tmp_path / "task.jsonl"
    recs = [json.loads(line) for line in vlm_task.read_text().splitlines()]
    recs += [{"id": f"clip{i}", "history": f"Clip {i}: four photos shown as frames.", "video": frames[i:] + frames[:i],
              "question": "What is shown first?", "answer": frames[i].removesuffix(".png")} for i in range(2)]
    task.write_text("".join(json.dumps({**r, **({"images": [str(vlm_task.parent / p) for p in r["images"]]}
                                                 if "images" in r else {}),
                                        **({"video": [str(vlm_task.parent / p) for p in r["video"]]}
                                           if "video" in r else {})}) + "\n" for r in recs))
    out = tmp_path / "plan.yaml"
    r = _kvplan("--threads", "1", "search", "--model", str(model_dir), "--task", str(task), "--budget", "4bpv",
                "--context", "4096", "--trials", "3", "--no-profile", "--quiet", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    r = _kvplan("validate", str(out), "--model", str(model_dir))
    assert r.returncode == 0 and "modalities ['text', 'visual']" in r.stdout, r.stderr[-3000:]
    plan = kvplan.Plan.from_yaml(out)
    loaded, loaded_proc = kvplan.load_model(str(model_dir))
    assert type(loaded_proc).__name__ == "LlavaOnevisionProcessor"
    clip = encode_user_record({**recs[-1], "video": [str(vlm_task.parent / p) for p in recs[-1]["video"]]},
                              loaded, loaded_proc)
    assert clip.history_labels.count("visual") > 0
    cache = _deployed_cache(loaded, out, clip, max_new_tokens=2)
    T = cache.get_seq_length()
    labels = list(clip.history_labels) + ["text"] * (T - len(clip.history_labels))  # + generated tokens
    assert cache.bpv() == plan.bpv(context_len=T, modality_mix=labels).total
