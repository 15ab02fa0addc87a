"""One storage contract, run against every backend (journal file, SQLite, PostgreSQL), as
Optuna's own storage tests do: several worker processes on one study, kill -9 of a worker,
resume, refusal of a worker with another setup, clean errors for unusable storages."""

import json
import os
import signal
import subprocess
import sys
import time
import warnings

import optuna
import pytest
from optuna.trial import TrialState

from kvplan.errors import KVPlanError
from kvplan.search import make_storage, search
from kvplan.search.storage import StorageError, trial_owner
from tests.search.synthetic import SyntheticScorer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HB = {"heartbeat": 1, "grace": 3}  # seconds: a dead worker's trial is failed within ~3-4 s on RDB storages


@pytest.fixture(params=["journal", "sqlite", "postgresql"])
def storage_url(request, tmp_path):
    if request.param == "journal":
        return str(tmp_path / "s.journal")
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 's.db'}"
    return request.getfixturevalue("postgres_url")


def _worker(cfg: dict, go=None):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if go:
        env["KVPLAN_TEST_GO"] = go
    return subprocess.Popen([sys.executable, "-m", "tests.search._worker", json.dumps(cfg)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _result(out: str) -> dict:
    return json.loads(out.split("RESULT", 1)[1])


def _study(storage):
    return optuna.load_study(study_name="s", storage=make_storage(storage, heartbeat_interval=None))


def _complete(storage):
    return _study(storage).get_trials(deepcopy=False, states=(TrialState.COMPLETE,))


def _plan_keys(trials):
    return [(tuple(sorted(t.params.items()))) for t in trials]


def _start_together(cfgs, tmp_path):
    go = str(tmp_path / "go")
    procs = [_worker(c, go=go) for c in cfgs]
    for p in procs:  # both imported and waiting: start them together
        line = p.stdout.readline().strip()
        assert line == "READY", p.stderr.read()[-3000:]
    open(go, "w").close()
    return procs


class TestStorageContract:
    def test_two_workers_share_one_study(self, storage_url, tmp_path):
        n = 16
        cfgs = [{"storage": storage_url, "study": "s", "n": n, "sleep": 0.05, "worker": i, **HB,
                 "out": str(tmp_path / f"w{i}" / "plan.yaml")} for i in range(2)]
        for i in range(2):
            os.makedirs(tmp_path / f"w{i}")
        procs = _start_together(cfgs, tmp_path)
        outs = [p.communicate(timeout=300) for p in procs]
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, err[-3000:]
        res = [_result(o) for o, _ in outs]
        done = _complete(storage_url)
        assert len(done) == n  # exactly --trials, not more
        assert len(set(_plan_keys(done))) == n  # no plan evaluated twice
        assert sum(r["n_real_evals"] for r in res) == n
        assert all(r["n_real_evals"] > 0 for r in res), res  # both contributed
        # the sensitivity profile was measured once, by one worker, and shared
        assert sorted(r["n_profile_evals"] > 0 for r in res) == [False, True], res
        # exactly one worker measured the final plan and wrote the files; the other was told
        writers = [i for i, r in enumerate(res) if r["finalized_by"] is None]
        assert len(writers) == 1, res
        w = writers[0]
        assert os.path.exists(tmp_path / f"w{w}" / "plan.yaml")
        assert os.listdir(tmp_path / f"w{1 - w}") == []
        assert res[1 - w]["finalized_by"]["pid"] == res[w]["pid"]
        assert res[0]["plan_kl"] == res[1]["plan_kl"]
        # provenance: each trial names the host and process that measured it
        pids = {trial_owner(t).get("pid") for t in done}
        assert pids == {r["pid"] for r in res}
        assert all(trial_owner(t).get("host") and trial_owner(t).get("kvplan_version") for t in done)
        s = _study(storage_url)
        assert not s.get_trials(states=(TrialState.RUNNING,))

    @pytest.mark.slow
    def test_kill_9_mid_trial_the_other_worker_finishes(self, storage_url, tmp_path):
        n = 16
        cfgs = [{"storage": storage_url, "study": "s", "n": n, "sleep": 0.4, "worker": i, "profile": False, **HB}
                for i in range(2)]
        # the victim's evaluations last long enough for the kill to land mid-trial: it is killed as soon as
        # it is seen holding one, so their length costs nothing; at 3 s a loaded CI box once saw the trial
        # RUNNING and killed the victim only after it had completed it
        cfgs[1]["sleep"] = 60.0
        # hand-off: the survivor starts evaluating only once the victim holds a trial (it once finished
        # all 16 under load before the victim had taken one)
        cfgs[1]["announce"] = cfgs[0]["await"] = str(tmp_path / "victim-holds-a-trial")
        procs = _start_together(cfgs, tmp_path)
        victim = procs[1]
        # wait until the victim holds an evaluation slot mid-trial (after a few finished trials)
        deadline, held = time.time() + 240, None
        while time.time() < deadline and held is None:
            time.sleep(0.1)
            try:
                s = _study(storage_url)
            except KeyError:
                continue
            if len(s.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))) < 4:
                continue
            for t in s.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                if trial_owner(t).get("pid") == victim.pid and t.user_attrs.get("kvplan.eval") and t.params:
                    held = t
        assert held is not None, "the victim never held an evaluation trial"
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        before = {t.number: t.values[0] for t in _complete(storage_url)}
        out, err = procs[0].communicate(timeout=300)
        assert procs[0].returncode == 0, err[-3000:]
        done = _complete(storage_url)
        assert len(done) == n
        assert len(set(_plan_keys(done))) == n
        after = {t.number: t.values[0] for t in done}
        assert all(after[k] == v for k, v in before.items())  # nothing finished was lost
        s = _study(storage_url)
        killed = s.trials[held.number]
        assert killed.state == TrialState.FAIL  # the dead worker's trial was failed...
        retries = [t for t in s.trials if t.system_attrs.get("failed_trial") == held.number]
        assert len(retries) == 1  # ... and queued again exactly once (behind any seeds still waiting:
        # the study may reach its total before a worker pops it, which is not a lost trial)
        assert _result(out)["finalized_by"] is None  # the survivor finalized

    @pytest.mark.slow
    def test_resume_after_kill_keeps_finished_trials(self, storage_url, tmp_path):
        p = _worker({"storage": storage_url, "study": "s", "n": 60, "sleep": 0.15, "worker": 0, **HB})
        deadline, n = time.time() + 240, 0
        while time.time() < deadline:
            time.sleep(0.3)
            try:
                n = len(_complete(storage_url))
            except KeyError:
                continue
            if n >= 6:
                break
        assert n >= 6, p.stderr.read()[-2000:] if p.poll() is not None else "worker too slow"
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        before = {t.number: t.values[0] for t in _complete(storage_url)}
        assert 6 <= len(before) < 60
        q = _worker({"storage": storage_url, "study": "s", "n": len(before) + 4, "worker": 0, **HB})
        out, err = q.communicate(timeout=300)
        assert q.returncode == 0, err[-3000:]
        after = {t.number: t.values[0] for t in _complete(storage_url)}
        assert len(after) == len(before) + 4
        assert all(after[k] == v for k, v in before.items())
        s = _study(storage_url)
        assert s.user_attrs.get("kvplan.profile")
        assert _result(out)["n_profile_evals"] == 0  # the profile measured before the kill was reused

    def test_refuses_a_worker_with_other_task_data(self, storage_url):
        fast = dict(budget="3.0", out=None, progress=False, n_candidates=4, n_local=8, profile=False,
                    heartbeat_interval=1, grace_period=3)
        search(n_trials=3, scorer=SyntheticScorer(), storage=storage_url, study_name="s", **fast)
        with pytest.raises(KVPlanError) as e:
            search(n_trials=3, scorer=SyntheticScorer(seed=1), storage=storage_url, study_name="s", **fast)
        msg = str(e.value)
        assert "\n" not in msg and "data hash" in msg and "synthetic-1" in msg and "synthetic-0" in msg
        with pytest.raises(KVPlanError, match="search space.*bits"):
            search(n_trials=3, scorer=SyntheticScorer(), storage=storage_url, study_name="s", bits=(2, 4, 16), **fast)
        assert len(_complete(storage_url)) == 3  # the refused workers added nothing


@pytest.mark.parametrize("url, fragment", [
    ("postgresql://kvplan@127.0.0.1:1/nodb", "cannot open the database"),
    ("postgres://kvplan@127.0.0.1/db", "postgresql://"),
    ("mysql+nosuchdriver://u@h/db", "not a usable database URL"),
    ("sqlite:////dev/null/x.db", "cannot create folder"),
    ("sqlite:////", "cannot open the database"),  # the root folder itself
    ("study.txt", "journal file path"),
    ("mysql://u@127.0.0.1:1/db", "driver is not installed"),  # mysqlclient is not installed here
])
def test_unusable_storage_is_one_line(url, fragment):
    with pytest.raises(StorageError) as e:
        make_storage(url)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_password_is_not_shown():
    with pytest.raises(StorageError) as e:
        make_storage("postgresql://kvplan:s3cret@127.0.0.1:1/nodb")
    assert "s3cret" not in str(e.value) and "***" in str(e.value)


def test_finalize_and_resume_with_more_trials(tmp_path):
    """``--finalize`` exports an existing study's plan without new trials; a resumed study with
    more trials is measured and exported again (the old export does not count); a worker joining
    a finished study is told who exported it and writes nothing."""
    storage = str(tmp_path / "f.journal")
    fast = dict(budget="3.0", progress=False, n_candidates=4, n_local=8, profile=False, storage=storage,
                study_name="f")
    r1 = search(n_trials=5, scorer=SyntheticScorer(), out=None, **fast)
    assert r1.finalized_by is None and r1.paths == {}
    r2 = search(n_trials=5, scorer=SyntheticScorer(), out=str(tmp_path / "late.yaml"), **fast)
    assert r2.n_real_evals == 0 and r2.finalized_by is not None and not (tmp_path / "late.yaml").exists()
    assert r2.plan.to_yaml() == r1.plan.to_yaml()
    r3 = search(n_trials=5, scorer=SyntheticScorer(), out=str(tmp_path / "fin.yaml"), finalize=True, **fast)
    assert r3.n_real_evals == 0 and r3.finalized_by is None and (tmp_path / "fin.yaml").exists()
    assert r3.plan.metrics["search"]["n_trials"] == 5
    r4 = search(n_trials=8, scorer=SyntheticScorer(), out=str(tmp_path / "more.yaml"), **fast)
    assert r4.n_real_evals == 3 and r4.finalized_by is None
    assert r4.plan.metrics["search"]["n_trials"] == 8 and (tmp_path / "more.yaml").exists()
    with pytest.raises(KVPlanError, match="no such study"):
        search(n_trials=5, scorer=SyntheticScorer(), out=None, finalize=True, **{**fast, "study_name": "nope"})


def test_missing_postgres_driver_is_one_line_with_the_extra_to_install(monkeypatch):
    for name in ("psycopg", "psycopg2"):
        monkeypatch.setitem(sys.modules, name, None)  # import psycopg -> ImportError
    with pytest.raises(StorageError) as e:
        make_storage("postgresql://kvplan@127.0.0.1:1/db")
    assert "driver is not installed" in str(e.value) and "kvplan[postgres]" in str(e.value)


def test_cli_checks_the_storage_before_the_model_loads():
    exe = os.path.join(os.path.dirname(sys.executable), "kvplan")
    # a model that cannot load: had the model come first, its error would be the one reported
    r = subprocess.run([exe, "search", "--model", "/nonexistent/model", "--storage",
                        "postgresql://kvplan@127.0.0.1:1/db", "--study-name", "s", "--trials", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert r.stderr.startswith("kvplan: error: --storage postgresql://kvplan@127.0.0.1:1/db: cannot open")


def _held_trial(study, owner, params=True, role=None):
    dists = {"x": optuna.distributions.IntDistribution(0, 9)}
    attrs = {"kvplan.owner": owner} if owner else {}
    if role:
        attrs["kvplan.role"] = role
    study.add_trial(optuna.trial.create_trial(state=TrialState.RUNNING, params={"x": 3} if params else {},
                                              distributions=dists if params else {}, user_attrs=attrs))
    return study.trials[-1]


def test_journal_fails_dead_owners_and_requeues_evaluations(tmp_path):
    from kvplan.search.storage import HOST, fail_orphaned_trials

    study = optuna.create_study(storage=make_storage(str(tmp_path / "o.journal")), study_name="o")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = _held_trial(study, {"host": HOST, "pid": dead.pid})
    claim = _held_trial(study, {"host": HOST, "pid": dead.pid}, params=False, role="profile-claim")
    live = _held_trial(study, {"host": HOST, "pid": os.getpid()})
    elsewhere = _held_trial(study, {"host": "another-machine", "pid": dead.pid})  # pids of other hosts: unknown
    unowned = _held_trial(study, None)
    assert fail_orphaned_trials(study, grace_s=3600) == 2  # the unowned one is not old enough yet
    states = {t.number: t.state for t in study.trials}
    assert states[gone.number] == states[claim.number] == TrialState.FAIL
    assert states[live.number] == states[elsewhere.number] == states[unowned.number] == TrialState.RUNNING
    (retry,) = study.get_trials(states=(TrialState.WAITING,))  # the evaluation again, not the claim
    assert retry.params == {"x": 3} and retry.system_attrs["failed_trial"] == gone.number
    assert "kvplan.owner" not in retry.user_attrs
    time.sleep(0.1)
    assert fail_orphaned_trials(study, grace_s=0.05) == 1
    assert study.trials[unowned.number].state == TrialState.FAIL


def test_rdb_heartbeat_fails_stale_trials_from_any_host(tmp_path):
    from kvplan.search.storage import Heartbeat, fail_orphaned_trials

    url = f"sqlite:///{tmp_path / 'h.db'}"
    st = make_storage(url, heartbeat_interval=1, grace_period=2)
    study = optuna.create_study(storage=st, study_name="h")
    hb = Heartbeat(st)
    try:
        stale = _held_trial(study, {"host": "another-machine", "pid": 1})
        st.record_heartbeat(stale._trial_id)  # one heartbeat, then its worker died
        kept = _held_trial(study, {"host": "another-machine", "pid": 1})
        hb.hold(kept._trial_id)  # a live worker keeps beating
        time.sleep(3.5)
        assert fail_orphaned_trials(study) == 1
        assert study.trials[stale.number].state == TrialState.FAIL
        assert study.trials[kept.number].state == TrialState.RUNNING
        (retry,) = study.get_trials(states=(TrialState.WAITING,))
        assert retry.system_attrs["failed_trial"] == stale.number
    finally:
        hb.close()


def test_journal_heartbeat_fails_stale_trials_from_any_host(tmp_path):
    """A journal file has no Optuna heartbeat: kvplan's own (``kvplan.beat``) finds a worker of
    another machine that stopped beating, which the pid rule cannot."""
    from kvplan.search.storage import BEAT, Heartbeat, fail_orphaned_trials

    st = make_storage(str(tmp_path / "b.journal"), heartbeat_interval=1, grace_period=2)
    study = optuna.create_study(storage=st, study_name="b")
    hb = Heartbeat(st)
    try:
        stale = _held_trial(study, {"host": "another-machine", "pid": 1})
        st.set_trial_user_attr(stale._trial_id, BEAT, time.time())  # one beat, then its worker died
        kept = _held_trial(study, {"host": "another-machine", "pid": 1})
        hb.hold(kept._trial_id)
        assert fail_orphaned_trials(study) == 0
        time.sleep(3.5)
        assert fail_orphaned_trials(study) == 1
        assert study.trials[stale.number].state == TrialState.FAIL
        assert study.trials[kept.number].state == TrialState.RUNNING
        (retry,) = study.get_trials(states=(TrialState.WAITING,))
        assert retry.system_attrs["failed_trial"] == stale.number and BEAT not in retry.user_attrs
    finally:
        hb.close()


class _StopsAfter(SyntheticScorer):
    """A search killed after ``n`` evaluations (Ctrl-C in the middle of the study)."""

    def __init__(self, n):
        super().__init__()
        self.n = n

    def __call__(self, plan):
        if self.calls >= self.n:
            raise KeyboardInterrupt
        return super().__call__(plan)


def test_finalize_warns_when_the_study_stopped_short_of_its_trials(tmp_path):
    storage = str(tmp_path / "short.journal")
    fast = dict(budget="3.0", progress=False, n_candidates=4, n_local=8, profile=False, storage=storage,
                study_name="s")
    with pytest.raises(KeyboardInterrupt):
        search(n_trials=8, scorer=_StopsAfter(3), out=None, **fast)
    with pytest.warns(UserWarning, match=r"study s holds 3 complete trial\(s\) of the 8 its workers asked for"):
        r = search(n_trials=8, scorer=SyntheticScorer(), out=str(tmp_path / "p.yaml"), finalize=True, **fast)
    assert r.n_real_evals == 0 and r.n_study_trials == 3 and r.plan.metrics["search"]["n_trials"] == 3
    # the study finished: its export is silent, and the run's total counts every trial of the study
    done = search(n_trials=8, scorer=SyntheticScorer(), out=str(tmp_path / "q.yaml"), **fast)
    assert done.n_real_evals == 5 and done.n_study_trials == 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        search(n_trials=8, scorer=SyntheticScorer(), out=str(tmp_path / "r.yaml"), finalize=True, **fast)


class _HeldOut(SyntheticScorer):
    """A validation / test scorer over ``n`` samples (what the harness's scorers expose: ``prepared``)."""

    def __init__(self, n):
        from types import SimpleNamespace

        from kvplan.evaluation.harness import Sample

        super().__init__()
        self.prepared = [SimpleNamespace(sample=Sample([1, 2, i], ["text"] * 3, [4])) for i in range(n)]


def test_a_finished_study_rerun_on_other_test_samples_is_measured_again(tmp_path):
    """Re-running a finished study with the same --trials but other validation / test samples measures
    and exports again (it used to return the old export, its test KL on the old samples, writing nothing)."""
    storage = str(tmp_path / "h.journal")
    fast = dict(budget="3.0", progress=False, n_candidates=4, n_local=8, profile=False, storage=storage,
                study_name="h", n_trials=4)
    first = search(scorer=SyntheticScorer(), validation_scorer=_HeldOut(2), test_scorer=_HeldOut(2),
                   out=str(tmp_path / "a.yaml"), **fast)
    same = search(scorer=SyntheticScorer(), validation_scorer=_HeldOut(2), test_scorer=_HeldOut(2),
                  out=str(tmp_path / "b.yaml"), **fast)
    assert first.finalized_by is None and same.finalized_by is not None and not (tmp_path / "b.yaml").exists()
    other = search(scorer=SyntheticScorer(), validation_scorer=_HeldOut(2), test_scorer=_HeldOut(1),
                   out=str(tmp_path / "c.yaml"), **fast)
    assert other.finalized_by is None and other.n_real_evals == 0 and (tmp_path / "c.yaml").exists()


def test_a_read_only_journal_file_is_one_line_before_any_work(tmp_path):
    """A journal file that cannot be written, in a writable folder, failed inside Optuna's first append with
    a raw PermissionError traceback (Optuna opens an existing file for appending only when it writes)."""
    import shutil

    path = tmp_path / "study.journal"
    make_storage(str(path))  # an empty journal, then read-only
    os.chmod(path, 0o444)
    code = ("import sys\nfrom kvplan.search import make_storage\nfrom kvplan.search.storage import StorageError\n"
            "try:\n    make_storage(sys.argv[1])\nexcept StorageError as e:\n    print('StorageError:', e)\n")
    # root writes any file: drop the capability that lets it, so that the file's mode applies
    prefix = (["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
              if os.geteuid() == 0 and shutil.which("setpriv") else [])
    if os.geteuid() == 0 and not prefix:
        pytest.skip("running as root without setpriv: a file's mode does not stop root")
    r = subprocess.run(prefix + [sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == f"StorageError: --storage {path}: cannot open the journal file: Permission denied"


def test_a_slot_failed_as_stale_by_another_worker_is_lost_not_an_error():
    """On a loaded machine a worker's heartbeat can be late past the grace period: another worker fails its
    trial, and reserving a slot under it raised Optuna's UpdateFinishedTrialError and killed the worker (seen
    in CI, TestStorageContract.test_two_workers_share_one_study[sqlite])."""
    from kvplan.search._workers import reserve

    study = optuna.create_study()
    trial = study.ask()
    study.tell(trial, state=TrialState.FAIL)  # what the other worker's fail_orphaned_trials does
    frozen = study._storage.get_trial(trial._trial_id)
    assert reserve(study, frozen, "plan-key", n_trials=4, done_keys=set()) == "lost"


def test_a_journal_whose_last_write_never_finished_resumes_without_it(tmp_path):
    """A full disk (or a kill) mid-append left a last line without its newline; every later run was refused until
    the user deleted that line by hand, although the error of the failed run said the same command resumes.
    The torn tail is dropped (a warning says how many bytes), the whole records are kept, and the study resumes;
    a broken line that is not the last one is still refused."""
    storage = tmp_path / "t.journal"
    fast = dict(budget="3.0", progress=False, n_candidates=4, n_local=8, profile=False, storage=str(storage),
                study_name="t", out=None)
    search(n_trials=4, scorer=SyntheticScorer(), **fast)
    whole = storage.read_bytes()
    assert whole.endswith(b"\n")
    storage.write_bytes(whole + b'{"op_code": 4, "worker_id": "w", "trial_id": 9, "sta')  # ENOSPC mid-record
    with pytest.warns(UserWarning, match=r"--storage .*t\.journal: dropped its last line \(52 bytes without a "
                                         r"newline"):
        r = search(n_trials=6, scorer=SyntheticScorer(), **fast)
    assert r.n_real_evals == 2 and r.n_study_trials == 6 and storage.read_bytes().startswith(whole)
    lines = storage.read_bytes().split(b"\n")
    storage.write_bytes(b"\n".join(lines[:3] + [lines[3][:10]] + lines[4:]))  # a broken line inside the file
    with pytest.raises(StorageError, match="line 4 is not an Optuna journal record"):
        search(n_trials=6, scorer=SyntheticScorer(), **fast)
