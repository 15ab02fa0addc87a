"""The search's outputs are one set: plan, trials.csv and search.json share a run id, are
written through temporary files renamed only when all are on disk, a killed writer's
temporary files are removed by the next write, and ``kvplan explain`` refuses to read a
plan's sidecars from another run."""

import json
import os
import subprocess
import sys

import pytest

from kvplan.errors import KVPlanError
from kvplan.explain import explain
from kvplan.plans import Plan
from kvplan.plans._files import TMP_SUFFIX, check_writable, write_file_set
from kvplan.search import search
from tests.search.synthetic import SyntheticScorer

FAST = dict(budget="3.0", n_trials=6, progress=False, n_candidates=4, n_local=8, profile=False)


def _search(out, seed=0):
    return search(scorer=SyntheticScorer(), out=str(out), seed=seed, **FAST)


def test_one_run_id_in_every_file(tmp_path):
    r = _search(tmp_path / "plan.yaml")
    run_id = r.plan.metrics["search"]["run_id"]
    assert Plan.from_yaml(r.paths["plan"]).metrics["search"]["run_id"] == run_id
    assert json.loads(open(r.paths["search"]).read())["run_id"] == run_id
    import csv

    rows = list(csv.DictReader(open(r.paths["trials"])))
    assert len(rows) == 6 and {row["run_id"] for row in rows} == {run_id}
    assert all(row["host"] for row in rows)  # which machine measured each trial
    assert sorted(os.listdir(tmp_path)) == ["plan.search.json", "plan.trials.csv", "plan.yaml"]


def test_explain_refuses_sidecars_of_another_run(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    _search(a / "plan.yaml", seed=0)
    _search(b / "plan.yaml", seed=1)
    # a plan beside the other run's sidecars, as a kill between two renames could leave it
    for name in ("plan.trials.csv", "plan.search.json"):
        os.replace(b / name, a / name)
    text = explain(str(a / "plan.yaml"), importance=False)
    lines = [ln for ln in text.splitlines() if "another search run" in ln]
    assert len(lines) == 2, text
    assert any("plan.trials.csv" in ln for ln in lines) and any("plan.search.json" in ln for ln in lines)
    # the same files of one run: no such warning
    c = tmp_path / "c"
    c.mkdir()
    _search(c / "plan.yaml", seed=0)
    assert "another search run" not in explain(str(c / "plan.yaml"), importance=False)


def test_stale_temporary_files_are_removed_by_the_next_write(tmp_path):
    target = tmp_path / "plan.yaml"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs
    stale = tmp_path / f".plan.yaml.{dead.pid}{TMP_SUFFIX}"
    stale.write_text("half a plan")
    old_style = tmp_path / ".tmp-abc123plan.yaml"
    old_style.write_text("half a plan")
    os.utime(old_style, (1, 1))
    live = tmp_path / f".plan.yaml.{os.getppid()}{TMP_SUFFIX}"  # a live process's write in progress
    live.write_text("being written")
    write_file_set({target: "new\n"})
    assert target.read_text() == "new\n"
    assert not stale.exists() and not old_style.exists()
    assert live.exists()


def test_a_failed_write_leaves_the_old_set_and_no_temporary_file(tmp_path):
    write_file_set({tmp_path / "x.yaml": "old x\n", tmp_path / "x.json": "old json\n"})
    os.mkdir(tmp_path / "x.csv")  # a directory where a file must go: the set cannot be written
    with pytest.raises(KVPlanError, match=f"^{tmp_path / 'x.csv'}: cannot write \\(Is a directory\\)$"):
        write_file_set({tmp_path / "x.yaml": "new x\n", tmp_path / "x.json": "new json\n",
                        tmp_path / "x.csv": "rows\n"})
    assert (tmp_path / "x.yaml").read_text() == "old x\n" and (tmp_path / "x.json").read_text() == "old json\n"
    assert not [n for n in os.listdir(tmp_path) if n.endswith(TMP_SUFFIX)]


def test_each_budgets_plan_reads_the_shared_history_and_the_study_resumes_in_any_budget_order(tmp_path):
    """A search over several budgets writes one plan per budget beside one trials.csv / search.json:
    explain finds that history for each plan (its Pareto front and importance), and the same study
    resumed with the budgets listed in another order is the same study, not 'a different setup'."""
    from kvplan.explain import report

    storage = str(tmp_path / "study.log")
    fast = {**FAST, "n_trials": 6}
    del fast["budget"]
    first = search(scorer=SyntheticScorer(), out=str(tmp_path / "plan.yaml"), budget=["4.0", "3.0"],
                   storage=storage, study_name="s", **fast)
    assert sorted(os.listdir(tmp_path)) == ["plan-3bpv.yaml", "plan-4bpv.yaml", "plan.search.json",
                                            "plan.trials.csv", "study.log"]
    for b in ("3", "4"):
        rep = report(str(tmp_path / f"plan-{b}bpv.yaml"), importance=False)
        assert not any("trial history" in m for m in rep["missing"]), rep["missing"]
        assert rep["history"]["trials_csv"] == str(tmp_path / "plan.trials.csv")
        assert not rep["warnings"], rep["warnings"]  # a search without a profile records profile: null
    again = search(scorer=SyntheticScorer(), out=str(tmp_path / "again.yaml"), budget=["3.0", "4.0"],
                   storage=storage, study_name="s", **fast)
    assert sorted(again.plans) == sorted(first.plans) == [3.0, 4.0]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_folder_that_refuses_new_files_is_found_before_the_work(tmp_path):
    """/proc passes a permission check (as root), yet no file can be made there: the probe file finds it."""
    with pytest.raises(KVPlanError, match="--out /proc/x.yaml: cannot write into /proc"):
        check_writable("/proc/x.yaml", "--out", is_dir=False)
    check_writable(tmp_path / "new" / "plan.yaml", "--out", is_dir=False)  # made as needed: fine
    assert os.listdir(tmp_path) == []  # the probe is removed


def test_a_set_whose_file_cannot_be_replaced_is_not_written_at_all(tmp_path, monkeypatch):
    """With an immutable plan.trials.csv (chattr +i) a search's export renamed the new plan.yaml into place, then
    failed on the sidecar: a new plan beside the old sidecars. The file the system will not replace now fails the
    set before any rename (it cannot be given a second name either), and a rename that fails puts back the ones
    made before it."""
    import errno

    import kvplan.plans._files as files

    paths = {name: tmp_path / name for name in ("plan.yaml", "plan.trials.csv", "plan.search.json")}
    for name, p in paths.items():
        p.write_text(f"old {name}")
    real_link = os.link

    def immutable_csv(src, dst):
        if os.fspath(src).endswith("plan.trials.csv"):
            raise PermissionError(errno.EPERM, "Operation not permitted", os.fspath(src))
        return real_link(src, dst)

    monkeypatch.setattr(files.os, "link", immutable_csv)
    with pytest.raises(KVPlanError, match=r"plan.trials.csv: cannot write \(Operation not permitted\)"):
        write_file_set({p: f"new {name}" for name, p in paths.items()})
    assert sorted(os.listdir(tmp_path)) == sorted(paths)  # nothing else left beside them
    assert all(p.read_text() == f"old {name}" for name, p in paths.items())
    monkeypatch.setattr(files.os, "link", real_link)
    write_file_set({p: f"new {name}" for name, p in paths.items()})
    assert sorted(os.listdir(tmp_path)) == sorted(paths)
    assert all(p.read_text() == f"new {name}" for name, p in paths.items())


def test_a_symbolic_link_is_written_through_and_stays_a_link(tmp_path):
    """``--out link.json`` replaced the link with a regular file and left its target stale (``os.replace`` on the
    link's name); ``open(path, "w")``, which users expect of an output path, writes the target."""
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "r.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "real" / "new.json")
    check_writable(link, "--out", is_dir=False)
    write_file_set({link: "new", dangling: "made"})
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new" and link.read_text() == "new"
    assert dangling.is_symlink() and (tmp_path / "real" / "new.json").read_text() == "made"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling.json", "link.json", "real"]
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["new.json", "r.json"]


def test_a_fifo_named_as_an_output_is_written_into_not_replaced(tmp_path):
    """A FIFO given as ``--out`` became a regular file and its reader hung; ``/dev/stdout`` given as ``--out``
    (as root) replaced the system's link with a JSON file."""
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE, text=True)
    check_writable(fifo, "--out", is_dir=False)
    write_file_set({tmp_path / "plan.yaml": "a: 1\n", fifo: "streamed\n"})
    out, _ = reader.communicate(timeout=30)
    assert out == "streamed\n"
    assert fifo.exists() and not fifo.is_file()  # still the FIFO
    assert (tmp_path / "plan.yaml").read_text() == "a: 1\n"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(TMP_SUFFIX)]

