"""Rule compressor: a per-slot table of format codes written as a default plus ordered rules."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ._checks import KINDS, is_corrected, split_codes
from ._fields import BitRule

_LEVELS = (
    ("kind",), ("modality",), ("kind", "modality"), ("layer",), ("layer", "kind"), ("layer", "kind", "modality"),
    ("head", "kind"), ("layer", "head"), ("layer", "head", "kind"), ("layer", "head", "kind", "modality"),
)
_AXIS = {"layer": 0, "head": 1, "kind": 2, "modality": 3}


def compress(table: np.ndarray, modalities) -> tuple[int, list[BitRule]]:
    """Default + ordered rules reproducing ``table`` exactly (greedy, coarse to fine)."""
    vals, counts = np.unique(table, return_counts=True)
    plain = ~is_corrected(vals)  # the default is plain bits; corrected slots always come from rules
    default = int(vals[plain][np.argmax(counts[plain])]) if plain.any() else int(split_codes(vals[0])[0])
    current = np.full_like(table, default)
    rules: list[BitRule] = []
    for level in _LEVELS:
        if np.array_equal(current, table):
            break
        keep = [_AXIS[a] for a in level]
        shape = table.shape
        for idx in np.ndindex(*[shape[a] for a in keep]):
            sl = [slice(None)] * 4
            for a, i in zip(keep, idx):
                sl[a] = i
            sl = tuple(sl)
            tgt, cur = table[sl], current[sl]
            if np.array_equal(tgt, cur):
                continue
            v, c = np.unique(tgt, return_counts=True)
            if "kind" not in level or KINDS[idx[level.index("kind")]] != "k":
                v, c = v[~is_corrected(v)], c[~is_corrected(v)]  # a correcting rule must select keys alone
                if not v.size:
                    continue
            mode = int(v[np.argmax(c)])
            gain = int(((tgt == mode) & (cur != mode)).sum()) - int(((cur == tgt) & (tgt != mode)).sum())
            if gain > 0 or (len(keep) == 4):
                current[sl] = mode
                sel = dict(zip(level, idx))
                rules.append(_rule_of_code(
                    mode,
                    layers=(int(sel["layer"]),) if "layer" in sel else None,
                    heads=(int(sel["head"]),) if "head" in sel else None,
                    kind=KINDS[sel["kind"]] if "kind" in sel else None,
                    modality=modalities[sel["modality"]] if "modality" in sel else None,
                ))
    assert np.array_equal(current, table)
    return default, _merge_adjacent(rules)


def _merge_adjacent(rules: list[BitRule]) -> list[BitRule]:
    """Join neighbouring rules that differ only in their layer (or head) list."""
    out: list[BitRule] = []
    for r in rules:
        prev = out[-1] if out else None
        if (prev is not None and prev.bits == r.bits and prev.correct == r.correct and prev.kind == r.kind
                and prev.modality == r.modality):
            if prev.heads == r.heads and prev.layers is not None and r.layers is not None:
                out[-1] = replace(prev, layers=tuple(sorted(set(prev.layers) | set(r.layers))))
                continue
            if prev.layers == r.layers and prev.heads is not None and r.heads is not None:
                out[-1] = replace(prev, heads=tuple(sorted(set(prev.heads) | set(r.heads))))
                continue
        out.append(r)
    return out


def _rule_of_code(code: int, **selectors) -> BitRule:
    bits, corrected = split_codes(code)
    return BitRule(bits=bits, correct=corrected, **selectors)


def flat_rules(table: np.ndarray, modalities) -> list[BitRule]:
    return [
        _rule_of_code(int(table[l, h, k, m]), layers=(l,), heads=(h,), kind=KINDS[k], modality=modalities[m])
        for l, h, k, m in np.ndindex(*table.shape)
    ]
