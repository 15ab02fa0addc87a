"""Several workers on one study: who does the once-per-study jobs, and who may evaluate.

Every primitive here is a trial attribute or a study user attribute (a result, written once
by the worker that produced it). No lock is taken; every rule is "write, then read", which
guarantees that of two workers acting at the same time at least one sees the other's write
(each write is committed before its writer reads):

- **Once-per-study jobs** (:func:`run_once`: the shared setup and sensitivity profile, the
  final validation/test measurement and export). A worker that finds no result adds a RUNNING
  *claim* trial (role ``<job>-claim``, with its owner) and reads the claims: it does the job
  only if it sees **no other** live claim (first writer wins); otherwise it withdraws its
  claim and waits for the result, claiming again (after a random pause) if the live claims all
  disappear without one (their workers died: heartbeat / pid detection fails their claims).
  Two workers that see each other both withdraw and retry, so at most one works.
- **Evaluation slots** (:func:`reserve`): before a real evaluation a worker writes the plan's
  key into the RUNNING trial it evaluates under (``kvplan.eval``), then counts COMPLETE trials
  plus the *other* workers' RUNNING trials with a key. It goes ahead only when that is below
  ``n_trials`` and nobody else has the same plan in flight or done. So the study ends with
  exactly ``n_trials`` COMPLETE trials and no plan is evaluated twice.
"""

from __future__ import annotations

import base64
import hashlib
import random
import time
import uuid
import warnings
from typing import Callable

import numpy as np
import optuna
from optuna.trial import TrialState

from .storage import Heartbeat, fail_orphaned_trials, trial_owner

POLL_S = 0.5


def key_hash(key: tuple) -> str:
    return hashlib.sha1(repr(key).encode()).hexdigest()[:20]


def quiet_ask(study: optuna.Study, dists=None):
    """``study.ask`` without Optuna's "heartbeat is supposed to be used with optimize" warning:
    kvplan runs the heartbeat itself (:class:`Heartbeat`)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Heartbeat of storage")
        return study.ask(dists)


def tell(study: optuna.Study, trial, hb: Heartbeat | None, values=None, state=None) -> bool:
    """Tell ``trial`` (a ``Trial`` or a ``FrozenTrial``); ``False`` when it was already finished
    (another worker failed it as stale: this worker lost it)."""
    tid = trial._trial_id
    t = trial if isinstance(trial, optuna.Trial) else optuna.Trial(study, tid)
    try:
        study.tell(t, values, state=state)
        return True
    except ValueError as e:
        if "Cannot tell" not in str(e):
            raise
        return False
    finally:
        if hb is not None:
            hb.release(tid)


def add_running(study: optuna.Study, owner: dict, hb: Heartbeat, attrs: dict):
    """A bookkeeping RUNNING trial (no params) owned by ``owner``, then ``attrs`` written into it;
    returns its ``FrozenTrial`` (held by the heartbeat).

    The attributes that make the trial count (a claim's role, a reservation's plan key) are
    written only after its first heartbeat: a worker killed in between leaves a trial that
    counts for nothing, never one that counts forever without a heartbeat to expire it."""
    token = uuid.uuid4().hex
    study.add_trial(optuna.trial.create_trial(state=TrialState.RUNNING,
                                              user_attrs={"kvplan.owner": {**owner, "token": token}}))
    for t in reversed(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))):
        if trial_owner(t).get("token") == token:
            hb.hold(t._trial_id)
            for k, v in attrs.items():
                study._storage.set_trial_user_attr(t._trial_id, k, v)
            return study._storage.get_trial(t._trial_id)
    raise AssertionError("internal: the trial just added is not in the study")


def run_once(study: optuna.Study, job: str, result_attr: str, work: Callable[[], object], owner: dict,
             hb: Heartbeat, persistent: bool, on_wait: Callable[[], None] | None = None,
             force: bool = False, timeout_s: float | None = None, valid: Callable[[object], bool] | None = None):
    """``study.user_attrs[result_attr]``, computed by ``work()`` in exactly one worker of the
    study (this one or another). ``work`` must set ``result_attr`` itself before returning
    (the value is read back from the study). ``force``: do it now even if a result exists.
    ``valid(value)``: whether a stored result still holds (default: any stored value does)."""
    def have() -> bool:
        attrs = study.user_attrs
        return result_attr in attrs and (valid is None or valid(attrs[result_attr]))

    if not persistent:
        if force or not have():
            work()
        return study.user_attrs.get(result_attr)
    role = f"{job}-claim"
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    waited = False
    while True:
        if not force and have():
            return study.user_attrs[result_attr]
        claim = add_running(study, owner, hb, {"kvplan.role": role})
        others = [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                  if t.user_attrs.get("kvplan.role") == role and t._trial_id != claim._trial_id]
        if not others:
            if not force and have():  # finished between our two reads
                tell(study, claim, hb, state=TrialState.FAIL)
                return study.user_attrs[result_attr]
            try:
                work()
            finally:
                tell(study, claim, hb, state=TrialState.FAIL)  # bookkeeping only: never counts
            return study.user_attrs.get(result_attr)
        tell(study, claim, hb, state=TrialState.FAIL)  # withdraw: someone else is (or may be) on it
        force = False  # a forced job running elsewhere: take its result
        if not waited and on_wait is not None:
            on_wait()
            waited = True
        # wait until the result appears or every live claim is gone (its worker died)
        while True:
            if have():
                return study.user_attrs[result_attr]
            fail_orphaned_trials(study)
            live = [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                    if t.user_attrs.get("kvplan.role") == role]
            if not live:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s} s for another worker's {job}")
            time.sleep(POLL_S)
        time.sleep(random.uniform(0.05, 0.5))  # both withdrew at once: do not collide again


def reserve(study: optuna.Study, trial, key: str, n_trials: int, done_keys: set[str]) -> str:
    """Take an evaluation slot under ``trial`` (RUNNING, held by this worker) for the plan ``key``:
    ``"ok"``, ``"duplicate"`` (done, or in flight elsewhere), ``"full"`` (the study's ``n_trials``
    are done or in flight) or ``"lost"`` (another worker failed ``trial`` as stale: a heartbeat late
    on a loaded machine). Writes ``kvplan.eval`` into ``trial`` first."""
    if key in done_keys:
        return "duplicate"
    if trial.user_attrs.get("kvplan.eval") != key:
        try:
            study._storage.set_trial_user_attr(trial._trial_id, "kvplan.eval", key)
        except optuna.exceptions.UpdateFinishedTrialError:
            return "lost"
    n_complete, others = 0, []
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING)):
        if t.state == TrialState.COMPLETE:
            n_complete += 1
            if t.user_attrs.get("kvplan.key") == key:
                return "duplicate"
        elif t._trial_id != trial._trial_id and t.user_attrs.get("kvplan.eval"):
            others.append(t.user_attrs["kvplan.eval"])
    if key in others:
        return "duplicate"
    if n_complete + len(others) >= n_trials:
        return "full"
    return "ok"


def in_flight(study: optuna.Study, mine: set[int]) -> int:
    """RUNNING trials of other workers (or of this one, not in ``mine``) holding an evaluation slot."""
    return sum(1 for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
               if t.user_attrs.get("kvplan.eval") and t._trial_id not in mine)


def encode_array(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a)
    return {"dtype": str(a.dtype), "shape": list(a.shape), "base64": base64.b64encode(a.tobytes()).decode("ascii")}


def decode_array(d: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(d["base64"]), dtype=np.dtype(d["dtype"])).reshape(d["shape"]).copy()
