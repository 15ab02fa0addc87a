"""``kvplan.search``: budgeted plan search with a random-forest surrogate.

The flow (one worker; several workers run the same loop on one shared study):

1. **Space and budget.** Build the :class:`SearchSpace`; parse the budget (honest bpv at
   the reference); fail at once when the budget is below the cheapest reachable plan (before the
   full-precision prefills when search() builds its own scorers, as the CLI does).
2. **Shared setup** (once per study, by one worker: :func:`._workers.run_once`): the
   key-correction bases and the **sensitivity profile** (``profile=True``: KL with one
   (layer, kind) unit at the lowest bits, the rest full precision, see :mod:`.sensitivity`),
   stored on the study; other workers wait for them and reuse them, as does a resume.
3. **Seeds** (once per study): the knapsack allocation from the profile for every feasible
   quantizer setting, the greedy top-down repair of the all-high table, and the baselines
   that fit (uniform ``KbVb`` plans at every group size/residual that fits, e.g.
   ``int2-g128-r0``, ``k4v2``...). They are ``enqueue_trial``-ed, so they are ordinary trials.
4. **Rounds** until the study holds exactly ``n_trials`` COMPLETE trials (a total over all
   workers and resumes; every COMPLETE trial is one real evaluation; each evaluation first
   takes a slot with :func:`._workers.reserve`, so no plan is measured twice and the total is
   never exceeded; a dead worker's slot is freed by the heartbeat and its trial queued again):

   - while enqueued trials wait, or fewer than ``n_startup`` trials are complete, or the
     surrogate is off: ``ask`` one trial, repair, evaluate, tell;
   - otherwise: ``ask`` ``n_candidates`` trials from TPE and make ``n_local`` mutations of
     the best plans found (raise/lower 1-3 groups); repair all; fit the random forest on
     the COMPLETE trials (on log-KL minus the log of the profile's damage estimate, which it
     adds back); rank candidates by ``mean - kappa * std`` of predicted log-KL;
     evaluate only the best ``top_k`` for real. TPE proposes few of the candidates by default
     (``n_candidates=4``): over 183 parameters each ask costs ~0.25 s on the 2-core box, and in
     the recorded default and Gemma-3 searches the surrogate chose 1 of ~740 TPE proposals (it
     ranked 40th of 60), against all the other 92 search-phase evaluations from mutations.

   **What Optuna is told.** A COMPLETE trial's params are always exactly the plan that was
   evaluated. When repair changed an asked trial (or the asked trial was evaluated as a
   mutation) the evaluated point is added with ``study.add_trial`` (atomic; works with
   several workers, unlike enqueue-then-ask which another worker could pop) and the asked
   trial is told ``FAIL`` with ``user_attrs["kvplan.role"] = "repaired"``. Asked candidates
   the surrogate screened out are told ``FAIL`` with ``kvplan.role = "screened"`` and the
   predicted log-KL: TPE ignores failed trials, so they neither count nor bias it, and the
   record of what was screened stays in the study. Mutation candidates that are not chosen
   are never asked (so they leave no trace). A measurement whose KL is not finite (an overflow in the
   model's dtype, a failing scorer) is a ``FAIL`` trial of the plan measured, ``kvplan.role = "non-finite"``,
   counted apart from the real trials (``SearchResult.n_non_finite_evals``; the first one is warned about).

5. **Result** (once per study, by the first worker to find it complete, or by
   ``finalize=True``). Best COMPLETE trial (single objective), or the Pareto front of (KL, bpv)
   and the best plan under each budget (``budget=[...]`` / ``pareto=True``). Each chosen plan is
   re-measured by the validation and test scorers; metrics + honest bpv go into the plan,
   written with ``<stem>.trials.csv`` (every COMPLETE trial, its full bit table, the host and
   pid that measured it) and ``<stem>.search.json`` (space, budget, profile, curve, Pareto
   front, baselines) as one set (:func:`kvplan.plans._files.write_file_set`) sharing one
   ``run_id``, so ``kvplan explain`` can tell a plan beside another run's sidecars. The
   other workers return the same plans (``SearchResult.finalized_by`` names who wrote them).

Same seed -> same plan (in memory, or with a storage and an explicit ``worker`` id; workers
without an id on a persistent storage mix the process id into the sampler seed so that they
do not propose identical plans).
"""

from __future__ import annotations

import contextlib
import csv
import inspect
import io
import json
import math
import os
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Protocol, Sequence

import numpy as np
import optuna
from optuna.trial import TrialState

from ..errors import MAX_SEED, KVPlanError, check_seed, describe
from ..models.geometry import Geometry
from ..models.modality import TOKEN_IDS_NAME
from ..plans import Plan, Provenance, QuantizerSettings, Reference, atomic_write_text
from ..surrogates import ForestSurrogate, PlanFeatures, log_kl
from .budget import (
    EPS,
    BpvModel,
    BudgetError,
    group_damage,
    knapsack_seed,
    parse_budget,
    repair,
)
from .feedback_metric import feedback_metric, output_projections
from .key_basis import basis_of_moments, query_second_moments
from .sensitivity import DEFAULT_HEAD_UNITS, correction_factor, recent_factor, run_profile, slot_sensitivity
from .streaming import (STREAM_PARTS_KEYS, STREAM_SCALE_KEY, calibrate_streaming, choose_streamed,
                        run_streaming_profile, searched_stream_heads, stream_sink)
from .config import SearchConfig, resolve_formats, resolve_stream_window
from .space import (DEFAULT_BITS, DEFAULT_GROUP_SIZES, DEFAULT_HEAVY_LENGTH, DEFAULT_KEY_AXES, DEFAULT_RECENT_LENGTHS,
                    DEFAULT_RESIDUAL_BITS, DEFAULT_RESIDUAL_LENGTHS, DEFAULT_SINK_BITS, DEFAULT_SINK_LENGTHS,
                    DEFAULT_TRIALS, SearchSpace)
from ..plans._files import (budget_plan_path, check_not_inputs, check_writable, existing_path, journal_path,
                            sidecar_paths, write_file_set)  # noqa: F401 -- sidecar_paths is public
from ._workers import (POLL_S, add_running, decode_array, encode_array, in_flight, key_hash, quiet_ask, reserve,
                       run_once, tell)
from .storage import (DEFAULT_GRACE_S, DEFAULT_HEARTBEAT_S, Heartbeat, RetryStale, check_journal_file,
                      describe_storage, fail_and_requeue, fail_orphaned_trials, hold_journal, is_persistent,
                      make_storage, owner_attrs, storage_file, trial_owner)

optuna.logging.set_verbosity(optuna.logging.WARNING)


class Scorer(Protocol):
    """Scores a candidate plan: ``scorer(plan) -> {"kl": mean KL, "bpv": honest bpv, ...}``.

    Optional attributes used when present: ``geometry`` (:class:`Geometry`), ``modalities``
    (tuple of names the task labels tokens with), ``reference`` (:class:`Reference` at which
    the budget is stated), ``data_hash`` (recorded in the plan's provenance).
    Extra numeric keys (``nll``, ``accuracy``, ``kl_se``...) are recorded.
    """

    def __call__(self, plan: Plan) -> Mapping[str, Any]: ...


@dataclass
class SearchResult:
    """What :func:`search` found. ``plan`` is the exported plan (the one for the tightest
    budget in Pareto mode); ``plans`` maps each budget to its plan."""

    plan: Plan
    plans: dict[float, Plan]
    study: optuna.Study
    space: SearchSpace
    budgets: list[float]
    profile: dict[str, float] | None
    curve: list[tuple[int, float, float]]  # (n real evals, best KL so far, its bpv) in trial order
    pareto: list[dict]
    n_real_evals: int  # this run's trials (measured, KL finite)
    n_profile_evals: int
    elapsed_s: float
    paths: dict[str, str] = field(default_factory=dict)
    n_non_finite_evals: int = 0  # this run's measurements whose KL was not finite: FAILed, not trials
    finalized_by: dict | None = None  # who measured and exported the plans, when not this call
    # what this call did with the export: "written" (measured and written now), "rewritten" (an earlier run of
    # the same command measured it, and its files at ``out`` had gone missing), "in place" (that earlier run's
    # files hold it), "elsewhere" (another worker wrote it at its own ``out``; ``paths`` is empty)
    export: str = "written"

    @property
    def n_study_trials(self) -> int:
        """COMPLETE trials in the study: this run's ``n_real_evals`` plus those of other workers and earlier runs."""
        return len(self.curve)

    @property
    def best_kl(self) -> float:
        return float(self.plan.metrics.get("calibration", {}).get("kl", float("nan")))


# ----------------------------------------------------------------------------- helpers
def _plain(v):
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, (np.floating, float)):
        f = float(v)
        return f if math.isfinite(f) else None
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (bool, int, str)) or v is None:
        return v
    return str(v)


def _metrics_of(res: Mapping) -> dict:
    """Scalar metrics of a scorer result (lists such as per-sample KL are dropped)."""
    out = {}
    for k, v in res.items():
        if isinstance(v, (bool, str)):
            continue
        if isinstance(v, (int, float, np.integer, np.floating)) and math.isfinite(float(v)):
            out[str(k)] = float(v)
    return out


def _stated_at(reference: Reference, context_len: int | None) -> Reference:
    """``reference`` with the context length the budget is stated at (``context_len``; ``None``: its own)."""
    if context_len is None or reference.context_len == context_len:
        return reference
    return Reference(int(context_len), reference.modality_mix, reference.full_precision_bits)


def _pick_on_validation(candidates: list, validation_scorer, evaluate_params) -> tuple[Any, dict, list[dict]]:
    """The candidate trial with the lowest validation KL: ``(trial, its validation metrics, table
    of every candidate's calibration and validation KL)``. Candidates come best-first by
    calibration KL; ties keep that order."""
    rows, best = [], None
    for t in candidates:
        m = _metrics_of(validation_scorer(evaluate_params(t.params)))
        rows.append({"trial": t.number, "calibration_kl": t.values[0], "validation_kl": m.get("kl")})
        if best is None or m.get("kl", math.inf) < best[1].get("kl", math.inf):
            best = (t, m)
    return best[0], best[1], rows


def _key(levels, q) -> tuple:
    return (q.group_size, q.key_axis, q.value_axis, q.residual_length, q.sink_length,
            tuple(int(x) for x in levels)) + ((q.recent_length,) if q.recent_length else ())


# ----------------------------------------------------------------------------- the search
MAX_DUPLICATE_ASKS = 8  # TPE proposals repairing to known plans before falling back to a mutation
TRIALS_TARGET_ATTR = "kvplan.trials_target"  # study attr: the largest --trials a worker or resume asked for
NON_FINITE_ROLE = "non-finite"  # kvplan.role of a FAILed trial whose measured KL was not finite
OWN_JOURNAL = "--out's study journal"  # how errors name the journal a search keeps beside --out
NO_NEW_PLAN = "(few plans fit the budget in this search space, or the proposals keep landing on measured ones)"


@dataclass(frozen=True)
class SurrogateSettings:
    """How the search proposes trials (the module docstring's loop): after ``n_startup`` complete trials,
    ``n_candidates`` TPE asks and ``n_local`` mutations of the best plans are ranked by the forest's
    ``mean - kappa * std`` of predicted log-KL (of log-KL minus the profile's prior where ``offset``), and
    the best ``top_k`` are evaluated; ``enabled=False``: plain TPE. :func:`search`'s keywords of the same
    names (``surrogate``, ``surrogate_offset`` for ``enabled`` and ``offset``) build it."""

    enabled: bool = True
    n_candidates: int = 4
    n_local: int = 32
    top_k: int = 2
    n_startup: int = 8
    kappa: float = 0.5
    offset: bool = True


class _Searcher:
    def __init__(self, *, space: SearchSpace, reference: Reference, budgets: list[float], scorer: Scorer,
                 study: optuna.Study, seed: int, rng_seed: int, n_trials: int, strategy: SurrogateSettings,
                 persistent: bool, progress: bool, profile: dict | None, multi: bool = False,
                 heartbeat: Heartbeat | None = None, owner: dict | None = None):
        self.space, self.reference, self.budgets, self.scorer = space, reference, budgets, scorer
        self.budget = max(budgets)  # the repair ceiling (every trial fits the loosest budget)
        self.multi = multi or len(budgets) > 1
        self.study, self.seed, self.n_trials = study, seed, n_trials
        self.strategy = strategy
        self.persistent, self.show_progress = persistent, progress
        self.rng = np.random.default_rng(rng_seed)
        self.model = BpvModel(space, reference)
        self.dists = space.distributions()
        self.profile = profile
        self.sens = slot_sensitivity(space, profile)
        self.damage = group_damage(space, self.sens, correction_factor(profile))
        self.features = PlanFeatures(space.shape, space.modalities, with_prior=profile is not None,
                                     with_recent=len(space.recent_lengths) > 1)
        self.n_evals = 0  # this run's trials measured and told COMPLETE
        self.n_non_finite = 0  # this run's measurements whose KL was not finite (FAILed trials)
        self.bar = None
        self.hb = heartbeat or Heartbeat(None)
        self.owner = owner or owner_attrs()
        self.mine: set[int] = set()  # trial ids this worker holds (RUNNING)
        self._keys: dict[int, str] = {}  # trial id -> plan key of COMPLETE trials
        self.check_identity = None  # attrs -> None, raises when the study is another setup's

    # ---------------------------------------------------------------- bookkeeping
    def complete(self) -> list[optuna.trial.FrozenTrial]:
        return self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))

    def evaluated_keys(self) -> set[str]:
        """Plan keys (:func:`key_hash`) of the COMPLETE trials (any worker's)."""
        out = set()
        for t in self.complete():
            k = self._keys.get(t._trial_id)
            if k is None:
                k = t.user_attrs.get("kvplan.key") or key_hash(self._key_of_params(t.params))
                self._keys[t._trial_id] = k
            out.add(k)
        return out

    def _key_of_params(self, params):
        return _key(self.space.levels_of(params), self.space.quantizer_of(params))

    def prior(self, levels, q: QuantizerSettings | None = None) -> float:
        """The profile's damage estimate of a plan: the groups' damages at their levels, times the
        measured factor of its recent copies (``recent_factor``; 1 without a quantizer)."""
        damage = float(self.damage[np.arange(len(levels)), levels].sum())
        return damage if q is None else damage * recent_factor(self.profile, q.recent_length)

    def _offset(self, items: list[tuple[np.ndarray, Any]]) -> np.ndarray | None:
        """The surrogate's baseline: log of the profile's additive damage estimate (``None``
        without a profile); the forest learns the rest (see :class:`ForestSurrogate`)."""
        if self.profile is None or not self.strategy.offset:
            return None
        return np.log(np.maximum([self.prior(lv, q) for lv, q in items], 1e-12))

    def _features(self, items: list[tuple[np.ndarray, Any]]) -> np.ndarray:
        tables = np.stack([self.space.table_of_levels(lv) for lv, _ in items])
        return self.features.transform(
            tables, [q.group_size for _, q in items], [q.residual_length for _, q in items],
            [q.key_axis for _, q in items], [self.model.bpv(lv, q) for lv, q in items],
            [self.prior(lv, q) for lv, q in items], sink_lengths=[q.sink_length for _, q in items],
            recent_lengths=[q.recent_length for _, q in items])

    # ---------------------------------------------------------------- seeds
    def enqueue_seeds(self, include_baselines: bool) -> int:
        """Queue the study's seeds once: ``kvplan.seeded`` is set after the last one is queued (other workers
        wait for it, and a seeding cut short by Ctrl-C or a kill is done again), and a seed already measured,
        queued or in flight is not queued twice."""
        if self.study.user_attrs.get("kvplan.seeded"):
            return 0
        seeds: list[tuple[np.ndarray, Any, str]] = []
        for b in sorted(self.budgets):
            for q in self.model.feasible_quantizers(b):
                if self.profile is not None:
                    seeds.append((knapsack_seed(self.model, q, b, self.damage), q, f"knapsack@{b:g}"))
                if q.recent_length != self.space.recent_lengths[0]:
                    continue  # recent copies: the knapsack weighs them against slot bits; no greedy seed
                top = np.array([g.n_levels - 1 for g in self.space.groups])
                lv, q2, _ = repair(self.model, top, q, b, self.damage)
                if q2 == q:
                    seeds.append((lv, q, f"greedy@{b:g}"))
        if include_baselines:
            bits = self.space.bits
            for q in self.model.feasible_quantizers(self.budget):
                if q.recent_length != self.space.recent_lengths[0]:
                    continue  # reference points of the codec alone: recent copies are the search's to weigh
                fits = []
                for kb in bits:
                    for vb in bits:
                        if kb < vb:
                            continue
                        table = np.empty(self.space.shape, dtype=np.int64)
                        table[:, :, 0], table[:, :, 1] = kb, vb
                        lv = self.space.levels_of_table(table)
                        if lv is not None and self.model.bpv(lv, q) <= self.budget + EPS:
                            fits.append((kb, vb, lv))
                # keep the pairs no other fitting pair dominates
                for kb, vb, lv in fits:
                    if not any((k2 >= kb and v2 >= vb and (k2, v2) != (kb, vb)) for k2, v2, _ in fits):
                        name = f"k{kb}v{vb}" if kb != vb else f"int{kb}"
                        seeds.append((lv, q, f"baseline:{name}-g{q.group_size}-r{q.residual_length}"))
        seen = self.evaluated_keys() | self.queued_keys()
        n = 0
        for lv, q, source in seeds:
            k = key_hash(_key(lv, q))
            if k in seen:
                continue
            seen.add(k)
            self.study.enqueue_trial(self.space.params_of(lv, q), user_attrs={"kvplan.source": source})
            n += 1
        self.study.set_user_attr("kvplan.seeded", True)
        return n

    def queued_keys(self) -> set[str]:
        """Plan keys of the trials enqueued with fixed parameters that are waiting or being measured."""
        out = set()
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING)):
            fixed = t.system_attrs.get("fixed_params")
            if isinstance(fixed, dict) and fixed:
                out.add(key_hash(self._key_of_params(fixed)))
        return out

    # ---------------------------------------------------------------- trials this worker holds
    def _set_attr(self, trial, key, value) -> bool:
        """Set a user attr of a trial this worker holds; ``False`` if it is already finished."""
        try:
            self.study._storage.set_trial_user_attr(trial._trial_id, key, value)
            return True
        except (optuna.exceptions.UpdateFinishedTrialError, RuntimeError, ValueError):
            return False

    def _drop(self, trial, role: str) -> None:
        """Finish a held trial that is not evaluated: ``FAIL`` with ``kvplan.role = role``."""
        self._set_attr(trial, "kvplan.role", role)
        self.mine.discard(trial._trial_id)
        tell(self.study, trial, self.hb, state=TrialState.FAIL)

    def _reservation(self, key: str):
        """A bookkeeping RUNNING trial holding an evaluation slot for a plan no asked trial carries."""
        t = add_running(self.study, self.owner, self.hb, {"kvplan.role": "reservation", "kvplan.eval": key})
        self.mine.add(t._trial_id)
        return t

    # ---------------------------------------------------------------- one real evaluation
    def evaluate(self, levels, q, source: str, asked=None, pred: float | None = None, extra: dict | None = None):
        """Evaluate one plan for real under ``asked`` (a held trial) or a new reservation trial.
        Returns ``(kl, bpv)``, or ``None`` when no slot was free or another worker has (or is
        evaluating) the same plan (see :func:`kvplan.search._workers.reserve`)."""
        params = self.space.params_of(levels, q)
        plan = self.space.plan_of(params, self.reference)
        bpv = plan.bpv().total
        if bpv > self.budget + 1e-6:  # BpvModel and the accounting disagree: a bug, never evaluate
            raise AssertionError(f"internal: repaired plan has {bpv} bpv > budget {self.budget}")
        key = key_hash(_key(levels, q))
        if asked is None and not self.persistent:  # one worker: nothing to reserve against
            if key in self.evaluated_keys() or self.complete_count() >= self.n_trials:
                return None
        else:
            if asked is None:
                asked = self._reservation(key)
            status = reserve(self.study, asked, key, self.n_trials, self.evaluated_keys())
            if status != "ok":
                self._drop(asked, status if isinstance(asked, optuna.Trial) else "reservation")
                return None
        t0 = time.perf_counter()
        res = self.scorer(plan)
        dt = time.perf_counter() - t0
        kl = float(res["kl"])
        ok = math.isfinite(kl)
        attrs = {"kvplan.source": source, "kvplan.bpv": bpv, "kvplan.eval_s": dt,
                 "kvplan.metrics": _plain(_metrics_of(res)), "kvplan.key": key}
        if pred is not None:
            attrs["kvplan.pred_log_kl"] = float(pred)
        if extra:
            attrs.update(extra)
        if not ok:  # measured, but no trial: recorded FAIL with its plan, counted apart from the trials
            attrs["kvplan.role"] = NON_FINITE_ROLE
            self.n_non_finite += 1
            if self.n_non_finite == 1:
                warnings.warn(f"kvplan: a plan's calibration KL is {kl} (not finite: overflow in the model's "
                              f"dtype, or a scorer that failed); it is recorded as a FAILed trial with "
                              f"kvplan.role '{NON_FINITE_ROLE}' and the search goes on", stacklevel=2)
        values = [kl, bpv] if self.multi else [kl]
        same = isinstance(asked, optuna.Trial) and dict(asked.params) == params
        lost = False
        if same:
            for k, v in attrs.items():
                lost = lost or not self._set_attr(asked, k, v)
            self.mine.discard(asked._trial_id)
            lost = lost or not tell(self.study, asked, self.hb, values if ok else None,
                                    state=TrialState.COMPLETE if ok else TrialState.FAIL)
        else:
            # the slot is still ours only while the trial holding it runs (another worker fails
            # it when its heartbeat stops, and may then measure it again)
            lost = asked is not None and self.study._storage.get_trial(asked._trial_id).state != TrialState.RUNNING
            if not lost:  # a measurement that failed is kept too, as the FAILed trial of the plan measured
                self.study.add_trial(optuna.trial.create_trial(
                    params=params, distributions={k: self.dists[k] for k in params}, values=values if ok else None,
                    state=TrialState.COMPLETE if ok else TrialState.FAIL,
                    user_attrs={**attrs, "kvplan.owner": self.owner}))
            if asked is not None:
                self._drop(asked, "repaired" if isinstance(asked, optuna.Trial) else "reservation")
        if lost:
            warnings.warn(f"kvplan: trial {asked.number} was failed by another worker while this one evaluated it "
                          "(heartbeat late: raise --grace-period); its result is dropped")
            return None
        if ok:
            self.n_evals += 1
            self._progress(kl, bpv)
        return kl, bpv

    def _progress(self, kl, bpv):
        if self.bar is None:
            return
        self.bar.update(1)
        best = self.best_so_far()
        if best:
            self.bar.set_postfix_str(f"best KL {best[0]:.4g} @ {best[1]:.3f} bpv")

    def best_so_far(self):
        best = None
        for t in self.complete():
            kl = t.values[0]
            if best is None or kl < best[0]:
                best = (kl, t.user_attrs.get("kvplan.bpv", float("nan")))
        return best

    # ---------------------------------------------------------------- candidates
    ASK_TRIES = 5

    def ask(self):
        """A new trial, held by this worker. Another worker may fail it as orphaned while it is being asked
        (it has no owner yet: an ask on a loaded storage outlasting ``grace_period``); that trial is left
        failed and another is asked, instead of the worker ending on Optuna's UpdateFinishedTrialError."""
        for _ in range(self.ASK_TRIES):
            t = None
            try:
                t = quiet_ask(self.study, self.dists)
                self.hb.hold(t._trial_id)
                self.mine.add(t._trial_id)
                t.set_user_attr("kvplan.owner", self.owner)  # provenance: who measured it (and, shared, who holds it)
                return t
            except optuna.exceptions.UpdateFinishedTrialError:
                if t is not None:  # lost after study.ask returned: no longer this worker's
                    self.hb.release(t._trial_id)
                    self.mine.discard(t._trial_id)
                warnings.warn("kvplan: a trial was failed by another worker while this one asked for it (an ask "
                              "longer than --grace-period); asking again", stacklevel=2)
        raise KVPlanError(f"{self.ASK_TRIES} trials in a row were failed by another worker while this one asked "
                          "for them: the storage is slower than --grace-period allows; give a longer --grace-period")

    def repaired(self, params) -> tuple[np.ndarray, Any]:
        lv, q, _ = repair(self.model, self.space.levels_of(params), self.space.quantizer_of(params), self.budget,
                          self.damage)
        return lv, q

    def mutations(self, n: int) -> list[tuple[np.ndarray, Any]]:
        done = sorted(self.complete(), key=lambda t: t.values[0])
        if not done:
            return []
        parents = done[: max(1, min(5, len(done)))]
        out = []
        G = len(self.space.groups)
        for _ in range(n):
            p = parents[min(int(self.rng.geometric(0.5)) - 1, len(parents) - 1)]
            lv = self.space.levels_of(p.params).copy()
            q = self.space.quantizer_of(p.params)
            for gi in self.rng.choice(G, size=int(self.rng.integers(1, 4)), replace=False):
                top = self.space.groups[gi].n_levels - 1
                lv[gi] = int(np.clip(lv[gi] + self.rng.choice([-1, 1, 1]), 0, top))
            if self.rng.random() < 0.1 and len(self.space.quantizers()) > 1:
                qs = self.model.feasible_quantizers(self.budget)
                q = qs[int(self.rng.integers(len(qs)))]
            elif len(self.space.recent_lengths) > 1 and self.rng.random() < 0.1:
                # a neighbour in recent copies alone (repair pays for more copies with slot bits)
                q = replace(q, recent_length=int(self.rng.choice(
                    [w for w in self.space.recent_lengths if w != q.recent_length])))
            lv, q, _ = repair(self.model, lv, q, self.budget, self.damage)
            out.append((lv, q))
        return out

    def step_single(self) -> None:
        """Ask one trial, repair, evaluate (skip duplicates).

        Near the budget floor most proposals repair to an already evaluated plan; every such
        ask is told as a FAILed trial, which makes TPE's next ask slower, so after a few
        duplicates in a row a local mutation of the best plans is evaluated instead.
        """
        for _ in range(MAX_DUPLICATE_ASKS):
            t = self.ask()
            source = t.user_attrs.get("kvplan.source", "tpe")
            lv, q = self.repaired(t.params)
            if key_hash(_key(lv, q)) in self.evaluated_keys():
                self._drop(t, "duplicate")
                continue
            self.evaluate(lv, q, source, asked=t)
            return
        # TPE keeps proposing known plans: fall back to a mutation
        for lv, q in self.mutations(20):
            if key_hash(_key(lv, q)) not in self.evaluated_keys():
                if self.evaluate(lv, q, "mutation") is not None or self._full():
                    return

    def _full(self) -> bool:
        """The study's ``n_trials`` are done or in flight (this worker's held slots included)."""
        return self.complete_count() + in_flight(self.study, set()) >= self.n_trials

    def step_surrogate(self) -> None:
        done = self.complete()
        items = [(self.space.levels_of(t.params), self.space.quantizer_of(t.params)) for t in done]
        y = log_kl([t.values[0] for t in done])
        sur = ForestSurrogate(seed=(self.seed + len(done)) % (MAX_SEED + 1))
        sur.fit(self._features(items), y, self._offset(items))
        seen = self.evaluated_keys()
        cands: list[tuple[np.ndarray, Any, Any, str]] = []  # (levels, q, asked trial or None, source)
        asked = [self.ask() for _ in range(self.strategy.n_candidates)]
        for t in asked:
            lv, q = self.repaired(t.params)
            cands.append((lv, q, t, "tpe+surrogate"))
        for lv, q in self.mutations(self.strategy.n_local):
            cands.append((lv, q, None, "mutation+surrogate"))
        uniq, keys = [], set()
        repeated: set[int] = set()  # asked trials whose repaired plan is measured or proposed already
        for c in cands:
            k = key_hash(_key(c[0], c[1]))
            if k in seen or k in keys:
                if c[2] is not None:
                    repeated.add(id(c[2]))
                continue
            keys.add(k)
            uniq.append(c)
        chosen: set[int] = set()
        preds = np.zeros(len(uniq))
        if uniq:
            pool = [(c[0], c[1]) for c in uniq]
            order, preds = sur.rank(self._features(pool), self.strategy.kappa, self._offset(pool))
            chosen = set(int(i) for i in order[: self.strategy.top_k])
        chosen_ids = {id(uniq[i]) for i in chosen}
        evaluated_trials = set()
        for i, c in enumerate(uniq):
            if id(c) in chosen_ids:
                if self.complete_count() >= self.n_trials:
                    break
                if c[2] is not None:
                    evaluated_trials.add(id(c[2]))  # told by evaluate(), whatever happens
                r = self.evaluate(c[0], c[1], c[3], asked=c[2], pred=float(preds[i]))
                if r is None and self._full():
                    break
        pred_of = {id(c[2]): float(preds[i]) for i, c in enumerate(uniq) if c[2] is not None}
        for t in asked:
            if id(t) in evaluated_trials:
                continue
            if id(t) in pred_of:
                self._set_attr(t, "kvplan.pred_log_kl", pred_of[id(t)])
            self._drop(t, "duplicate" if id(t) in repeated else "screened")  # only ranked ones were screened
        if not chosen:  # nothing new proposed: keep going with single steps
            self.step_single()

    def complete_count(self) -> int:
        return len(self.complete())

    def waiting(self) -> bool:
        return bool(self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    def run(self) -> None:
        n0 = self.complete_count()
        if self.show_progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.n_trials, initial=min(n0, self.n_trials), desc="kvplan search",
                            unit="trial", dynamic_ncols=True)
        try:
            stall, failed_at_stall = 0, self.n_non_finite
            while True:
                if self.persistent:
                    fail_orphaned_trials(self.study)  # a dead worker's trials go back to the queue
                    attrs = self.study.user_attrs
                    if self.check_identity is not None:
                        self.check_identity(attrs)  # two first workers with other setups wrote at once
                    if attrs.get("kvplan.exhausted"):
                        self._warn_short(f"a worker of this study found no new plan to propose before {NO_NEW_PLAN}")
                        break
                n = self.complete_count()
                if n >= self.n_trials:
                    break
                if self.persistent and n + in_flight(self.study, set()) >= self.n_trials:
                    # the last slots are being evaluated elsewhere: wait for them (or for their
                    # workers' heartbeats to stop, which puts them back in the queue)
                    if self.bar is not None:
                        self.bar.set_description_str("kvplan search (waiting for other workers)")
                    time.sleep(POLL_S)
                    continue
                if self.waiting() or not self.strategy.enabled or n < self.strategy.n_startup:
                    self.step_single()
                else:
                    self.step_surrogate()
                if self.bar is not None:
                    self.bar.n = min(self.complete_count(), self.n_trials)
                    self.bar.refresh()
                if self.complete_count() != n:
                    stall, failed_at_stall = 0, self.n_non_finite
                else:
                    stall += 1
                if stall > 20:
                    if self.persistent:
                        self.study.set_user_attr("kvplan.exhausted", True)
                    failed = self.n_non_finite - failed_at_stall
                    self._warn_short(f"21 rounds in a row measured no plan with a finite KL ({failed} plans measured, "
                                     "each KL not finite: see the first warning)" if failed else
                                     f"21 rounds in a row proposed no plan that is not measured already {NO_NEW_PLAN}")
                    break  # the space is exhausted (tiny spaces), or every proposal repairs onto a measured plan
        except BaseException:
            self._give_back_held()
            raise
        finally:
            if self.bar is not None:
                self.bar.close()

    def _warn_short(self, why: str) -> None:
        """Say that the search stops short of ``n_trials`` (it stopped silently, its plan files reading the
        smaller count as if asked for)."""
        n = self.complete_count()
        if n < self.n_trials:
            warnings.warn(f"kvplan: the search stops at {n} of the {self.n_trials} trials asked: {why}", stacklevel=2)

    def _give_back_held(self) -> None:
        """On an interruption (Ctrl-C, an error): fail the trials this worker holds and put its evaluations
        back in the queue, as a dead worker's are. Its process lives on (a notebook), so nothing else would:
        a resume in the same process waited for its own held slot until the heartbeat went stale, and
        forever without a heartbeat."""
        if not self.persistent:
            return
        retry = RetryStale()
        for trial_id in sorted(self.mine):
            trial = self.study._storage.get_trial(trial_id)
            if trial.state == TrialState.RUNNING:
                fail_and_requeue(self.study, trial, retry)
            self.hb.release(trial_id)
        self.mine.clear()


# ----------------------------------------------------------------------------- results
def _trial_rows(space: SearchSpace, trials, run_id: str = "") -> list[dict]:
    rows = []
    for t in trials:
        q = space.quantizer_of(t.params)
        table = space.table_of(t.params)
        m = t.user_attrs.get("kvplan.metrics", {}) or {}
        who = trial_owner(t)
        row = {"number": t.number, "source": t.user_attrs.get("kvplan.source", ""), "kl": t.values[0],
               "bpv": t.user_attrs.get("kvplan.bpv"), "group_size": q.group_size, "key_axis": q.key_axis,
               "value_axis": q.value_axis, "residual_length": q.residual_length,
               "sink_length": q.sink_length, "recent_length": q.recent_length,
               "pred_log_kl": t.user_attrs.get("kvplan.pred_log_kl", "")}
        for k in ("nll", "accuracy", "kl_se"):
            row[k] = m.get(k, "")
        row.update(host=who.get("host", ""), pid=who.get("pid", ""), run_id=run_id)
        row["bits"] = " ".join(str(int(b)) for b in table.ravel())
        rows.append(row)
    return rows


HISTORY_COLUMNS = ["number", "source", "kl", "bpv", "group_size", "key_axis", "value_axis", "residual_length",
                   "sink_length", "recent_length", "pred_log_kl", "nll", "accuracy", "kl_se", "host", "pid", "run_id",
                   "bits"]


def output_paths(out, budgets: Sequence[float]) -> dict[str, str]:
    """The files a search with ``out`` writes: ``plan@<b>`` for each budget ``b`` (``out`` itself, or
    ``<stem>-<b>bpv.yaml`` each when there are several budgets), ``trials`` and ``search`` (``out``'s
    sidecars, :func:`sidecar_paths`)."""
    o = os.fspath(out)
    plans = {f"plan@{b:g}": o if len(budgets) == 1 else budget_plan_path(o, b) for b in budgets}
    side = sidecar_paths(o)
    return {**plans, "trials": side["trials"], "search": side["search"]}


def history_text(space: SearchSpace, trials, run_id: str = "") -> str:
    """The ``.trials.csv`` text: one row per trial (who measured it: ``host``, ``pid``; the
    export's ``run_id`` on every row, so a plan and its sidecars can be matched)."""
    rows = _trial_rows(space, sorted(trials, key=lambda t: t.number), run_id)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=HISTORY_COLUMNS)
    w.writeheader()
    for r in rows:
        w.writerow(r)
    return buf.getvalue()


def write_history(path, space: SearchSpace, trials, run_id: str = "") -> None:
    atomic_write_text(path, history_text(space, trials, run_id))


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of non-dominated (kl, bpv) points (both minimized), by increasing bpv."""
    order = sorted(range(len(points)), key=lambda i: (points[i][1], points[i][0]))
    front, best = [], float("inf")
    for i in order:
        if points[i][0] < best:
            front.append(i)
            best = points[i][0]
    return front


# ----------------------------------------------------------------------------- public API
def search(model="smollm2-135m", budget="2.5bpv", granularity: str = "slot", n_trials: int = DEFAULT_TRIALS,
           seed: int = 0, storage=None, study_name: str | None = None, out: str | os.PathLike | None = None, *,
           task: str = "default", context_len: int | None = None,
           scorer: Scorer | None = None, validation_scorer: Scorer | None = None, test_scorer: Scorer | None = None,
           heldout_scorer: Scorer | None = None, final_candidates: int = 3, reference: Reference | None = None,
           bits: Sequence[int] = DEFAULT_BITS, group_sizes: Sequence[int] = DEFAULT_GROUP_SIZES,
           residual_lengths: Sequence[int] = DEFAULT_RESIDUAL_LENGTHS, key_axes: Sequence[str] = DEFAULT_KEY_AXES,
           sink_lengths: Sequence[int] = DEFAULT_SINK_LENGTHS, key_correction_rank: int | None = None,
           key_correction_bits: int = 4, rotation: str | None = None, key_pre_rope: bool | None = None,
           key_scaling: str | None = None, value_scaling: str | None = None, codebooks: Sequence[str] | None = None,
           residual_bits: int = DEFAULT_RESIDUAL_BITS, recent_lengths: Sequence[int] = DEFAULT_RECENT_LENGTHS,
           sink_bits: int = DEFAULT_SINK_BITS, heavy_length: int = DEFAULT_HEAVY_LENGTH,
           stream_window: int | None = None,
           error_feedback: bool | None = None, pareto: bool = False,
           profile: bool | Mapping[str, float] = True,
           profile_head_units: int | None = DEFAULT_HEAD_UNITS, baselines: bool = True, surrogate: bool = True,
           surrogate_offset: bool = True,
           n_candidates: int = SurrogateSettings.n_candidates, n_local: int = SurrogateSettings.n_local,
           top_k: int = SurrogateSettings.top_k, n_startup: int = SurrogateSettings.n_startup,
           kappa: float = SurrogateSettings.kappa,
           worker: int | None = None, progress: bool = True, heartbeat_interval: int | None = DEFAULT_HEARTBEAT_S,
           grace_period: int | None = DEFAULT_GRACE_S, finalize: bool = False, labelling=None,
           processes: int | None = None, samples: int | None = None, validation_samples: int | None = None,
           test_samples: int | None = None, history_tokens: int | None = None,
           eval_tokens: int | None = None, keep_trials: bool = False) -> SearchResult:
    """Search a mixed-precision KV-cache plan under an honest bpv budget.

    ``model``: a model name/path or a loaded ``(model, processor)`` pair, scored on ``task``
    by :mod:`kvplan.evaluation` (or a loaded model / :class:`Geometry` when ``scorer`` is
    given). ``task``: ``"default"`` (the built-in documentation task) or a JSONL task file
    (``kvplan eval``'s records), split into calibration (searched on), validation (chooses the
    final plan among the ``final_candidates`` best calibration trials) and test (reported in
    the plan's ``metrics.test``, never used to choose). ``context_len``: where the budget is
    stated (default: the calibration history length). ``scorer`` / ``validation_scorer`` /
    ``test_scorer``: your own scorers instead (``heldout_scorer`` is the old name of
    ``test_scorer``). ``budget``: ``"2.5bpv"``, ``2.5`` or a list of
    budgets (multi-objective: Pareto front of KL vs bpv, one plan per budget). ``n_trials``:
    total real evaluations the study should hold (across workers and resumes; the
    sensitivity profile's evaluations come on top). ``storage``/``study_name``: share or
    resume a study (journal file path or RDB URL). ``out``: plan path (``None``, the
    default: no files; the CLI writes ``plan.yaml``). ``keep_trials`` (the CLI's default): with an ``out``
    and no ``storage``, the study is kept in ``<out stem>.journal`` under a name that states its setup
    (model, data, budgets, search space), so the same command run again after an interruption resumes it
    and another setup starts its own study in the same file.
    ``profile``: run the sensitivity profile (``True``), skip it (``False``), or use a profile
    measured before on the same scorer (a name -> KL mapping, as in ``result.profile``).
    ``profile_head_units``: how many of the most damaging (layer, K/V) units the profile also
    measures head by head (slot granularity only; ``None``, the default: every unit; 0 turns the
    per-head stage off).
    ``key_correction_rank``: ``r > 0`` lets key slots at the lowest bits also store a rank-``r``
    correction code (``key_correction_bits`` bits) in per-head query bases learned from the
    scorer's calibration samples (HeadQ-style; needs a scorer with ``model`` and
    ``calibration_sequences()``, as the built-in one has); the search decides which key slots
    use it, and the profile measures what it is worth. ``None`` (default):
    ``DEFAULT_KEY_CORRECTION_RANK`` when the scorer can provide calibration queries, else 0.
    ``rotation``: ``"hadamard"`` / ``"none"`` for every searched plan (``None``: Hadamard when
    head_dim is a power of two). ``key_pre_rope``: quantize keys rotated back to the pre-RoPE
    frame with the model's RoPE frequencies (``None``: when the scorer's model has them); see
    :mod:`kvplan.kernels.rotation`. ``key_scaling`` / ``value_scaling`` / ``codebooks``: the slot
    formats of every searched plan (:mod:`kvplan.kernels.formats`: ``"minmax-fp16"``,
    ``"minmax-e4m3"``, ``"absmax-e4m3"``; ``codebooks`` the kinds, of ``"k"`` / ``"v"``, coded with
    Lloyd-Max levels); ``None``: ``DEFAULT_FORMATS``. ``residual_bits``: how every searched plan holds
    its residual and recent copies (``quantizer.residual_bits``: 16 as written, 8 / 4 per-token codes until
    the group commits; it shapes the bpv between group boundaries, and the scores wherever residual tokens
    are read; default ``DEFAULT_RESIDUAL_BITS``). ``recent_lengths``: choices of ``quantizer.recent_length``
    (the newest committed tokens keep a residual-precision copy that reads use; paid in bpv).
    ``sink_bits``: how every searched plan holds its attention-sink positions (``quantizer.sink_bits``: 16
    as written, 8 per-token codes in the slots' rotated frame; default ``DEFAULT_SINK_BITS``).
    ``heavy_length``: heavy-hitter copies every searched plan keeps per KV head (``quantizer.heavy_length``:
    the committed tokens a prompt's last queries attend to most keep a residual-precision copy that reads
    use; paid in bpv, so the search lowers slot bits to fit them; default ``DEFAULT_HEAVY_LENGTH``).
    ``stream_window``: ``W > 0`` lets the search stream KV heads (plans' bits 0: no codes, the head attends
    to the sink, copies of its newest ``W`` committed tokens and the residual; :mod:`.streaming`): the
    profile also measures each full-attention head streamed alone, two more evaluations put those damages
    on the quantized slots' scale (:func:`.streaming.calibrate_streaming`), the damage model chooses the
    streamed heads at the budget before the search, and the search allocates the other slots; ``0``
    turns it off.
    ``None`` (default): ``DEFAULT_STREAM_WINDOW`` where the search can stream (granularity ``"slot"``, no
    ``heavy_length``, a sensitivity profile to choose by), else 0.
    ``error_feedback``: every searched plan carries a ``feedback_metric`` (learned from the same
    calibration queries and the model's output projections, :mod:`.feedback_metric`) and its slot
    codes are chosen by error feedback (:mod:`kvplan.kernels.feedback`: same formats and bytes);
    ``None`` (default): on when the scorer can provide calibration queries.

    ``surrogate``: screen candidates with the random forest (``False``: every proposal is
    evaluated). ``surrogate_offset``: the forest learns log-KL minus the log of the profile's
    additive damage estimate instead of log-KL itself (see :class:`ForestSurrogate`).

    ``labelling``: a :class:`~kvplan.Labelling` giving the task's tokens their modality labels
    (default: token ids, ``text`` / ``visual``); the plans record its name, and
    ``kvplan.load(model, plan, labelling=...)`` must be given the same one. With your own
    ``scorer`` the labelling is the scorer's (``scorer.labelling``).

    ``processes``: CPU processes that score each candidate's samples together (the scorers
    search builds; ``None``: the usable cores, or 1 for one of several ``worker`` processes;
    any value gives the same numbers, see :mod:`kvplan.evaluation.parallel`).
    ``samples`` / ``validation_samples`` / ``test_samples``: samples per split of the scorers search
    builds (``None``: 12 / 16 / 16 on the built-in task, every record of the split of a JSONL task;
    0 skips the validation or test split). ``history_tokens`` / ``eval_tokens``: each built-in
    sample's history and evaluated tokens (``None``: 512 / 32; a JSONL task's records hold their own, and
    giving them with one is an error). The CLI's options of the same names
    set them; see :func:`kvplan.search.scorers.task_scorers`.

    ``worker``: this process's index among the workers of a shared study (seeds its sampler).
    ``heartbeat_interval`` / ``grace_period`` (seconds, RDB storages): a worker records a
    heartbeat for every trial it holds; a trial without one for ``grace_period`` is failed and
    queued again (see :mod:`.storage`). ``finalize``: only choose, measure and export the final
    plan(s) of an existing study (``storage`` and ``study_name``), with no new trials.

    Returns a :class:`SearchResult`; ``result.plan`` is the exported plan.
    """
    t_start = time.perf_counter()
    check_seed(seed)
    # in increasing order, whatever order they were given in: a study's name and setup do not depend on it
    given = budget if isinstance(budget, (list, tuple)) else [budget]
    if not given:
        raise BudgetError(f"budget={budget!r}: no budget given; give one (e.g. '2.5bpv') or several")
    budgets = sorted(parse_budget(b) for b in given)
    twice = sorted({b for b in budgets if budgets.count(b) > 1})
    if twice:  # one plan per budget: a repeat would name other files than the export writes (--out itself)
        raise BudgetError(f"budget {', '.join(f'{b:g}' for b in twice)} bpv is given more than once "
                          f"({', '.join(f'{b:g}' for b in budgets)}): each budget gets one plan; give it once")
    multi = pareto or len(budgets) > 1
    own_journal = keep_trials and storage is None and out is not None and not finalize
    if out is not None:  # the plan files and their sidecars: writable, and not on what the search reads
        outputs = output_paths(out, budgets)
        for path in outputs.values():
            check_writable(path, "--out", is_dir=False)
        if own_journal:  # opened (made) only once the setup is known good, below
            storage = journal_path(out)
            check_writable(storage, OWN_JOURNAL, is_dir=False)
            check_journal_file(storage, OWN_JOURNAL)
            if os.path.exists(storage):  # a search running with this --out: refused before the model loads
                probe = hold_journal(storage, OWN_JOURNAL)  # (held for good once the storage is open, below)
                if probe is not None:
                    probe.close()
        named = {(f"--out's {key[5:]} bpv plan" if len(budgets) > 1 else "--out") if key.startswith("plan@")
                 else f"--out's {key} sidecar": path for key, path in outputs.items()}  # the user's words
        check_not_inputs(named, {"storage": storage_file(storage), "task file": existing_path(task),
                                 "model": existing_path(model)})
    if heldout_scorer is not None:
        if test_scorer is not None:
            raise KVPlanError("pass test_scorer or its old name heldout_scorer, not both")
        test_scorer = heldout_scorer
    budget_options = dict(bits=bits, group_sizes=group_sizes, residual_lengths=residual_lengths, key_axes=key_axes,
                          sink_lengths=sink_lengths, key_scaling=key_scaling, value_scaling=value_scaling,
                          codebooks=codebooks, residual_bits=residual_bits, recent_lengths=recent_lengths,
                          sink_bits=sink_bits, heavy_length=heavy_length, stream_window=stream_window, profile=profile)
    assert set(budget_options) == set(BUDGET_OPTIONS)
    with contextlib.ExitStack() as cleanup:  # stops the worker processes of the scorers built here, on any exit
        from ..evaluation.tasks import is_whole_number

        task_options = dict(n_calibration=samples, n_validation=validation_samples, n_test=test_samples,
                            history_tokens=history_tokens, eval_tokens=eval_tokens)
        for name, value, least in (("n_trials", n_trials, 1), ("samples", samples, 1),
                                   ("validation_samples", validation_samples, 0),
                                   ("test_samples", test_samples, 0), ("history_tokens", history_tokens, 1),
                                   ("eval_tokens", eval_tokens, 1)):
            if value is not None and not is_whole_number(value, least):
                raise KVPlanError(f"{name}={value!r}: must be an integer of at least {least}")
        warned_budgets: list[bool] = []
        if scorer is None:
            from ..evaluation.parallel import default_processes
            from .scorers import task_scorers

            def check_before_prefill(task_geometry, task_reference, task_modalities):
                """An unreachable budget is refused before the (slow) full-precision prefills."""
                check_budgets(budgets, task_geometry, _stated_at(reference or task_reference, context_len),
                              task_modalities, granularity, **budget_options)
                warned_budgets.append(True)  # its warnings are not given twice below

            scorers = task_scorers(model, task, seed=seed, context_len=context_len, labelling=labelling,
                                   processes=default_processes(processes, worker), progress=progress,
                                   before_prefill=check_before_prefill,
                                   **{k: v for k, v in task_options.items() if v is not None})
            for x in (scorers.calibration, scorers.validation, scorers.test):
                if x is not None:
                    cleanup.callback(x.close)
            scorer = scorers.calibration
            validation_scorer = validation_scorer or scorers.validation
            test_scorer = test_scorer or scorers.test
        elif task != "default":
            raise KVPlanError("task= builds the scorers; do not pass scorer= with it")
        elif labelling is not None:
            raise KVPlanError("labelling= labels the samples of the scorers search builds; a scorer of yours carries "
                              "its own (scorer.labelling)")
        elif processes is not None:
            raise KVPlanError("processes= is for the scorers search builds; give your scorer its own (HarnessScorer("
                              "..., processes=N))")
        elif any(v is not None for v in task_options.values()):
            raise KVPlanError("samples= / validation_samples= / test_samples= / history_tokens= / eval_tokens= "
                              "shape the scorers search builds; give your scorers their own samples")
        labelling_name = getattr(getattr(scorer, "labelling", None), "name", TOKEN_IDS_NAME)
        geometry = getattr(scorer, "geometry", None)
        if geometry is None:
            if isinstance(model, Geometry):
                geometry = model
            elif hasattr(model, "config"):
                geometry = Geometry.of(model)
            else:
                raise KVPlanError("the scorer has no .geometry and model is not a loaded model or Geometry")
        modalities = tuple(getattr(scorer, "modalities", None) or ("text",))
        reference = _stated_at(reference or getattr(scorer, "reference", None) or Reference(), context_len)
        config = SearchConfig.resolve(
            scorer=scorer, model=model, geometry=geometry, modalities=modalities, granularity=granularity, bits=bits,
            group_sizes=group_sizes, residual_lengths=residual_lengths, key_axes=key_axes, sink_lengths=sink_lengths,
            key_correction_rank=key_correction_rank, key_correction_bits=key_correction_bits, rotation=rotation,
            key_pre_rope=key_pre_rope, key_scaling=key_scaling, value_scaling=value_scaling, codebooks=codebooks,
            labelling=labelling_name, residual_bits=residual_bits, recent_lengths=recent_lengths, sink_bits=sink_bits,
            heavy_length=heavy_length, stream_window=stream_window, error_feedback=error_feedback, profile=profile)
        check_budgets(budgets, geometry, reference, modalities, granularity, profile=profile,  # before any study work
                      warn=not warned_budgets, **{k: getattr(config, k) for k in BUDGET_OPTIONS if k != "profile"})
        data_hash = getattr(scorer, "data_hash", None)
        model_name = getattr(scorer, "model_name", None)

        st = make_storage(storage, heartbeat_interval=heartbeat_interval, grace_period=grace_period,
                          name=OWN_JOURNAL if own_journal else "--storage")
        if own_journal:  # one search at a time per --out (workers share a study through --storage instead)
            held = hold_journal(storage, OWN_JOURNAL)
            if held is not None:
                cleanup.callback(held.close)
        label = describe_storage(storage)
        persistent = is_persistent(st)
        # what a worker must share with the study to join it (refused otherwise, naming the difference)
        identity = _plain({
            "model": {"name": model_name, "model_type": geometry.model_type, "fingerprint": geometry.fingerprint},
            "data_hash": data_hash, "budgets": sorted(budgets), "multi_objective": multi,
            "reference": {"context_len": reference.context_len, "modality_mix": dict(reference.modality_mix),
                          "full_precision_bits": reference.full_precision_bits, **_layout_of(reference)},
            "space": config.identity(), **_profile_identity(profile, profile_head_units)})
        if study_name is None:
            study_name = f"kvplan-{granularity}-{'-'.join(f'{b:g}' for b in budgets)}bpv-s{seed}"
            if own_journal:  # one study per setup in the journal beside --out: a rerun resumes its own
                study_name += "-" + key_hash(json.dumps(identity, sort_keys=True, default=str))[:10]
        strategy = SurrogateSettings(enabled=surrogate, n_candidates=n_candidates, n_local=n_local, top_k=top_k,
                                     n_startup=n_startup, kappa=kappa, offset=surrogate_offset)
        study, sampler_seed = _open_study(st, study_name, label, multi=multi, finalize=finalize, seed=seed,
                                          worker=worker, n_startup=strategy.n_startup, shared=not own_journal)
        _check_identity(study, identity, study_name, label)
        owner = {**owner_attrs(), "worker": worker, "data_hash": data_hash}
        hb = Heartbeat(st)
        cleanup.callback(hb.close)
        return _run_study(
            study=study, study_name=study_name, label=label, persistent=persistent, hb=hb, owner=owner,
            identity=identity, config=config, scorer=scorer, validation_scorer=validation_scorer,
            test_scorer=test_scorer, reference=reference, budgets=budgets, multi=multi, profile=profile,
            profile_head_units=profile_head_units, progress=progress, seed=seed, sampler_seed=sampler_seed,
            n_trials=n_trials, strategy=strategy, baselines=baselines, final_candidates=final_candidates, out=out,
            finalize=finalize, t_start=t_start)


def _profile_identity(profile, profile_head_units) -> dict:
    """How the study's sensitivity profile is made, as an identity entry where it is not the default
    (measured, every unit's heads), so that default studies keep their names: off, given by the caller
    (by a digest of its entries), or a number of head-profiled units. A rerun with another profile
    setting gets its own study instead of resuming one whose setup skipped (or made) that profile."""
    if profile is False or profile is None:
        return {"profile": "off"}
    if isinstance(profile, Mapping):
        return {"profile": "given:" + key_hash(json.dumps({str(k): float(v) for k, v in profile.items()},
                                                          sort_keys=True))[:16]}
    return {"head_profile": profile_head_units} if profile_head_units != DEFAULT_HEAD_UNITS else {}


def _layout_of(reference: Reference) -> dict:
    """The reference's measured token layout (its modality runs, which the bytes of every plan depend on) as
    an identity / setup entry; none for a reference without one, so such studies keep their names."""
    return {"layout": [list(run) for run in reference.layout]} if reference.layout else {}


def _open_study(st, study_name: str, label, *, multi: bool, finalize: bool, seed: int, worker: int | None,
                n_startup: int, shared: bool = True) -> tuple[optuna.Study, int]:
    """``(study, sampler seed)``: the study ``study_name`` in storage ``st`` (``None``: in memory), created
    or joined, or loaded as it is to ``finalize`` it, with its TPE sampler. Workers of a ``shared`` study each
    seed their sampler differently (``worker``'s index, else the process and the trials already there); a
    study one process keeps (in memory, or in its own journal) is seeded by ``seed`` and its trials only."""
    if finalize and st is None:
        raise KVPlanError("finalize: needs the --storage and --study-name of an existing study")
    if finalize:
        try:
            study = optuna.load_study(study_name=study_name, storage=st)
        except KeyError:
            raise KVPlanError(f"--study-name {study_name}: no such study in --storage {label}") from None
    else:
        study = optuna.create_study(storage=st, study_name=study_name, load_if_exists=True,
                                    directions=["minimize", "minimize"] if multi else ["minimize"])
    n_existing = len(study.get_trials(deepcopy=False)) if is_persistent(st) else 0
    if worker is not None:
        sampler_seed = (seed + 7919 * worker) % (MAX_SEED + 1)
    elif is_persistent(st) and shared:
        sampler_seed = (seed * 1_000_003 + os.getpid() * 31 + n_existing) % (2 ** 31)
    else:  # one process (in memory, or its own journal): a fresh study samples as in memory, a resumed one
        sampler_seed = (seed + 7919 * n_existing) % (MAX_SEED + 1)  # from where it stopped, the same way every time
    study.sampler = optuna.samplers.TPESampler(seed=sampler_seed, multivariate=True, n_startup_trials=n_startup,
                                               constant_liar=True)
    return study, sampler_seed


# the keywords of search() that set what the cheapest plan of its space stores (check_budgets reads them)
BUDGET_OPTIONS = ("bits", "group_sizes", "residual_lengths", "key_axes", "sink_lengths", "key_scaling",
                  "value_scaling", "codebooks", "residual_bits", "recent_lengths", "sink_bits", "heavy_length",
                  "stream_window", "profile")


def check_budgets(budgets, geometry: Geometry, reference: Reference, modalities: Sequence[str] = ("text",),
                  granularity: str = "slot", warn: bool = True, **options) -> None:
    """Raise :class:`BudgetError` when a budget (``"2.5bpv"``, a number, or a list of them) is below the
    cheapest plan :func:`search` can reach with the same keywords (``options``: :data:`BUDGET_OPTIONS`
    of search(), each missing one at search()'s default; other keywords are ignored) on ``geometry`` at
    ``reference``: every slot at the lowest bits, or, where the search streams KV heads, every head it
    may stream streamed (the full-attention layers' heads, with an attention sink as the streaming profile
    keeps one) and the rest at the lowest bits. Milliseconds: the CLI runs it before the full-precision
    prefill, search() before any study work, on the same space. ``warn``: say when a budget constrains
    nothing (every slot fits at its highest bits)."""
    defaults = {k: p.default for k, p in inspect.signature(search).parameters.items() if k in BUDGET_OPTIONS}
    opts = {**defaults, **{k: v for k, v in options.items() if k in BUDGET_OPTIONS}}
    opts["key_scaling"], opts["value_scaling"], opts["codebooks"] = resolve_formats(
        opts["key_scaling"], opts["value_scaling"], opts["codebooks"])
    window = resolve_stream_window(opts.pop("stream_window"), granularity, opts["heavy_length"], opts.pop("profile"))
    space = SearchSpace(geometry, tuple(modalities), granularity, **opts)
    model = plain = BpvModel(space, reference)  # plain: no head streamed, every slot up to its highest bits
    heads = searched_stream_heads(geometry)
    if window and heads:  # with the sink the streaming profile keeps (streaming_optimum uses no other)
        sinks = tuple(s for s in space.sink_lengths if s >= stream_sink(space))
        streamed = BpvModel(SearchSpace(geometry, tuple(modalities), granularity, **{**opts, "sink_lengths": sinks},
                                        streamed_heads=heads, stream_window=window), reference)
        if streamed.cheapest()[0] < model.cheapest()[0]:
            model = streamed
    hint = "" if window else "; streamed KV heads, stream_window with a profile, go lower"
    for b in budgets if isinstance(budgets, (list, tuple)) else [budgets]:
        model.check_budget(parse_budget(b), hint)
        if warn:
            plain.warn_if_unconstrained(parse_budget(b))


def _check_identity(study: optuna.Study, identity: dict, study_name: str, label, attrs=None) -> None:
    old = (study.user_attrs if attrs is None else attrs).get("kvplan.identity")
    if old is None:
        study.set_user_attr("kvplan.identity", identity)
        return
    for what, key in (("model", "model"), ("task data hash", "data_hash"), ("budget", "budgets"),
                      ("single/multi-objective mode", "multi_objective"), ("budget reference", "reference"),
                      ("search space", "space"), ("sensitivity profile", "profile"),
                      ("head profile", "head_profile")):
        if old.get(key) != identity.get(key):
            a, b = old.get(key), identity.get(key)
            if isinstance(a, dict) and isinstance(b, dict):  # name the first differing field
                k = next(k for k in sorted(set(a) | set(b), key=str) if a.get(k) != b.get(k))
                key, a, b = f"{key}.{k}", a.get(k), b.get(k)
            raise KVPlanError(f"--study-name {study_name} in --storage {label}: this worker has another {what} than "
                              f"the study ({key}: study {describe(a)}, this worker {describe(b)}); use another "
                              "--study-name, or the study's model, task and search options")


def _run_study(*, study, study_name, label, persistent, hb, owner, identity, config: SearchConfig, scorer,
               validation_scorer, test_scorer, reference, budgets, multi, profile, profile_head_units, progress, seed,
               sampler_seed, n_trials, strategy: SurrogateSettings, baselines, final_candidates, out, finalize,
               t_start) -> SearchResult:
    import sys

    def say(msg: str) -> None:
        if progress:
            print(f"kvplan search: {msg}", file=sys.stderr, flush=True)

    n_profile_evals = 0

    def setup() -> None:
        """Once per study: the key-correction bases, the error-feedback metrics and the sensitivity
        profile, shared by all workers."""
        attrs = study.user_attrs
        basis = metric = None
        if config.key_correction_rank and attrs.get("kvplan.key_basis") is not None:
            basis = decode_array(attrs["kvplan.key_basis"])
        if config.error_feedback and attrs.get("kvplan.feedback_metric") is not None:
            metric = decode_array(attrs["kvplan.feedback_metric"])
        if (config.key_correction_rank and basis is None) or (config.error_feedback and metric is None):
            # one pass over the calibration samples for both; every worker uses these exact bytes, in
            # as many processes as the scorer scores its samples in (the same sums with any)
            moments = query_second_moments(scorer.model, scorer.calibration_sequences(),
                                           processes=getattr(getattr(scorer, "processes", None), "processes", 1))
            if config.key_correction_rank and basis is None:  # float32 [L, H_kv, D, r]
                basis = basis_of_moments(moments, config.key_correction_rank)
            if config.error_feedback and metric is None:  # float32 [L, 2, H_kv, D, D]
                projections = output_projections(scorer.model, config.geometry.num_layers)
                if projections is None:
                    say("error feedback: the model's attention has no o_proj; values get an identity metric "
                        "(nearest-level codes)")
                metric = feedback_metric(moments, projections, config.space(None).rotations, reference.context_len)
        study.set_user_attr("kvplan.key_basis", encode_array(np.asarray(basis)) if basis is not None else None)
        study.set_user_attr("kvplan.feedback_metric", encode_array(np.asarray(metric, dtype=np.float16))
                           if metric is not None else None)
        space = config.space(basis, metric)
        score_profile_plan = getattr(scorer, "score_profile_plan", scorer)

        def score_and_count(plan: Plan) -> Mapping:  # n_profile_evals: the real evaluations this run made
            nonlocal n_profile_evals
            n_profile_evals += 1
            return score_profile_plan(plan)

        prof = attrs.get("kvplan.profile")
        # measurements an interrupted setup saved are kept (the profile is saved whole at the end)
        saved = attrs.get("kvplan.profile_partial") or {}

        def save_partial(so_far: dict[str, float]) -> None:
            study.set_user_attr("kvplan.profile_partial", {**(prof or {}), **so_far})

        if isinstance(profile, Mapping):
            prof = {str(k): float(v) for k, v in profile.items()}
        elif profile and prof is None:
            bar = None
            if progress:
                from tqdm.auto import tqdm

                bar = tqdm(desc="sensitivity profile", unit="eval", leave=False)

            def tick(done: int, total: int) -> None:
                if bar is not None:
                    bar.total = total
                    bar.update(done - bar.n)

            try:
                # a harness scorer skips the full-precision layers in front of each profile unit
                prof = run_profile(score_and_count, space, reference, progress=tick,
                                   n_head_units=profile_head_units, done=saved, save=save_partial)
            finally:
                if bar is not None:
                    bar.close()
            study.set_user_attr("kvplan.profile_by", owner)
        streamed = []
        if config.stream_window and prof is not None:
            if not any(".stream.h" in k for k in prof):
                say("streaming profile: each full-attention KV head streamed alone")
                stream = run_streaming_profile(score_and_count, space, reference, config.stream_window,
                                               done=saved, save=save_partial)
                prof = {**prof, **stream}
            if not any(k in prof for k in (STREAM_SCALE_KEY, *STREAM_PARTS_KEYS)):
                calibration = calibrate_streaming(score_and_count, space, reference, prof, config.stream_window,
                                                  min(budgets), done=saved, save=save_partial)
                prof = {**prof, **calibration}
                if STREAM_SCALE_KEY in calibration:
                    say(f"streaming damage scale {calibration[STREAM_SCALE_KEY]:.3g} (the damage model's optimum, "
                        f"measured: quantized slots {calibration[STREAM_PARTS_KEYS[0]]:.4g}, streamed heads "
                        f"{calibration[STREAM_PARTS_KEYS[1]]:.4g} KL)")
            streamed = choose_streamed(space, reference, prof, config.stream_window, min(budgets))
            say(f"streamed KV heads (window {config.stream_window}): {len(streamed)} of "
                f"{len(searched_stream_heads(config.geometry))}")
            if streamed and len(budgets) > 1:
                say(f"these heads were chosen at the tightest budget, {min(budgets):g} bpv, and stay streamed in "
                    "every budget's plan: a search per budget streams fewer heads at the looser ones")
        study.set_user_attr("kvplan.streamed", [list(x) for x in streamed])
        study.set_user_attr("kvplan.profile", prof)
        study.set_user_attr("kvplan.ready", {"by": owner})

    if finalize and "kvplan.ready" not in study.user_attrs:
        raise KVPlanError(f"--finalize: study {study_name} in --storage {label} has not been set up by a worker yet")

    def waiting_for(job):
        def note():
            say(f"waiting for another worker of study {study_name} ({job})")
        return note

    run_once(study, "setup", "kvplan.ready", setup, owner, hb, persistent, on_wait=waiting_for("sensitivity profile"))
    attrs = study.user_attrs
    basis_attr, metric_attr = attrs.get("kvplan.key_basis"), attrs.get("kvplan.feedback_metric")
    space = config.space(decode_array(basis_attr) if basis_attr else None,
                       decode_array(metric_attr) if metric_attr else None,
                       [tuple(x) for x in attrs.get("kvplan.streamed") or []])
    bmodel = BpvModel(space, reference)
    for b in budgets:
        bmodel.check_budget(b)
    desc = {"space": space.describe(), "budgets": budgets,
            "reference": {"context_len": reference.context_len, "modality_mix": dict(reference.modality_mix),
                          **_layout_of(reference)}}
    old = attrs.get("kvplan.setup")
    if old is not None and old.get("budgets"):  # studies set up before the budgets were sorted
        old = {**old, "budgets": sorted(old["budgets"])}
    if old is not None and old != _plain(desc):
        raise KVPlanError(f"--study-name {study_name} in --storage {label} was created with a different search setup; "
                          "use another --study-name or the same granularity, bits, budget and reference")
    if old is None:
        study.set_user_attr("kvplan.setup", _plain(desc))
    prof = attrs.get("kvplan.profile") if profile is not False else None
    if isinstance(profile, Mapping):
        prof = {str(k): float(v) for k, v in profile.items()}

    s = _Searcher(space=space, reference=reference, budgets=sorted(budgets), scorer=scorer, study=study, seed=seed,
                  rng_seed=sampler_seed, n_trials=n_trials, strategy=strategy, persistent=persistent,
                  progress=progress, profile=prof, multi=multi, heartbeat=hb, owner=owner)
    s.check_identity = lambda attrs: _check_identity(study, identity, study_name, label, attrs)
    if not finalize:
        # the most trials any worker or resume asked of this study: --finalize says when fewer are done
        if n_trials > int(study.user_attrs.get(TRIALS_TARGET_ATTR, 0)):
            study.set_user_attr(TRIALS_TARGET_ATTR, n_trials)
        run_once(study, "seed", "kvplan.seeded", lambda: s.enqueue_seeds(baselines), owner, hb, persistent)
        s.run()
    else:
        _warn_unfinished(study, study_name, len(s.complete()))

    # the samples the final measurement is made on (recorded with the export)
    heldout = {"validation": _split_identity(validation_scorer), "test": _split_identity(test_scorer)}

    def export() -> None:
        res = _finalize(study=study, space=space, s=s, budgets=budgets, multi=multi, granularity=config.granularity,
                        seed=seed, study_name=study_name, storage_label=label, prof=prof, desc=desc,
                        reference=reference, validation_scorer=validation_scorer, test_scorer=test_scorer,
                        final_candidates=final_candidates, scorer=scorer, geometry=config.geometry, out=out,
                        owner=owner)
        holder["result"] = res
        study.set_user_attr("kvplan.final", {
            "run_id": res["run_id"], "by": owner, "paths": res["paths"], "n_trials": res["n_trials"],
            "heldout": heldout, "plans": {f"{b:g}": p.to_yaml() for b, p in res["plans"].items()}})

    holder: dict = {}
    # a final export made before this study grew (a resume with more --trials), or measured on other
    # validation / test samples than this run's, does not count
    n_done = len(s.complete())
    final = run_once(study, "finalize", "kvplan.final", export, owner, hb, persistent, force=finalize,
                     on_wait=waiting_for("final measurement and export"),
                     valid=lambda v: isinstance(v, dict) and v.get("n_trials") == n_done
                     and v.get("heldout", heldout) == heldout)
    if "result" in holder:
        res = holder["result"]
        plans, paths, curve, front = res["plans"], res["paths"], res["curve"], res["pareto"]
        finalized_by, export = None, "written"
    else:  # measured and exported before (by another worker, or by this command run earlier)
        plans = {float(b): Plan.from_yaml(text) for b, text in final["plans"].items()}
        paths, finalized_by = {}, final.get("by")
        done = sorted(s.complete(), key=lambda t: t.number)
        curve, front = _curve_and_front(done)
        by = finalized_by if isinstance(finalized_by, dict) else {}
        here = _export_here(final, out, owner)
        if here == "missing":
            # the same command run again after its plan was deleted or overwritten: write the recorded
            # export again, as it was measured (no new measurement, the same run_id)
            paths = _write_export(out, plans, done=done, run_id=final["run_id"], space=space, budgets=budgets,
                                  multi=multi, desc=desc, prof=prof, study=study, curve=curve, front=front,
                                  seed=seed, study_name=study_name, storage_label=label, finalized_by=by)
            export = "rewritten"
            say(f"study {study_name} was already measured and exported (run {final['run_id']}); its files were "
                f"missing at {paths['plan']} and are written again from the study")
        elif here == "in place":  # the same command run again: its files hold that export, left as they are
            paths, export = dict(final["paths"]), "in place"
            say(f"study {study_name} was already measured and exported (run {final['run_id']}) to "
                f"{paths.get('plan')}, whose files hold it: nothing new to measure or write")
        else:
            export = "elsewhere"
            say(f"study {study_name} was finalized by worker {describe(by.get('worker'))} (host "
                f"{describe(by.get('host'))}, pid {describe(by.get('pid'))}); plan written there: "
                f"{describe(final.get('paths', {}).get('plan'))}")
    return SearchResult(plan=plans[min(plans)], plans=plans, study=study, space=space, budgets=budgets, profile=prof,
                        curve=curve, pareto=front, n_real_evals=s.n_evals, n_profile_evals=n_profile_evals,
                        elapsed_s=time.perf_counter() - t_start, paths=paths, finalized_by=finalized_by,
                        n_non_finite_evals=s.n_non_finite, export=export)


def _split_identity(scorer) -> str | None:
    """What a validation / test scorer measures on: its samples' count and digest (``None`` for a scorer
    that is not the harness's: a caller's own)."""
    from .scorers import samples_digest

    prepared = getattr(scorer, "prepared", None)
    if prepared is None:
        return None
    return f"{len(prepared)}:{samples_digest([p.sample for p in prepared])}"


def _warn_unfinished(study, study_name: str, n_done: int) -> None:
    """--finalize on a study that still runs or stopped short of the trials its workers asked for."""
    target = int(study.user_attrs.get(TRIALS_TARGET_ATTR, 0))
    running = in_flight(study, set())
    if running or n_done < target:
        warnings.warn(f"kvplan: --finalize: study {study_name} holds {n_done} complete trial(s) of the {target} its "
                      f"workers asked for" + (f", {running} still being evaluated" if running else "")
                      + f"; the plan is chosen from the {n_done} finished ones", stacklevel=2)


def _curve_and_front(done):
    points = [(t.values[0], t.user_attrs["kvplan.bpv"]) for t in done]
    curve, best = [], None
    for t in done:
        if best is None or t.values[0] < best[0]:
            best = (t.values[0], t.user_attrs["kvplan.bpv"])
        curve.append((len(curve) + 1, best[0], best[1]))
    front = [{"number": done[i].number, "kl": points[i][0], "bpv": points[i][1],
              "source": done[i].user_attrs.get("kvplan.source", "")} for i in pareto_front(points)]
    return curve, front


def _finalize(*, study, space, s, budgets, multi, granularity, seed, study_name, storage_label, prof, desc, reference,
              validation_scorer, test_scorer, final_candidates, scorer, geometry, out, owner) -> dict:
    """The final plans (validation choice, test measurement) and, with ``out``, their files as one set."""
    import uuid

    done = sorted(s.complete(), key=lambda t: t.number)
    if not done:
        failed = sum(t.user_attrs.get("kvplan.role") == NON_FINITE_ROLE
                     for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)))
        raise KVPlanError("the search finished without any successful evaluation" + (
            f": the KL of each of the {failed} plans measured was not finite" if failed else ""))
    curve, front = _curve_and_front(done)
    run_id = uuid.uuid4().hex[:16]
    plans: dict[float, Plan] = {}
    n_profile = len(prof) - (STREAM_SCALE_KEY in prof) if prof else 0  # every other entry is a measured KL
    base_metrics = {"search": {"granularity": granularity, "n_trials": len(done), "n_profile_evals": n_profile,
                               "seed": seed, "study_name": study_name,
                               "surrogate": s.strategy.enabled, "run_id": run_id}}
    if getattr(scorer, "task_setup", None) is not None:  # the task its splits were drawn from, at `seed`
        base_metrics["search"]["task"] = dict(scorer.task_setup)
    for b in sorted(budgets):
        fits = sorted((t for t in done if t.user_attrs["kvplan.bpv"] <= b + EPS), key=lambda t: (t.values[0], t.number))
        if not fits:
            continue
        val_metrics, val_rows = None, None
        if validation_scorer is not None and final_candidates > 1 and len(fits) > 1:
            bt, val_metrics, val_rows = _pick_on_validation(fits[:final_candidates], validation_scorer,
                                                            lambda params: space.plan_of(params, reference))
        else:
            bt = fits[0]
            if validation_scorer is not None:
                val_metrics = _metrics_of(validation_scorer(space.plan_of(bt.params, reference)))
        plan = space.plan_of(bt.params, reference)
        bpv = plan.bpv()
        if bpv.total > b + EPS:  # the trial's recorded bpv was measured at another reference
            raise KVPlanError(f"the best trial within {b:g} bpv (trial {bt.number}, recorded at "
                              f"{bt.user_attrs['kvplan.bpv']:.6g} bpv) states {bpv.total:.6g} bpv at this "
                              "search's reference: the study was measured at another reference; use another "
                              "--study-name")
        cal = dict(bt.user_attrs.get("kvplan.metrics", {}))
        cal["kl"] = bt.values[0]
        metrics = {**base_metrics, "calibration": _plain(cal)}
        metrics["search"] = {**metrics["search"], "trial": bt.number,
                             "source": bt.user_attrs.get("kvplan.source", "")}
        who = trial_owner(bt)
        if who:
            metrics["search"]["measured_by"] = _plain({k: who.get(k) for k in ("host", "pid", "worker")})
        if val_rows is not None:
            metrics["search"]["validation_candidates"] = _plain(val_rows)
        if val_metrics is not None:
            metrics["validation"] = _plain(val_metrics)
        if test_scorer is not None:
            metrics["test"] = _plain(_metrics_of(test_scorer(plan)))
        metrics["bpv"] = _plain(bpv.as_dict())
        metrics["search"]["plan_digest"] = plan.content_digest()  # what explain compares: edited since?
        name = f"{getattr(scorer, 'model_name', None) or geometry.model_type}-{granularity}-{b:g}bpv"
        plans[b] = plan.replace(target_bpv=b, metrics=_plain(metrics), name=name, provenance=Provenance(
            produced_by="kvplan search", seed=seed, data_hash=getattr(scorer, "data_hash", None)))

    paths: dict[str, str] = {}
    if out is not None:
        paths = _write_export(out, plans, done=done, run_id=run_id, space=space, budgets=budgets, multi=multi,
                              desc=desc, prof=prof, study=study, curve=curve, front=front, seed=seed,
                              study_name=study_name, storage_label=storage_label, finalized_by=owner)
    return {"plans": plans, "paths": paths, "curve": curve, "pareto": front, "run_id": run_id, "n_trials": len(done)}


def _write_export(out, plans: Mapping[float, Plan], *, done, run_id, space, budgets, multi, desc, prof, study, curve,
                  front, seed, study_name, storage_label, finalized_by) -> dict[str, str]:
    """Write an export's files at ``out`` as one set (each budget's plan, ``.trials.csv``, ``.search.json``);
    their paths by role."""
    files: dict[str, str] = {}
    paths: dict[str, str] = {}
    p = output_paths(out, list(plans))
    for b, plan in plans.items():
        files[p[f"plan@{b:g}"]] = plan.to_yaml()
        paths[f"plan@{b:g}"] = p[f"plan@{b:g}"]
    files[p["trials"]] = history_text(space, done, run_id)
    sidecar = {"run_id": run_id, "space": space.describe(), "budgets": budgets, "multi_objective": multi,
               "reference": desc["reference"], "profile": prof, "profile_by": study.user_attrs.get("kvplan.profile_by"),
               "curve": curve, "pareto": front, "seed": seed, "study_name": study_name, "storage": storage_label,
               "finalized_by": finalized_by,
               "baselines": [{"number": t.number, "source": t.user_attrs["kvplan.source"], "kl": t.values[0],
                              "bpv": t.user_attrs["kvplan.bpv"]} for t in done
                             if str(t.user_attrs.get("kvplan.source", "")).startswith("baseline:")],
               "plans": {f"{b:g}": paths.get(f"plan@{b:g}") for b in plans}}
    files[p["search"]] = json.dumps(_plain(sidecar), indent=1)
    write_file_set(files)
    paths.update(trials=p["trials"], search=p["search"], plan=paths[f"plan@{min(plans):g}"])
    return paths


def _export_here(final: Mapping, out, owner: Mapping) -> str | None:
    """Where a study's recorded export stands at this call's ``out``: ``None`` when it was not written on this
    host at that ``out`` (another worker's), ``"missing"`` when its files are no longer all there holding that
    export (deleted, or overwritten by another search), else ``"in place"``."""
    recorded = final.get("paths") or {}
    by = final.get("by") if isinstance(final.get("by"), Mapping) else {}
    wanted = output_paths(out, [float(b) for b in final["plans"]]) if out is not None else {}
    if not wanted or by.get("host") != owner.get("host") or any(recorded.get(k) != v for k, v in wanted.items()):
        return None
    for role, path in wanted.items():
        if not os.path.isfile(path):
            return "missing"
        if role.startswith("plan@"):
            try:  # the hardened plan reader: a replaced file may hold anything
                metrics = Plan.from_yaml(path).metrics
            except (OSError, KVPlanError):
                return "missing"
            search = metrics.get("search") if isinstance(metrics.get("search"), Mapping) else {}
            if search.get("run_id") != final.get("run_id"):
                return "missing"
    return "in place"
