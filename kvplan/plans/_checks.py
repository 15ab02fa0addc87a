"""Value checks shared by plan parsing and the plan dataclasses, and the plan's size limits.

Every size a plan file states turns into work (tables, label layouts, byte counts), so each
has an upper bound, far above any real model, stated in the error when it is exceeded.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import PlanError, describe
from ..kernels.qtypes import STREAMED  # noqa: F401 (re-exported: plans name it)

SCHEMA_VERSION = 9  # 2: slot formats (quantizer.key_scaling / value_scaling / codebooks); 3: quantizer.residual_bits;
#                      4: quantizer.recent_length; 5: quantizer.sink_bits; 6: feedback_metric;
#                      7: quantizer.heavy_length; 8: streamed KV heads (bits 0, quantizer.stream_window);
#                      9: feedback_metric.frame; 1 to 8 are read too
KINDS = ("k", "v")
DEFAULT_MODALITY = "text"
# format code of a key slot stored at ``b`` bits with the key correction: ``b + CORRECTED``
# (``Plan.code_table``); plain bits are codes below it
CORRECTED = 100
# STREAMED (0): the format code (bits) of every slot of a *streamed* KV head (schema version 8,
# DuoAttention's streaming heads): it stores no codes; its queries attend to the attention-sink
# positions, to copies of its newest ``quantizer.stream_window`` committed tokens and to the
# residual, never to older tokens

MAX_LAYERS = 1024
MAX_KV_HEADS = 1024
MAX_KV_UNITS = 2 ** 15  # num_layers * num_kv_heads (the bit table and the byte count loop over them)
MAX_HEAD_DIM = 4096
MAX_MODALITIES = 16
MAX_TOKENS = 2 ** 24  # context_len, residual_length, sink_length
MAX_DEPTH = 32  # nesting of metrics (the YAML reader refuses deeper documents before this)


# Slot format codes (``Plan.code_table``, the search space's levels, ``trials.csv``) are ints that
# pack ``(bits, corrected)``; these functions are the only code that reads or writes that packing.
def split_codes(codes):
    """``(bits, corrected)`` of format codes (an int or an int array): see :data:`CORRECTED`."""
    return codes % CORRECTED, codes >= CORRECTED


def slot_code(bits, corrected=False):
    """Format code of a slot at ``bits`` (an int or an int array), with the key correction when
    ``corrected``."""
    return bits + CORRECTED if corrected else bits


def is_corrected(codes):
    """Whether format codes (an int or an int array) store the key correction."""
    return codes >= CORRECTED


def codes_error(codes, plan_bits) -> str | None:
    """Why an int array is not made of format codes a plan can hold (bits in ``plan_bits``, the
    correction only on quantized bits), or ``None``."""
    bits, corrected = split_codes(codes)
    quantized = (bits != STREAMED) & (bits < max(plan_bits))
    if (codes < 0).any() or (codes >= 2 * CORRECTED).any() or not np.isin(bits, plan_bits).all() \
            or (corrected & ~quantized).any():
        return f"format codes other than {list(plan_bits)} (+{CORRECTED} corrected, quantized bits only)"
    return None


def key_path(path: str, key) -> str:
    """``path.key`` for a mapping key read from a file (any type, shown bounded)."""
    name = key if isinstance(key, str) else describe(key)
    return f"{path}.{name}" if path else name


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v) -> bool:
    """A finite number: a float that is not NaN or infinite, or an int that converts to one
    (``math.isfinite(10**400)`` and ``float(10**400)`` raise OverflowError)."""
    if is_int(v):
        return v.bit_length() < 1024
    return isinstance(v, float) and math.isfinite(v)


def check_keys(obj, path: str, required: Sequence[str], optional: Sequence[str] = ()) -> None:
    if not isinstance(obj, Mapping):
        raise PlanError(path or "<root>", "must be a mapping", obj)
    for k in obj:
        if k not in required and k not in optional:
            allowed = ", ".join(list(required) + list(optional))
            raise PlanError(key_path(path, k), f"unknown key (allowed: {allowed})", obj[k])
    for k in required:
        if k not in obj:
            raise PlanError(key_path(path, k), "missing required key", show_value=False)


def check_int(obj, path, lo=None, hi=None) -> int:
    if not is_int(obj):
        raise PlanError(path, "must be an integer", obj)
    if (lo is not None and obj < lo) or (hi is not None and obj > hi):
        raise PlanError(path, f"must be in [{lo}, {hi if hi is not None else 'inf'}]", obj)
    return obj


def check_choice(obj, path, choices) -> Any:
    wrong_type = any(is_int(c) for c in choices) and not is_int(obj)
    if wrong_type or isinstance(obj, bool) or obj not in choices:
        raise PlanError(path, f"must be one of {list(choices)}", obj)
    return obj


def check_str(obj, path) -> str:
    if not isinstance(obj, str) or not obj:
        raise PlanError(path, "must be a non-empty string", obj)
    return obj


def check_list(obj, path, what: str) -> list:
    """``obj`` must be a list (``false``, ``0``, ``{}`` or ``null`` are refused, not read as empty)."""
    if not isinstance(obj, list):
        raise PlanError(path, f"must be a list of {what}", obj)
    return obj
