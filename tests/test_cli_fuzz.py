"""Fuzz the command line (hypothesis): plan files, JSONL tasks, budgets, storages and option
values. Whatever the input, ``kvplan`` exits 0, or 2 with exactly one ``...: error: ...`` line
on stderr; never a traceback or an "internal error" (exit 1).

No model is loaded: ``kvplan.models.load_model`` is replaced by a stub that ends the command
with :class:`_Reached` (an input that gets that far was accepted). Everything a command checks
before loading its model (which is what the issue asks: inputs checked before the expensive
part) is exercised for real.
"""

import contextlib
import io
import json
import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplan.cli import main
from kvplan.plans import uniform_plan
from kvplan.models import Geometry

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
TMP = tempfile.mkdtemp(prefix="kvplan-fuzz-")


class _Reached(BaseException):
    """The command got as far as loading its model: its inputs were accepted."""


@pytest.fixture(autouse=True, scope="module")
def _no_model():
    import kvplan.models

    def stub(*a, **k):
        raise _Reached()

    mp = pytest.MonkeyPatch()
    mp.setattr(kvplan.models, "load_model", stub)
    mp.chdir(TMP)  # a relative path the fuzzer makes up (a journal file...) lands in the scratch folder
    yield
    mp.undo()


def run(argv) -> tuple[int, str]:
    err = io.StringIO()
    out = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = main([str(a) for a in argv])
        except _Reached:
            rc = 0
        except SystemExit as e:  # argparse
            rc = e.code if isinstance(e.code, int) else 2
    return rc, err.getvalue()


def check(argv) -> int:
    rc, err = run(argv)
    assert "Traceback" not in err and "internal error" not in err, (argv, err[-3000:])
    assert rc in (0, 2), (argv, rc, err[-2000:])
    if rc == 2:
        lines = err.splitlines()
        assert len(lines) == 1 and ": error: " in lines[0] and lines[0].startswith("kvplan"), (argv, err[-2000:])
    return rc


def _file(data: bytes | str, suffix: str) -> str:
    fd, path = tempfile.mkstemp(suffix=suffix, dir=TMP)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data)
    return path


VALID_PLAN = uniform_plan(Geometry(2, 1, 64, ("full", "full"), "llama"), 4).to_yaml()

yaml_scalars = st.one_of(st.integers(-10 ** 60, 10 ** 60), st.floats(allow_nan=True, allow_infinity=True),
                         st.text(max_size=20), st.booleans(), st.none(),
                         st.sampled_from(["1e400", "-.inf", ".nan", "0x10", "*a", "&a [1]", "!!python/object:os.system",
                                          "9" * 5000, "\x00", "\ufeff", "{a: *a}", "[[[[[[[[[["]))


def _mutate(text: str, data) -> str:
    lines = text.splitlines()
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(lines) - 1))
        op = data.draw(st.sampled_from(["value", "drop", "dup", "indent", "key"]))
        head, sep, _ = lines[i].partition(":")
        if op == "value" and sep:
            lines[i] = f"{head}: {data.draw(yaml_scalars)}"
        elif op == "drop":
            del lines[i]
        elif op == "dup":
            lines.insert(i, lines[i])
        elif op == "indent":
            lines[i] = "  " + lines[i]
        else:
            lines[i] = f"{data.draw(st.text(max_size=8))}{sep}{_}"
        if not lines:
            lines = [""]
    return "\n".join(lines)


@SETTINGS
@given(data=st.data())
def test_validate_and_explain_any_plan_file(data):
    kind = data.draw(st.sampled_from(["mutated", "bytes", "bom", "bomb", "b64"]))
    if kind == "mutated":
        body: bytes | str = _mutate(VALID_PLAN, data)
    elif kind == "bytes":
        body = data.draw(st.binary(max_size=300))
    elif kind == "bom":
        body = b"\xef\xbb\xbf" + _mutate(VALID_PLAN, data).encode("utf-8", "surrogatepass") + b"\x00"
    elif kind == "bomb":
        n = data.draw(st.integers(2, 12))
        body = "a0: &a0 [x, x]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}]\n" for i in range(1, n)) + \
            f"metrics: *a{n - 1}\n"
    else:
        body = VALID_PLAN + "key_basis: {dtype: float16, shape: [2, 1, 64, 2], base64: " + \
            data.draw(st.text(alphabet="ABCD=+/", max_size=40)) + "}\n"
    path = _file(body, ".yaml")
    check(["validate", path])
    check(["explain", path, "--no-importance"] + data.draw(st.sampled_from(
        [[], ["--format", "json"], ["--context", "-5"], ["--context", "0"], ["--batch", "0"]])))


json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-10 ** 30, 10 ** 30), st.floats(),
                                     st.text(max_size=30)),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                           max_leaves=8)
records = st.fixed_dictionaries({}, optional={"history": json_values | st.text(min_size=1, max_size=200),
                                              "question": json_values, "choices": json_values,
                                              "answer": json_values, "id": json_values, "images": json_values})


@SETTINGS
@given(recs=st.lists(records, max_size=6), junk=st.sampled_from(["", "{", "not json\n", "\x00\n", "[]\n", "\n\n"]),
       samples=st.integers(-2, 40), split=st.sampled_from(["calibration", "validation", "test", "heldout", "all"]),
       command=st.sampled_from(["eval", "sweep", "search"]))
def test_any_jsonl_task(recs, junk, samples, split, command):
    text = "".join(json.dumps(r) + "\n" for r in recs) + junk
    task = _file(text, ".jsonl")
    if command == "search":
        argv = ["search", "--task", task, "--samples", samples, "--out", os.path.join(TMP, "p.yaml"), "--quiet"]
    else:
        argv = [command, "int2", "--task", task, "--samples", samples, "--split", split, "--quiet"]
        if command == "sweep":
            argv = ["sweep", "--task", task, "--samples", samples, "--split", split, "--quiet",
                    "--out-dir", os.path.join(TMP, "sweep")]
    check(argv)
    check([command if command != "eval" else "eval", "int2" if command == "eval" else "--quiet", "--task",
           os.path.join(TMP, "missing.jsonl")])


budgets = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(str), st.text(max_size=12),
                    st.sampled_from(["2.5bpv", "0.1bpv", "3", "1e9", "-1", "nan", "inf", "2.5 bpv", "bpv", "16bpv"]))
storages = st.one_of(
    st.none(),
    st.sampled_from(["x.journal", "sqlite:///{tmp}/s.db", "postgres://u@127.0.0.1:1/d",
                     "postgresql://u:pw@127.0.0.1:1/d", "mysql+nosuch://u@h/d", "sqlite:////dev/null/x.db",
                     "{tmp}", "://", "redis://h", "study.txt", "sqlite:////"]),
    st.text(max_size=20))
options = st.lists(st.sampled_from([
    ["--trials", "0"], ["--trials", "-3"], ["--trials", "x"], ["--samples", "0"], ["--history-tokens", "0"],
    ["--granularity", "nope"], ["--worker", "-1"], ["--worker", "1"], ["--heartbeat-interval", "0"],
    ["--grace-period", "1"], ["--finalize"], ["--sink-lengths", "-1"], ["--rotation", "x"], ["--context", "-4"],
    ["--out", "/proc/nope/plan.yaml"], ["--out", "{tmp}"], ["--study-name", "s"], ["--budget", "2.5", "3"],
]), max_size=3)


@SETTINGS
@given(budget=budgets, storage=storages, opts=options, threads=st.sampled_from([None, None, "0", "-1", "x", "1"]))
def test_search_options_budgets_and_storages(budget, storage, opts, threads):
    argv = ["search", "--budget", budget, "--quiet", "--out", os.path.join(TMP, "plan.yaml")]
    if storage is not None:
        argv += ["--storage", storage.replace("{tmp}", TMP) if not storage.endswith(".journal")
                 else os.path.join(TMP, storage)]
    for o in opts:
        argv += [x.replace("{tmp}", TMP) for x in o]
    if threads is not None:  # a global option: before the command
        argv = ["--threads", threads] + argv
    check(argv)


def test_threads_reach_the_evaluation(monkeypatch):
    """``kvplan --threads N eval/sweep``: the evaluation runs on N threads (run_eval / run_sweep
    do not override it)."""
    import torch

    import kvplan.models

    seen = []

    def stub(*a, **k):
        seen.append(torch.get_num_threads())
        raise _Reached()

    monkeypatch.setattr(kvplan.models, "load_model", stub)
    # a model an earlier test loaded stays in the per-process cache and would skip load_model
    import kvplan.evaluation.runs

    monkeypatch.setattr(kvplan.evaluation.runs, "_MODELS", {})
    before = torch.get_num_threads()
    n = 3 if before != 3 else 2
    try:
        assert run(["--threads", n, "eval", "int2", "--samples", "1"])[0] == 0
        assert run(["--threads", n, "sweep", "--samples", "1", "--out-dir", os.path.join(TMP, "sw")])[0] == 0
    finally:
        torch.set_num_threads(before)
    assert seen == [n, n]


def test_the_oracle_catches_a_crash(monkeypatch):
    """The check above fails on a traceback: a bug planted in plan loading is reported as one."""
    import kvplan.plans

    def boom(*a, **k):
        raise ZeroDivisionError("planted")

    monkeypatch.setattr(kvplan.plans.Plan, "from_yaml", classmethod(lambda cls, *a, **k: boom()))
    with pytest.raises(AssertionError, match="Traceback"):
        check(["validate", _file(VALID_PLAN, ".yaml")])
