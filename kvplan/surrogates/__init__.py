"""Surrogates: plan features, the random-forest log-KL model, consensus importance."""

from .features import PlanFeatures, slot_names
from .forest import ForestSurrogate, log_kl
from .importance import (
    METHODS,
    Importance,
    component_importance,
    consensus_importance,
    history_features,
    importance_from_history,
)

__all__ = [
    "METHODS",
    "ForestSurrogate",
    "Importance",
    "PlanFeatures",
    "component_importance",
    "consensus_importance",
    "history_features",
    "importance_from_history",
    "log_kl",
    "slot_names",
]
