"""Several worker processes on one study (journal file, SQLite) and kill -9 then resume."""

import os
import signal
import subprocess
import sys
import time

import optuna
import pytest
from optuna.trial import TrialState

from kvplan.search import make_storage

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker(storage, study, n, sleep=0.0, worker=None, go=None):
    env = dict(os.environ)
    if go:
        env["KVPLAN_TEST_GO"] = go
    args = [sys.executable, "-m", "tests.search._worker", storage, study, str(n), str(sleep)]
    if worker is not None:
        args.append(str(worker))
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _complete(storage, study):
    s = optuna.load_study(study_name=study, storage=make_storage(storage))
    return s.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))


@pytest.mark.parametrize("kind", ["journal", "sqlite"])
def test_two_workers_one_study(tmp_path, kind):
    storage = str(tmp_path / "s.journal") if kind == "journal" else f"sqlite:///{tmp_path / 's.db'}"
    go = str(tmp_path / "go")
    procs = [_worker(storage, "shared", 24, 0.1, worker=i, go=go) for i in range(2)]
    for p in procs:  # both imported and waiting: start them together
        assert p.stdout.readline().strip() == "READY", p.stderr.read()[-2000:]
    open(go, "w").close()
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert "DONE" in out
    done = _complete(storage, "shared")
    assert len(done) >= 24
    evals = [int(o.split("DONE")[1].split()[0]) for o, _ in outs]
    assert all(e > 0 for e in evals), evals  # both workers contributed
    assert sum(evals) == len(done)
    pids = {t.user_attrs.get("kvplan.pid") for t in done} - {None}
    assert len(pids) == 2


def test_kill_9_then_resume(tmp_path):
    storage = str(tmp_path / "k.journal")
    p = _worker(storage, "killme", 60, sleep=0.15, worker=0)
    deadline = time.time() + 240
    n = 0
    while time.time() < deadline:
        time.sleep(0.5)
        try:
            n = len(_complete(storage, "killme"))
        except Exception:
            continue
        if n >= 8:
            break
    assert n >= 8, p.stderr.read()[-2000:] if p.poll() is not None else "worker too slow"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    before = {t.number: t.values[0] for t in _complete(storage, "killme")}
    assert 8 <= len(before) < 60
    q = _worker(storage, "killme", len(before) + 5, worker=0)
    out, err = q.communicate(timeout=300)
    assert q.returncode == 0, err[-2000:]
    after = {t.number: t.values[0] for t in _complete(storage, "killme")}
    assert len(after) == len(before) + 5
    assert all(after[k] == v for k, v in before.items())  # finished trials survived the kill
    s = optuna.load_study(study_name="killme", storage=make_storage(storage))
    assert not s.get_trials(states=(TrialState.RUNNING,))  # the killed worker's trial was failed on resume
    assert s.user_attrs.get("kvplan.profile")
