"""Issue 18's "done when": two ``kvplan search`` workers, started as a user starts them on two
machines, on one study of a throwaway PostgreSQL server on a loopback port; one is killed with
kill -9 midway; the other finishes the search: no trial lost or duplicated, exactly
``--trials`` trials, one exported plan (on the real default model, small settings)."""

import os
import signal
import subprocess
import sys
import time

import optuna
import pytest
from optuna.trial import TrialState

pytestmark = pytest.mark.slow

TRIALS = 8


def _worker(url, i, out):
    exe = os.path.join(os.path.dirname(sys.executable), "kvplan")
    args = [exe, "--threads", "1", "search", "--budget", "3.0bpv", "--trials", str(TRIALS), "--samples", "2",
            "--validation-samples", "1", "--test-samples", "1", "--history-tokens", "256", "--eval-tokens", "8",
            "--no-profile", "--key-correction-rank", "0", "--storage", url, "--study-name", "s",
            "--worker", str(i), "--heartbeat-interval", "1", "--grace-period", "4", "--quiet", "--out", str(out)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_two_cli_workers_on_postgres_one_killed(postgres_url, tmp_path):
    from kvplan import Plan
    from kvplan.search import make_storage
    from kvplan.search.storage import trial_owner

    outs = [tmp_path / f"machine{i}" / "plan.yaml" for i in range(2)]
    for o in outs:
        o.parent.mkdir()
    procs = [_worker(postgres_url, i, outs[i]) for i in range(2)]
    storage = make_storage(postgres_url, heartbeat_interval=None)
    victim, survivor = procs[1], procs[0]
    deadline, killed_at = time.time() + 600, None
    while time.time() < deadline:
        time.sleep(0.2)
        if victim.poll() is not None or survivor.poll() is not None:
            break
        try:
            s = optuna.load_study(study_name="s", storage=storage)
        except KeyError:
            continue
        n_done = len(s.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
        held = [t for t in s.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                if trial_owner(t).get("pid") == victim.pid and t.user_attrs.get("kvplan.eval")]
        if n_done >= 2 and held:  # midway, while it evaluates a trial
            # freeze it first and look again: it may have finished that trial since the read above
            os.kill(victim.pid, signal.SIGSTOP)
            time.sleep(0.5)  # a statement it sent just before is done by the server by now
            still = {t.number for t in optuna.load_study(study_name="s", storage=storage).get_trials(
                deepcopy=False, states=(TrialState.RUNNING,))}
            held_numbers = [t.number for t in held if t.number in still]
            if held_numbers:
                os.kill(victim.pid, signal.SIGKILL)
                killed_at = n_done
                break
            os.kill(victim.pid, signal.SIGCONT)
    assert killed_at is not None, (victim.poll(), survivor.poll(), victim.stderr.read()[-3000:] if victim.poll()
                                   is not None else "")
    victim.wait()
    out, err = survivor.communicate(timeout=900)
    assert survivor.returncode == 0, err[-3000:]
    s = optuna.load_study(study_name="s", storage=storage)
    done = s.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    assert len(done) == TRIALS  # no trial lost, none beyond --trials
    assert len({tuple(sorted(t.params.items())) for t in done}) == TRIALS  # none duplicated
    assert not s.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    assert all(s.trials[n].state == TrialState.FAIL for n in held_numbers)  # the killed worker's trial failed
    # what is left in the queue: seeds the study did not need, or the killed trial queued again
    for t in s.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        assert str(t.user_attrs.get("kvplan.source", "")).split("@")[0].split(":")[0] in (
            "knapsack", "greedy", "baseline") or t.system_attrs.get("failed_trial") in held_numbers, t
    assert {trial_owner(t).get("pid") for t in done} <= {victim.pid, survivor.pid}
    # one exported plan, by the survivor, with its sidecars of the same run
    assert not outs[1].exists() and sorted(os.listdir(outs[1].parent)) == []
    plan = Plan.from_yaml(outs[0])
    assert plan.metrics["search"]["n_trials"] == TRIALS and "test" in plan.metrics
    assert plan.bpv().total <= 3.0 + 1e-9
    names = sorted(os.listdir(outs[0].parent))
    assert names == ["plan.search.json", "plan.trials.csv", "plan.yaml"], names
    import json

    side = json.loads((outs[0].parent / "plan.search.json").read_text())
    assert side["run_id"] == plan.metrics["search"]["run_id"]
    assert "-> " + str(outs[0]) in out
