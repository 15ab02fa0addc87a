"""Baselines through the same harness: named plans, HeadGuard sensitivity, and transformers'
own ``QuantizedCache`` (quanto / hqq backends) as an external peer.

Peers are measured under the same protocol: the FP history K/V is written into a fresh
``QuantizedCache`` layer by layer (its first ``update`` quantizes the whole history), the
evaluated rows then read exactly what that cache returns (its dequantized history), and
honest bpv counts every tensor the cache stores (packed codes, scales, zero-points /
shifts, residual) at its real size.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from ..errors import PlanError
from ..models.geometry import Geometry
from ..plans import Plan, at_model_width, baseline_plan, headguard_plan, uniform_plan
from .harness import (PreparedSample, ProtocolError, aggregate, evaluate, score_cache)

# the bit widths each backend of transformers' QuantizedCache accepts
PEER_BITS = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}
PEER_BACKENDS = tuple(PEER_BITS)


# ----------------------------------------------------------------------------- named plans
def named_plan(name: str, model, modalities: Sequence[str] = ("text",), **kwargs) -> Plan:
    """``fp16``, ``int8``, ``int4``, ``int2``, ``k4v2`` (optionally ``-g64`` / ``-g128``) for ``model``, its bpv
    stated at the model's full-precision width as :func:`kvplan.load` states it."""
    return baseline_plan(name, Geometry.of(model), modalities=tuple(modalities), **{**at_model_width(model), **kwargs})


def parse_peer(name: str) -> tuple[str, int] | None:
    """``"quanto-int2"`` / ``"hqq-int4"`` -> ``(backend, bits)``; ``None`` if not a peer name; a
    :class:`PlanError` for bits the backend does not offer."""
    for b in PEER_BACKENDS:
        for sep in ("-int", ":int", "-"):
            if name.startswith(b + sep) and name[len(b + sep):].isdigit():
                bits = int(name[len(b + sep):])
                if bits not in PEER_BITS[b]:
                    raise PlanError("plan", f"transformers' {b} QuantizedCache stores {list(PEER_BITS[b])} bits, "
                                    f"not {bits}", name)
                return b, bits
    return None


# ----------------------------------------------------------------------------- HeadGuard
@torch.no_grad()
def head_sensitivity(model, prepared: Sequence[PreparedSample], modality: str = "text", bits: int = 2,
                     kinds: Sequence[str] = ("k", "v"), residual_length: int = 0, group_size: int = 32,
                     layers: Sequence[int] | None = None, progress: bool = True) -> dict[str, np.ndarray]:
    """Per physical KV head ``[layers, kv_heads]`` sensitivities measured with the harness.

    ``"k"``: mean KL when only that head's ``modality`` Keys go to ``bits`` (image/bulk
    sensitivity); ``"v"``: the same for its Values (output sensitivity: the head's
    contribution to the attention output). ``"score"``: each normalized to sum 1, then summed.
    """
    from tqdm.auto import tqdm

    g = Geometry.of(model)
    modalities = _plan_modalities(prepared, modality)
    base = uniform_plan(g, 16, 16, modalities=modalities, residual_length=residual_length, group_size=group_size)
    m = modalities.index(modality)
    out: dict[str, np.ndarray] = {}
    layers = range(g.num_layers) if layers is None else layers  # others left at 0 (not measured)
    jobs = [(kind, layer, head) for kind in kinds for layer in layers for head in range(g.num_kv_heads)]
    res = {kind: np.zeros((g.num_layers, g.num_kv_heads)) for kind in kinds}
    for kind, layer, head in tqdm(jobs, desc="head sensitivity", disable=not progress):
        t = base.table()
        t[layer, head, 0 if kind == "k" else 1, m] = bits
        plan = base.with_table(t, name=f"{kind}{bits}@L{layer}H{head}")
        r = evaluate(model, plan, prepared, expect_quantized=[(kind, modality)], progress=False, keep_samples=False)
        res[kind][layer, head] = r["kl"]["mean"]
    out.update(res)
    score = np.zeros((g.num_layers, g.num_kv_heads))
    for kind in kinds:
        s = res[kind].sum()
        score += res[kind] / s if s > 0 else 0.0
    out["score"] = score
    return out


def _plan_modalities(prepared: Sequence[PreparedSample], modality: str) -> tuple[str, ...]:
    present = set()
    for p in prepared:
        present.update(p.sample.history_labels)
    if modality not in present:
        raise ProtocolError(f"no history token is labelled {modality!r} (labels present: {sorted(present)})")
    return ("text",) + tuple(sorted(present - {"text"}))


def top_heads(score: np.ndarray, fraction: float = 1 / 8) -> list[tuple[int, int]]:
    """The ``ceil(fraction * n_heads)`` highest-scoring ``(layer, head)`` pairs (ties: lower index first)."""
    k = max(1, int(np.ceil(fraction * score.size)))
    flat = np.argsort(-score.ravel(), kind="stable")[:k]
    return sorted((int(i // score.shape[1]), int(i % score.shape[1])) for i in flat)


def headguard_from_sensitivity(model, score: np.ndarray, fraction: float = 1 / 8, low_bits=(2, 2),
                               modalities: Sequence[str] = ("text",), protected_modality: str | None = None,
                               protected_value_bits: int | None = None, **kwargs) -> Plan:
    """HeadGuard-style plan protecting the top ``fraction`` of physical KV heads by ``score``, its bpv stated at
    the model's full-precision width."""
    heads = top_heads(score, fraction)
    return headguard_plan(Geometry.of(model), heads, low_bits=low_bits, modalities=tuple(modalities),
                          protected_modality=protected_modality, protected_value_bits=protected_value_bits,
                          name=f"headguard-{len(heads)}", **{**at_model_width(model), **kwargs})


# ----------------------------------------------------------------------------- QuantizedCache peers
def tensor_nbytes(obj) -> int:
    """Bytes of every tensor reachable in ``obj`` (tensor subclasses flattened, dicts/tuples walked)."""
    if torch.is_tensor(obj):
        if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_nbytes(getattr(obj, n)) for n in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_nbytes(v) for v in obj)
    if hasattr(obj, "__tensor_flatten__"):
        names, _ = obj.__tensor_flatten__()
        return sum(tensor_nbytes(getattr(obj, n)) for n in names)
    return 0


def _peer_parts(layer) -> dict[str, int]:
    """``codes``, ``scales_zeros``, ``residual`` bytes of one transformers QuantizedLayer."""
    parts = {"codes": 0, "scales_zeros": 0, "residual": 0}
    for q in (layer._quantized_keys, layer._quantized_values):
        if isinstance(q, tuple):  # hqq: (packed codes, meta dict)
            codes, meta = q
            parts["codes"] += tensor_nbytes(codes)
            parts["scales_zeros"] += tensor_nbytes(meta)
        else:  # quanto QBitsTensor: _data (packed), _scale, _shift
            total = tensor_nbytes(q)
            data = getattr(q, "_data", None)
            codes = tensor_nbytes(data) if data is not None else total
            parts["codes"] += codes
            parts["scales_zeros"] += total - codes
    for t in (layer.keys, layer.values):
        if torch.is_tensor(t):
            parts["residual"] += t.numel() * t.element_size()
    return parts


def make_peer_cache(model, backend: str, nbits: int, **kwargs):
    from transformers import QuantizedCache

    return QuantizedCache(backend=backend, config=model.config, nbits=nbits, **kwargs)


@torch.no_grad()
def evaluate_peer(model, backend: str, nbits: int, prepared: Sequence[PreparedSample], seed: int = 0,
                  progress: bool = True, keep_samples: bool = True, **cache_kwargs) -> dict[str, Any]:
    """transformers ``QuantizedCache(backend, config, nbits)`` on the same prepared samples."""
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    per = []
    for p in tqdm(prepared, desc=f"{backend}-int{nbits}", disable=not progress, leave=False):
        qc = make_peer_cache(model, backend, nbits, **cache_kwargs)
        T = p.history_len
        parts = {"codes": 0, "scales_zeros": 0, "residual": 0}
        eff = DynamicCache(config=model.config)
        n_kv = D = None
        for i, (k, v) in enumerate(p.kv):
            layer = qc.layers[i]
            layer.update(k.clone(), v.clone())
            for name, n in _peer_parts(layer).items():
                parts[name] += n
            # what the peer returns to later forward passes: dequantized history + residual
            dk = torch.cat([layer._dequantize(layer._quantized_keys).to(k.dtype), layer.keys.reshape(
                k.shape[0], k.shape[1], -1, k.shape[-1]).to(k.dtype)], dim=-2)
            dv = torch.cat([layer._dequantize(layer._quantized_values).to(v.dtype), layer.values.reshape(
                v.shape[0], v.shape[1], -1, v.shape[-1]).to(v.dtype)], dim=-2)
            if dk.shape != k.shape:
                raise ProtocolError(f"{backend}: layer {i} returns {tuple(dk.shape)} for history {tuple(k.shape)}")
            eff.layers[i].update(dk, dv)
            n_kv, D = k.shape[1], k.shape[-1]
        nvals = 2 * len(p.kv) * n_kv * T * D
        total = sum(parts.values())
        elem = p.kv[0][0].element_size()
        stats = {
            "history_tokens": T,
            "history_modalities": {},
            "token_bits": {kind: {"all": {str(nbits): float(T)}} for kind in ("k", "v")},
            "quantized_tokens": {kind: {"all": float(T)} for kind in ("k", "v")},
            "raw_token_bits": {f"{kind}/all/{nbits}": T * n_kv * len(p.kv) for kind in ("k", "v")},
            "nbytes": {**parts, "total": total},
            "num_values": nvals,
            "bpv_measured": 8 * total / nvals,
            # scales/zeros/residual stored in the model dtype; counted at 16 bits like the KVPlanCache "bpv"
            "bpv": 8 * (parts["codes"] + (parts["scales_zeros"] + parts["residual"]) * 2 // elem) / nvals,
            "storage_bits": 8 * elem,
        }
        metrics = score_cache(model, p, eff)
        per.append({"metrics": metrics, "cache": stats, "id": p.sample.meta.get("id")})
    agg = aggregate(per, seed=seed)
    agg["plan"] = f"{backend}-int{nbits}"
    agg["peer"] = {"backend": backend, "nbits": nbits, **cache_kwargs}
    if keep_samples:
        agg["samples"] = [{"id": r["id"], **r["metrics"], "bpv": r["cache"]["bpv"]} for r in per]
    return agg
