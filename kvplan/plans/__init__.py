"""Plans: dataclasses, YAML schema and validation, honest bpv accounting, baselines."""

from ._schema import (
    CORRECTED,
    KINDS,
    SCHEMA_VERSION,
    BitRule,
    KeyBasis,
    Plan,
    Provenance,
    QuantizerSettings,
    Reference,
    atomic_write_text,
    split_codes,
)
from .accounting import (BpvBreakdown, committed_length, label_runs, layout_labels, plan_bpv, plan_bytes,
                         stored_runs)
from .baselines import BASELINES, KVTUNER_PAIRS, baseline_plan, headguard_plan, layerwise_plan, uniform_plan

__all__ = [
    "CORRECTED",
    "BASELINES",
    "KINDS",
    "KVTUNER_PAIRS",
    "SCHEMA_VERSION",
    "BitRule",
    "BpvBreakdown",
    "KeyBasis",
    "Plan",
    "Provenance",
    "QuantizerSettings",
    "Reference",
    "atomic_write_text",
    "baseline_plan",
    "committed_length",
    "headguard_plan",
    "label_runs",
    "layerwise_plan",
    "layout_labels",
    "plan_bpv",
    "plan_bytes",
    "split_codes",
    "stored_runs",
    "uniform_plan",
]
