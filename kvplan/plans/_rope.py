"""A plan's RoPE inverse frequencies (``rope_inv_freq``), one list or one list per layer type.

Keys quantized in the pre-RoPE frame (``quantizer.key_pre_rope``) are rotated back with the
frequencies of the layer that produced them. Most models use one RoPE base for every layer:
``rope_inv_freq`` is then a list ``[d/2]`` (``d <= head_dim``), as plan files have always
written it. Hybrid models with several bases (Gemma 3: one base for its sliding-window layers,
another for its global layers) write a mapping from each of the geometry's layer types to its
list: ``rope_inv_freq: {full: [...], sliding: [...]}``. Both forms load; a mapping must name
exactly the layer types the geometry has.
"""

from __future__ import annotations

from typing import Mapping

from ..errors import PlanError
from ._checks import is_num


def parse_rope_inv_freq(v):
    """The YAML value as it is (a non-empty list, or a mapping of non-empty lists); entries are
    checked with the rest of the plan by :func:`check_rope_inv_freq`."""
    if isinstance(v, Mapping):
        if not v:
            raise PlanError("rope_inv_freq", "must be a non-empty list of numbers or a mapping of layer type to one",
                            v)
        out = {}
        for k, lst in v.items():
            if not isinstance(k, str):
                raise PlanError("rope_inv_freq", "layer type names must be strings", k)
            if not isinstance(lst, list) or not lst:
                raise PlanError(f"rope_inv_freq.{k}", "must be a non-empty list of numbers", lst)
            out[k] = tuple(lst)
        return out
    if not isinstance(v, list) or not v:
        raise PlanError("rope_inv_freq", "must be a non-empty list of numbers", v)
    return tuple(v)


def normalize_rope_inv_freq(v):
    """``None``, a tuple of floats, or a dict ``layer type -> tuple of floats`` (keys sorted)."""
    if v is None:
        return None
    if isinstance(v, Mapping):
        return {str(k): tuple(v[k]) for k in sorted(v, key=str)}
    return tuple(v)


def check_rope_inv_freq(v, geometry) -> None:
    """Raise :class:`PlanError` unless ``v`` (normalized) fits ``geometry``: 1 .. head_dim/2 positive
    finite numbers per list; a mapping names exactly the geometry's layer types."""
    if isinstance(v, Mapping):
        types = sorted(set(geometry.layer_types))
        if sorted(v) != types:
            raise PlanError("rope_inv_freq", f"names layer types {sorted(v)}; the model's are {types}",
                            show_value=False)
        for k, lst in v.items():
            _check_list(lst, f"rope_inv_freq.{k}", geometry.head_dim)
    else:
        _check_list(v, "rope_inv_freq", geometry.head_dim)


def _check_list(lst, path: str, head_dim: int) -> None:
    n = len(lst)
    if not 1 <= n <= head_dim // 2:
        raise PlanError(path, f"has {n} entries; must have 1 .. head_dim / 2 = {head_dim // 2}", show_value=False)
    for i, f in enumerate(lst):
        if not is_num(f):
            raise PlanError(f"{path}[{i}]", "must be a number (finite)", f)
        if not f > 0:
            raise PlanError(f"{path}[{i}]", "must be a positive number", f)


def as_floats(v):
    """Checked ``v`` with every entry a Python float."""
    if isinstance(v, Mapping):
        return {k: tuple(float(f) for f in lst) for k, lst in v.items()}
    return tuple(float(f) for f in v)


def layer_rope_inv_freq(v, geometry, layer: int):
    """The frequencies of ``layer`` (``None`` when ``v`` is ``None``)."""
    if v is None or not isinstance(v, Mapping):
        return v
    return v[geometry.layer_types[layer]]


def rope_to_yaml(v):
    if isinstance(v, Mapping):
        return {k: list(lst) for k, lst in v.items()}
    return list(v)
