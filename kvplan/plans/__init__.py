"""Plans: dataclasses, YAML schema and validation, honest bpv accounting, baselines.

Modules, one job each: ``_checks`` (value checks, size limits), ``_fields`` (quantizer
settings, bit rules, reference, provenance), ``_keybasis`` (key correction bases and their
base64 codec), ``_files`` (bounded reads, atomic writes), ``_yaml`` (bounded loader, dumper),
``_parse`` (document -> checked fields), ``_plan`` (:class:`Plan`), ``_compress`` (table ->
default + rules), ``accounting`` (honest bpv), ``baselines``.
"""

from ._checks import CORRECTED, KINDS, SCHEMA_VERSION, STREAMED, codes_error, is_corrected, slot_code, split_codes
from ._fields import BitRule, Provenance, QuantizerSettings, Reference
from ._files import atomic_write_text
from ._keybasis import FeedbackMetric, KeyBasis
from ._plan import Plan
from .accounting import (BpvBreakdown, committed_length, heavy_tokens, label_runs, layout_labels, plan_bpv,
                         plan_bytes, recent_tokens, stored_runs, stream_tokens)
from .baselines import (BASELINES, KVTUNER_PAIRS, at_model_width, baseline_plan, headguard_plan, is_baseline_name,
                        layerwise_plan, uniform_plan)

__all__ = [
    "CORRECTED",
    "BASELINES",
    "KINDS",
    "KVTUNER_PAIRS",
    "SCHEMA_VERSION",
    "STREAMED",
    "BitRule",
    "BpvBreakdown",
    "FeedbackMetric",
    "KeyBasis",
    "Plan",
    "Provenance",
    "QuantizerSettings",
    "Reference",
    "at_model_width",
    "atomic_write_text",
    "baseline_plan",
    "committed_length",
    "headguard_plan",
    "is_baseline_name",
    "label_runs",
    "layerwise_plan",
    "layout_labels",
    "plan_bpv",
    "plan_bytes",
    "heavy_tokens",
    "recent_tokens",
    "codes_error",
    "is_corrected",
    "slot_code",
    "split_codes",
    "stored_runs",
    "stream_tokens",
    "uniform_plan",
]
