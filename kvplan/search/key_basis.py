"""Per-head query bases for the key correction (HeadQ-style, DESIGN.md source 3).

The key correction stores, with each low-bit key, the part of its quantization error that
queries can see: its coordinates in the top-``r`` eigenvectors of ``E[q qᵀ]`` over the
post-RoPE queries each KV head serves. This module measures those bases on calibration
samples by running the model once per sample with an attention function that records the
queries and then runs SDPA.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import torch

from ..errors import KVPlanError

_CAPTURE_NAME = "kvplan_query_capture"


def query_second_moments(model, sequences: Iterable[Sequence[int]]) -> np.ndarray:
    """``Σ q qᵀ`` per layer and KV head, float64 ``[L, H_kv, D, D]``, over every position of
    ``sequences`` (token id lists, one forward pass each). Query head ``j`` belongs to KV head
    ``j // (H_q / H_kv)``."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cfg = model.config
    n_q = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_q
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q
    n_rep = n_q // n_kv
    acc = torch.zeros(cfg.num_hidden_layers, n_kv, D, D, dtype=torch.float64)

    def capture(module, query, key, value, attention_mask, **kw):
        q = query.detach().double()  # [B, Hq, T, D]
        for h in range(n_kv):
            rows = q[:, h * n_rep : (h + 1) * n_rep].reshape(-1, D)
            acc[module.layer_idx, h] += (rows.T @ rows).cpu()
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register(_CAPTURE_NAME, capture)
    previous = cfg._attn_implementation
    device = next(model.parameters()).device
    n = 0
    model.set_attn_implementation(_CAPTURE_NAME)
    try:
        with torch.no_grad():
            for ids in sequences:
                model(input_ids=torch.tensor([list(ids)], device=device), use_cache=False)
                n += 1
    finally:
        model.set_attn_implementation(previous)
    if n == 0:
        raise KVPlanError("no calibration sequences to learn the key correction basis from")
    return acc.numpy()


def query_basis(model, sequences: Iterable[Sequence[int]], rank: int) -> np.ndarray:
    """Top-``rank`` eigenvectors of the query second moments: float32 ``[L, H_kv, D, rank]``
    (columns in decreasing eigenvalue order, each with its largest entry positive so the
    result is reproducible)."""
    moments = query_second_moments(model, sequences)
    D = moments.shape[-1]
    if not 1 <= rank <= D:
        raise KVPlanError(f"key correction rank {rank} must be in [1, head_dim={D}]")
    _, vecs = np.linalg.eigh(moments)  # ascending eigenvalues
    top = vecs[..., ::-1][..., :rank]  # [L, H, D, r]
    idx = np.abs(top).argmax(axis=-2)[..., None, :]  # [L, H, 1, r]
    sign = np.sign(np.take_along_axis(top, idx, axis=-2))
    return (top * np.where(sign == 0, 1.0, sign)).astype(np.float32)
