"""Per-head query bases for the key correction (HeadQ-style, DESIGN.md source 3).

The key correction stores, with each low-bit key, the part of its quantization error that
queries can see: its coordinates in the top-``r`` eigenvectors of ``E[q qᵀ]`` over the
post-RoPE queries each KV head serves. This module measures those bases on calibration
samples by running the model once per sample with an attention function that records the
queries and then runs SDPA.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from ..errors import KVPlanError
from ..models.geometry import text_config

_CAPTURE_NAME = "kvplan_query_capture"


def query_second_moments(model, sequences: Iterable[Sequence[int] | Mapping[str, Any]], processes: int = 1
                         ) -> np.ndarray:
    """``Σ q qᵀ`` per layer and KV head of the text decoder, float64 ``[L, H_kv, D, D]``, over
    every position of ``sequences`` (one forward pass each: a token id list, or a mapping of
    model inputs with ``input_ids`` and e.g. a VLM's ``pixel_values``). Query head ``j``
    belongs to KV head ``j // (H_q / H_kv)``. A VLM's vision tower keeps its own attention.
    ``processes > 1``: the forwards run in that many CPU processes at once; each sequence's
    moments are added in sequence order either way, so the sums are the same bit for bit."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ..evaluation.parallel import check_processes, map_forked
    from ..runtime.fused import set_text_attention

    cfg = text_config(model.config)
    n_q = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_q
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q
    n_rep = n_q // n_kv
    shape = (cfg.num_hidden_layers, n_kv, D, D)
    current: list[torch.Tensor] = []  # the moments of the sequence being run

    def capture(module, query, key, value, attention_mask, **kw):
        q = query.detach().double()  # [B, Hq, T, D]
        for h in range(n_kv):
            rows = q[:, h * n_rep : (h + 1) * n_rep].reshape(-1, D)
            current[0][module.layer_idx, h] += (rows.T @ rows).cpu()
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    device = next(model.parameters()).device
    # the queries are all it needs: the logits of every position (a 49k-vocabulary projection of
    # each token on the default model) are not computed
    from ..evaluation.harness import logits_to_keep  # not at import: the harness pulls in transformers

    keep_one = logits_to_keep(model, 1)

    def moments_of(item) -> torch.Tensor:
        inputs = dict(item) if isinstance(item, Mapping) else {"input_ids": list(item)}
        inputs["input_ids"] = torch.tensor([list(inputs["input_ids"])], device=device)
        for k, v in inputs.items():
            if torch.is_tensor(v):
                v = v.to(device)
                inputs[k] = v.to(model.dtype) if k == "pixel_values" and v.is_floating_point() else v
        current[:] = [torch.zeros(shape, dtype=torch.float64)]
        with torch.no_grad():
            model(**inputs, use_cache=False, **keep_one)
        return current[0]

    items = list(sequences)
    if not items:
        raise KVPlanError("no calibration sequences to learn the key correction basis from")
    check_processes(model, processes)
    AttentionInterface.register(_CAPTURE_NAME, capture)
    previous = cfg._attn_implementation
    set_text_attention(model, _CAPTURE_NAME)
    try:
        per_sequence = map_forked(moments_of, items, processes,
                                  [len(x["input_ids"] if isinstance(x, Mapping) else x) for x in items])
    finally:
        set_text_attention(model, previous)
    acc = torch.zeros(shape, dtype=torch.float64)
    for m in per_sequence:
        acc += m
    return acc.numpy()


def query_basis(model, sequences: Iterable[Sequence[int]], rank: int, processes: int = 1) -> np.ndarray:
    """Top-``rank`` eigenvectors of the query second moments: float32 ``[L, H_kv, D, rank]``
    (columns in decreasing eigenvalue order, each with its largest entry positive so the
    result is reproducible); ``processes``: see :func:`query_second_moments`."""
    return basis_of_moments(query_second_moments(model, sequences, processes), rank)


def basis_of_moments(moments: np.ndarray, rank: int) -> np.ndarray:
    """:func:`query_basis` from query second moments ``[L, H_kv, D, D]``."""
    D = moments.shape[-1]
    if not 1 <= rank <= D:
        raise KVPlanError(f"key correction rank {rank} must be in [1, head_dim={D}] (0: no correction)")
    _, vecs = np.linalg.eigh(moments)  # ascending eigenvalues
    top = vecs[..., ::-1][..., :rank]  # [L, H, D, r]
    idx = np.abs(top).argmax(axis=-2)[..., None, :]  # [L, H, 1, r]
    sign = np.sign(np.take_along_axis(top, idx, axis=-2))
    return (top * np.where(sign == 0, 1.0, sign)).astype(np.float32)
