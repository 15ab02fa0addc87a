"""Random-forest surrogate of log-KL, refit as trials accumulate."""

from __future__ import annotations

import numpy as np
from sklearn.ensemble import RandomForestRegressor

KL_FLOOR = 1e-9


def log_kl(kl) -> np.ndarray:
    """The surrogate's target: ``log(max(KL, 1e-9))``."""
    return np.log(np.maximum(np.asarray(kl, dtype=np.float64), KL_FLOOR))


class ForestSurrogate:
    """``RandomForestRegressor`` on plan features predicting log-KL; ``predict`` returns the mean
    and the spread across trees (used for an optimistic lower-confidence-bound ranking).

    With an ``offset`` (a known baseline prediction per row, e.g. the log of the sensitivity
    profile's additive damage estimate) the forest learns only ``y - offset`` and predictions
    add it back: trees cannot extrapolate below the lowest target they saw, the offset can, so
    a candidate the profile rates better than every evaluated plan can rank first.
    """

    def __init__(self, seed: int = 0, n_estimators: int = 100, max_features: float | str = 0.33,
                 min_samples_leaf: int = 1, n_jobs: int | None = None):
        self.params = dict(n_estimators=n_estimators, max_features=max_features,
                           min_samples_leaf=min_samples_leaf, random_state=seed, n_jobs=n_jobs)
        self.model: RandomForestRegressor | None = None

    def fit(self, X: np.ndarray, y: np.ndarray, offset: np.ndarray | None = None) -> "ForestSurrogate":
        y = np.asarray(y, dtype=np.float64)
        self.model = RandomForestRegressor(**self.params).fit(X, y if offset is None else y - offset)
        return self

    def predict(self, X: np.ndarray, offset: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        assert self.model is not None, "fit first"
        per_tree = np.stack([t.predict(X) for t in self.model.estimators_])
        mean = per_tree.mean(axis=0)
        return (mean if offset is None else mean + offset), per_tree.std(axis=0)

    def rank(self, X: np.ndarray, kappa: float = 0.5,
             offset: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Order of candidates, best (lowest ``mean - kappa * std``) first, and their predicted means."""
        mean, std = self.predict(X, offset)
        return np.argsort(mean - kappa * std, kind="stable"), mean
