"""The sweep's CSV, JSON and PNG are written as one set (kvplan.plans._files.write_file_set)."""

import json
import os

import pytest

from kvplan.errors import KVPlanError
from kvplan.evaluation import sweep


def test_sweep_csv_json_and_png_written_as_one_set(tmp_path, monkeypatch):
    """The figure was drawn in place after the CSV/JSON pair: a failure left a stale figure beside new data."""
    monkeypatch.setattr(sweep, "sweep_png", lambda rows, title="": repr(rows).encode())
    row = {k: None for k in sweep.CSV_FIELDS}
    paths = sweep.write_sweep({"rows": [row], "ratios": {}, "results": {}}, str(tmp_path), {"title": "t"})
    assert json.load(open(paths["json"]))["meta"] == {"title": "t"}
    assert open(paths["csv"]).read().splitlines()[0] == ",".join(sweep.CSV_FIELDS)

    def fail(files):  # a failure before the renames leaves the previous pair untouched
        raise OSError("disk full")

    assert open(paths["png"], "rb").read() == repr([row]).encode()
    before = {p: open(paths[p], "rb").read() for p in ("csv", "json", "png")}

    def plot_fails(rows, title=""):
        raise RuntimeError("no display")

    monkeypatch.setattr(sweep, "sweep_png", plot_fails)  # drawn before any file is written
    with pytest.raises(RuntimeError):
        sweep.write_sweep({"rows": [], "ratios": {"x": 1}, "results": {}}, str(tmp_path), {})
    monkeypatch.setattr(sweep, "sweep_png", lambda rows, title="": b"new")
    monkeypatch.setattr(sweep, "write_file_set", fail)
    with pytest.raises(OSError):
        sweep.write_sweep({"rows": [], "ratios": {"x": 1}, "results": {}}, str(tmp_path), {})
    assert {p: open(paths[p], "rb").read() for p in ("csv", "json", "png")} == before
    assert sorted(os.listdir(tmp_path)) == ["sweep.csv", "sweep.json", "sweep.png"]


def test_run_sweep_writes_files_only_where_asked(tmp_path, monkeypatch, smol):
    """A library call writes nothing unless given ``out_dir`` (``kvplan sweep`` passes ``sweep-results``)."""
    from kvplan.evaluation import run_sweep

    monkeypatch.chdir(tmp_path)
    kw = dict(samples=1, bits=(2,), history_tokens=128, eval_tokens=8, progress=False, verbose=False)
    res = run_sweep(**kw)
    assert res["paths"] == {} and os.listdir(tmp_path) == []
    assert {r["bits"] for r in res["rows"]} >= {2} and all(r["kl"] >= 0 for r in res["rows"])
    res = run_sweep(out_dir="out", **kw)
    assert sorted(os.listdir(tmp_path / "out")) == ["sweep.csv", "sweep.json", "sweep.png"]
    assert set(res["paths"]) == {"csv", "json", "png"}
    assert open(tmp_path / "out" / "sweep.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_sweep_and_eval_on_a_jsonl_task_record_the_lengths_its_samples_hold(tmp_path, smol):
    """--history-tokens is the built-in task's: a JSONL task's records set their own lengths (giving it with one
    is refused, it was ignored), and the sweep's title and the eval's task block say what the samples held."""
    from kvplan.evaluation import run_eval, run_sweep
    from kvplan.evaluation.tasks import task_samples
    from tests.search.test_task_search import _text_task

    task = str(_text_task(tmp_path / "docs.jsonl"))
    samples = task_samples(task, smol[0], smol[1], split="test", n=2)
    held = sorted(len(s.history_ids) for s in samples)
    assert held[0] != 512
    kw = dict(task=task, split="test", samples=2, progress=False, verbose=False)
    for run in (run_sweep, run_eval):
        with pytest.raises(KVPlanError, match="^history_tokens=512 \\(--history-tokens\\): sets the built-in task's"):
            run(*(() if run is run_sweep else ("int4",)), history_tokens=512, **kw)
    meta = run_sweep(bits=(2,), **kw)["meta"]
    want = held[0] if held[0] == held[1] else {"min": held[0], "mean": sum(held) / 2, "max": held[1]}
    assert meta["history_tokens"] == want and "512" not in meta["title"]
    assert run_eval("int4", **kw)["task"]["history_tokens"] == want


def test_eval_defaults_to_the_split_the_search_measured(tmp_path, monkeypatch, capsys):
    """``kvplan eval plan --task my.jsonl``: every record of the split, as the search's test measurement
    (16 samples used to be the default, and a split of fewer records was refused); ``--eval-tokens``
    reaches the built-in task as search's does."""
    import kvplan.evaluation
    from kvplan.cli import main
    from kvplan.evaluation.runs import get_model, resolve_sample_count
    from kvplan.evaluation.tasks import read_jsonl, split_records, task_samples
    from tests.search.test_task_search import _text_task

    seen = []
    monkeypatch.setattr(kvplan.evaluation, "run_eval", lambda *a, **k: seen.append(k))
    task = str(_text_task(tmp_path / "docs.jsonl"))
    assert main(["eval", "int4", "--task", task, "--quiet"]) == 0
    assert main(["eval", "int4", "--eval-tokens", "8", "--quiet"]) == 0
    # without --samples run_eval takes the plan's search's count, else the default (16 of the built-in task)
    assert seen[0]["samples"] is None and seen[1]["samples"] is None and seen[1]["eval_tokens"] == 8
    assert resolve_sample_count("default", None) == 16
    model, tok = get_model()
    n = len(task_samples(task, model, tok, split="test", n=resolve_sample_count(task, None)))
    assert n == len(split_records(read_jsonl(task), "test"))


def test_a_sweep_whose_files_cannot_be_written_still_prints_its_results(monkeypatch, tmp_path, capsys):
    """The files were written before the table was printed: a failure writing them (here a folder in the way
    of sweep.csv) lost every result of minutes of evaluation."""
    import kvplan.evaluation.runs as runs
    from kvplan.cli import main
    from kvplan.models import Geometry

    g = Geometry(2, 1, 64, ("full", "full"), "llama")
    row = {"condition": "fp16", "bits": 16, "modality": "all", "kind": "KV", "kl": 0.0, "kl_lo": 0.0, "kl_hi": 0.0,
           "delta_nll": 0.0, "delta_nll_lo": 0.0, "delta_nll_hi": 0.0, "top1": 1.0, "acc": None, "acc_fp": None,
           "quantized_tokens_per_sample": 0.0, "bpv": 16.0, "bpv_measured": 16.0}
    rows = [row, dict(row, condition="int2-text-K", bits=2, modality="text", kind="K", kl=0.123456)]
    monkeypatch.setattr(runs, "_prepared_task", lambda *a, **k: (object(), None, [], [], ("text",), {}))
    monkeypatch.setattr(runs, "sweep_prepared", lambda *a, **k: {"rows": rows, "ratios": {}, "results": {}})
    monkeypatch.setattr(runs, "Geometry", type("G", (), {"of": staticmethod(lambda m: g)}))
    monkeypatch.setattr(runs, "_token_lengths", lambda ss: {"history_tokens": 512, "eval_tokens": 32})
    (tmp_path / "sweep.csv").mkdir()  # in the way of one output file
    assert main(["sweep", "--samples", "2", "--quiet", "--out-dir", str(tmp_path)]) == 2
    assert "| int2-text-K |" in capsys.readouterr().out
