"""Decode attention straight from the packed cache, plugged into transformers.

``kvplan.load(model, plan)`` (``attention="auto"``, ``"triton"``, ``"native"`` or ``"chunked"``) registers
the attention function ``kvplan_packed`` with transformers' ``AttentionInterface`` (and
SDPA's mask function with ``AttentionMaskInterface``) and sets it on the model's text
decoder only; a VLM's vision tower keeps its own attention.

A cache layer in this mode returns its residual (as the cache reads it) from ``update`` and
remembers itself under that tensor's id; the attention function finds the layer and
runs the cache's kernel (:func:`kvplan.kernels.triton_kernels.packed_decode_attention` on
CUDA, :func:`kvplan.kernels.attention_native.native_decode_attention` on the CPU, or
:func:`kvplan.kernels.attention_chunked.chunked_decode_attention`) over the
packed segments plus the residual, without materializing the whole dequantized cache.
Tokens that are due for commit are committed right after the attention call, so each
token's first use is at full precision exactly as on the dequantizing path.
"""

from __future__ import annotations

import weakref

import torch

ATTENTION_NAME = "kvplan_packed"
# Queries longer than this (prefill) use SDPA over dequantized + residual states.
MAX_FUSED_QUERY = 16

_PENDING: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def mark_pending(key_residual: torch.Tensor, layer) -> None:
    _PENDING[id(key_residual)] = layer


def kvplan_packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: ``query [B, Hq, Tq, D]``; returns ``([B, Tq, Hq, D], None)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layer = _PENDING.pop(id(key), None)
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    key_blocks = layer.packed_segments("k")
    value_blocks = layer.packed_segments("v")
    mask = attention_mask
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(torch.float32)
    out = layer.owner.attention_kernel(query, key_blocks, value_blocks, key, value, mask, scaling)
    layer._commit()
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the fused attention and its mask function with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, kvplan_packed_attention)
    # SDPA's masks: the prefill falls back to SDPA and keeps its is_causal shortcut (no
    # materialized [B, 1, T, T] mask); a decode step gets None (nothing to mask) or a bool
    # padding/causal mask [B, 1, Tq, T], which the kernels take as is
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME


def set_text_attention(model, name: str) -> None:
    """Use attention ``name`` in the text decoder only (vision towers keep theirs)."""
    config = model.config
    subs = getattr(config, "sub_configs", {}) or {}
    if not subs:
        model.set_attn_implementation(name)
        return
    impl = {}
    for key in subs:
        sub = getattr(config, key, None)
        if sub is None:
            continue
        impl[key] = name if key == "text_config" else sub._attn_implementation
    if "text_config" not in impl:
        impl[""] = name
    model.set_attn_implementation(impl)
