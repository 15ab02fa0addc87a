"""The error-feedback encoder's per-head metrics (a plan's ``feedback_metric``).

A key's quantization error ``e`` shows as the logit error ``qᵀ e`` of every query that reads
it: its metric is the second moment ``E[q qᵀ]`` of the post-RoPE queries a KV head serves
(the same calibration moments as the key correction's bases), carried into the stored frame
(inverse of the write rotation: pre-RoPE, then Hadamard) and averaged over the positions
``[0, context_len)`` a key can hold (RoPE turns with the position). A value's error shows
through the output projection: its metric is ``Σ W_oᵀ W_o`` over the query heads that share the
KV head, in the stored frame. Each is scaled to a mean diagonal of 1 and damped by ``damping``
on the diagonal (GPTQ's dampening; :data:`FEEDBACK_DAMPING` chosen on the validation split).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

FEEDBACK_DAMPING = 0.1  # validation split, default model: 0.01 / 0.1 / 0.3 / 1.0 (bench/search.md)


def output_projections(model, num_layers: int) -> list[torch.Tensor] | None:
    """The text decoder's attention output projections ``W_o [hidden, H_q * D]`` by layer, or
    None when the model's attention modules have no ``o_proj`` (then values get an identity
    metric: nearest-level codes)."""
    found = {}
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None  # a VLM's text decoder, not its tower
    for m in (decoder if isinstance(decoder, torch.nn.Module) else model).modules():
        idx = getattr(m, "layer_idx", None)
        o = getattr(m, "o_proj", None)
        if isinstance(idx, int) and isinstance(o, torch.nn.Linear) and hasattr(m, "q_proj"):
            found.setdefault(idx, o.weight)
    if sorted(found) != list(range(num_layers)):
        return None
    return [found[i].detach().float().cpu() for i in range(num_layers)]


def stored_key_metric(metric: torch.Tensor, rotation, context_len: int) -> torch.Tensor:
    """float64 ``[H, D, D]``: the model-frame key metrics ``metric [H, D, D]`` carried into the
    stored frame of ``rotation`` (a :class:`kvplan.kernels.rotation.Rotation`), averaged over
    cache indices ``p in [0, context_len)``.

    A unit stored-frame error on coordinate ``a`` at index ``p`` reads as the model-frame error
    ``N_p[a] = (e_a H) R_p`` (``H`` the Hadamard or ``I``, ``R_p`` RoPE's rotate-half turn by ``+p``,
    :meth:`Rotation.inverse`), so the stored metric is ``H (mean_p R_p M R_pᵀ) Hᵀ``. Row ``i`` of
    ``R_p`` has two entries: ``cos`` on ``i`` and ``±sin`` on its rotary partner ``π(i)``, so the mean
    over ``p`` is four element-wise products of ``M`` (rows / columns permuted by ``π``) with Gram
    matrices of the cos / sin table: ``O(P D² + H D³)``, not ``O(P H D³)``."""
    m = metric.double()
    D = m.shape[-1]
    if rotation.inv_freq is not None:
        cos, sin = (t.double().cpu() for t in rotation.angles(0, context_len))  # [P, d/2] fp32 table
        half = cos.shape[1]
        rest = D - 2 * half  # channels past the rotary ones do not turn
        c = torch.cat([cos, cos, cos.new_ones(context_len, rest)], 1)  # [P, D]: cos of row i's angle
        s = torch.cat([sin, -sin, sin.new_zeros(context_len, rest)], 1)  # [P, D]: the partner's coefficient
        partner = torch.cat([torch.arange(half, 2 * half), torch.arange(half), torch.arange(2 * half, D)])
        m_cols = m[:, :, partner]  # M[i, π(j)]
        m = ((c.T @ c) * m + (c.T @ s) * m_cols + (s.T @ c) * m[:, partner, :]
             + (s.T @ s) * m_cols[:, partner, :]) / context_len
    if rotation.hadamard is not None:
        had = rotation.hadamard.double().cpu()
        m = had @ m @ had.T
    return m


def feedback_metric(moments: np.ndarray, projections: list[torch.Tensor] | None,
                    rotations: Callable[[int], dict], context_len: int, damping: float = FEEDBACK_DAMPING
                    ) -> np.ndarray:
    """float32 ``[L, 2, H_kv, D, D]`` (k, v) from the query second moments ``[L, H_kv, D, D]``
    (:func:`kvplan.search.key_basis.query_second_moments`), the output projections (or None) and
    ``rotations(layer)`` (``{"k": Rotation | None, "v": ...}``, the cache's write rotations)."""
    L, H, D, _ = moments.shape
    out = np.empty((L, 2, H, D, D), dtype=np.float32)
    eye = torch.eye(D, dtype=torch.float64)
    for layer in range(L):
        rot = rotations(layer)
        mk = torch.from_numpy(np.asarray(moments[layer], dtype=np.float64))  # [H, D, D]
        if rot["k"] is not None:
            mk = stored_key_metric(mk, rot["k"], context_len)
        if projections is None:
            mv = eye.expand(H, D, D).clone()
        else:
            w = projections[layer].double()  # [hidden, H_q * D]
            per_query = w.T.reshape(-1, D, w.shape[0])  # [H_q, D, hidden]
            n_rep = per_query.shape[0] // H
            mv = torch.einsum("qdx,qex->qde", per_query, per_query).reshape(H, n_rep, D, D).sum(1)
            if rot["v"] is not None:
                had = rot["v"].hadamard.double().cpu()  # stored = x @ had, so x's error = stored error @ hadᵀ
                mv = had.T @ mv @ had
        for kind, m in enumerate((mk, mv)):
            m = (m + m.transpose(-1, -2)) / 2
            m = m / torch.diagonal(m, dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)[:, None, None]
            out[layer, kind] = (m + damping * eye).numpy()
    return out
