"""Measurement harness: the historical-cache protocol, tasks, baselines and the sensitivity sweep.

CLI-facing functions (``kvplan eval`` / ``kvplan sweep``): :func:`run_eval`, :func:`run_sweep` (in :mod:`.runs`).
"""

from __future__ import annotations

from .baselines import (PEER_BACKENDS, evaluate_peer, head_sensitivity, headguard_from_sensitivity, named_plan,
                        parse_peer, tensor_nbytes, top_heads)
from .harness import (PreparedSample, ProtocolError, Sample, aggregate, bootstrap_ci, bootstrap_ratio,
                      build_plan_cache, cache_stats, evaluate, kl_divergence, prepare_sample, prepare_samples,
                      score_cache)
from .runs import get_model, run_eval, run_sweep
from .sweep import SWEEP_BITS, condition_plan, format_layers, format_ratios, format_table, sweep_prepared, write_sweep
from .tasks import (SPLITS, TaskError, default_task_samples, doc_split_topics, pad_token_id, read_jsonl,
                    split_records, task_samples, user_task_samples)

__all__ = [
    "PEER_BACKENDS", "SPLITS", "TaskError", "read_jsonl", "split_records", "SWEEP_BITS", "PreparedSample", "ProtocolError", "Sample", "aggregate",
    "bootstrap_ci", "bootstrap_ratio", "build_plan_cache", "cache_stats", "condition_plan",
    "default_task_samples", "doc_split_topics", "evaluate", "evaluate_peer", "format_table", "get_model",
    "head_sensitivity", "headguard_from_sensitivity", "kl_divergence", "named_plan", "prepare_sample", "prepare_samples",
    "run_eval", "run_sweep", "score_cache", "task_samples", "tensor_nbytes", "top_heads",
    "user_task_samples", "parse_peer", "format_layers", "format_ratios", "sweep_prepared", "write_sweep",
    "pad_token_id",
]
