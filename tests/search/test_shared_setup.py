"""The once-per-study setup on a shared storage: the key-correction bases and the error-feedback
metrics are learned by one
worker and stored in the study, so a worker that joins (or resumes) searches the very same
space instead of learning its own (which on another machine could differ in the last bit)."""

import numpy as np
import optuna

from kvplan.search import make_storage, search
from kvplan.search._workers import decode_array
from tests.search.test_key_correction_search import CorrectionScorer
from tests.tiny_models import tiny_llama

FAST = dict(n_candidates=4, n_local=8, progress=False, profile=False, budget="2.6bpv", key_correction_rank=4)


class CountingScorer(CorrectionScorer):
    def __init__(self, model, **kw):
        super().__init__(model, **kw)
        self.sequence_calls = 0

    def calibration_sequences(self):
        self.sequence_calls += 1
        return super().calibration_sequences()


def test_key_basis_is_learned_once_and_shared(tmp_path):
    storage = str(tmp_path / "kb.journal")
    model = tiny_llama(num_layers=6, num_kv_heads=2, head_dim=64)
    first = CountingScorer(model)
    r1 = search(n_trials=3, scorer=first, storage=storage, study_name="kb", out=None, **FAST)
    assert first.sequence_calls == 1
    study = optuna.load_study(study_name="kb", storage=make_storage(storage))
    stored = decode_array(study.user_attrs["kvplan.key_basis"])
    assert stored.shape == (6, 2, 64, 4) and stored.dtype == np.float32
    # a second worker whose model would give other bases (other weights) still uses the study's
    other = CountingScorer(tiny_llama(num_layers=6, num_kv_heads=2, head_dim=64, seed=1))
    r2 = search(n_trials=5, scorer=other, storage=storage, study_name="kb", out=None, **FAST)
    assert other.sequence_calls == 0 and r2.n_real_evals == 2
    np.testing.assert_array_equal(r2.plan.key_basis.array, r1.plan.key_basis.array)
    # the error-feedback metric too (learned in the same pass over the calibration samples)
    metric = decode_array(study.user_attrs["kvplan.feedback_metric"])
    assert metric.shape == (6, 2, 2, 64, 64) and metric.dtype == np.float16
    np.testing.assert_array_equal(r2.plan.feedback_metric.array, metric)
    np.testing.assert_array_equal(r1.plan.feedback_metric.array, metric)
