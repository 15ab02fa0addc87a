"""PyTorch reference for decode attention over the packed cache (any device, no Triton).

Same signature as :func:`kvplan.kernels.triton_kernels.packed_decode_attention`: it
dequantizes every :class:`~kvplan.runtime.storage.PackedBlock` (``PackedBlock.decode``),
assembles the full ``[B, Hkv, T_total, D]`` keys / values (segments in time order, then
the full-precision residual) and runs plain softmax attention in fp32.
"""

from __future__ import annotations

import math

import torch

__all__ = ["reference_decode_attention"]


def _assemble(blocks_per_segment, residual, B, D, device) -> torch.Tensor | None:
    parts = []
    for blocks in blocks_per_segment:
        if not blocks:
            continue
        Hkv = sum(len(b.heads) for b in blocks)
        T = blocks[0].length
        seg = torch.empty(B, Hkv, T, D, dtype=torch.float32, device=device)
        for blk in blocks:
            if blk.length != T:
                raise ValueError("blocks of one segment cover different token counts")
            idx = torch.tensor(blk.heads, device=device, dtype=torch.long)
            seg[:, idx] = blk.decode(torch.float32)
        parts.append(seg)
    if residual is not None and residual.shape[2] > 0:
        parts.append(residual.float())
    if not parts:
        return None
    return torch.cat(parts, dim=2)


def reference_decode_attention(
    q: torch.Tensor,
    key_blocks,
    value_blocks,
    key_residual: torch.Tensor | None,
    value_residual: torch.Tensor | None,
    attn_mask: torch.Tensor | None = None,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """``softmax(q kᵀ · sm_scale + mask) v`` over the dequantized cache; ``[B, Hq, Tq, D]`` in ``q.dtype``.

    ``q [B, Hq, Tq, D]``; ``key_blocks`` / ``value_blocks``: per segment a list of PackedBlock
    (heads partition the KV heads); residuals ``[B, Hkv, Tr, D]`` or ``None``; ``attn_mask``
    additive float or bool (True = attend) ``[B, 1 or Hq, Tq, T_total]``. GQA: query head
    ``j`` uses KV head ``j // (Hq // Hkv)``. A fully masked row gives NaN (as softmax does).
    """
    B, Hq, Tq, D = q.shape
    k = _assemble(key_blocks, key_residual, B, D, q.device)
    v = _assemble(value_blocks, value_residual, B, D, q.device)
    if k is None or v is None:
        raise ValueError("no keys to attend to (no segments and no residual)")
    Hkv = k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    n_rep = Hq // Hkv
    k = k.repeat_interleave(n_rep, dim=1)
    v = v.repeat_interleave(n_rep, dim=1)
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    scores = torch.matmul(q.float(), k.transpose(-1, -2)) * scale  # [B, Hq, Tq, T_total]
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.float()
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).to(q.dtype)
