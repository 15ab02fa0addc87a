"""Decode attention straight from the packed cache, plugged into transformers.

``kvplan.load(model, plan)`` (``attention="auto"``, ``"triton"``, ``"native"`` or ``"chunked"``) registers
the attention function ``kvplan_packed`` with transformers' ``AttentionInterface`` (and
SDPA's mask function with ``AttentionMaskInterface``) and sets it on the model's text
decoder only; a VLM's vision tower keeps its own attention.

A cache layer in this mode returns its residual (as the cache reads it) from ``update`` and
marks that tensor (:class:`TensorMarks`); the attention function finds the layer and
runs the cache's kernel (:func:`kvplan.kernels.triton_kernels.packed_decode_attention` on
CUDA, :func:`kvplan.kernels.attention_native.native_decode_attention` on the CPU, or
:func:`kvplan.kernels.attention_chunked.chunked_decode_attention`) over the
packed segments plus the residual, without materializing the whole dequantized cache.
Tokens that are due for commit are committed right after the attention call, so each
token's first use is at full precision exactly as on the dequantizing path.

Heavy-hitter copies (``quantizer.heavy_length``, :mod:`kvplan.runtime.heavy`): a prompt's forward
(the SDPA branch) scores the tokens it committed through :meth:`KVPlanLayer.observe_prompt`; a
decode step reads the copies as extra dense tokens after the residual, with their packed positions
masked out (:func:`_with_heavy_copies`), which the kernels take as they take any mask.

Streamed KV heads (bits 0): a decode step reads their copies as extra dense tokens after the
residual and masks their committed positions without codes (:func:`_with_stream_copies`); on the
dequantize route the cache marks the keys it returns and this function runs SDPA with those
positions masked for the streamed heads' query heads.
"""

from __future__ import annotations

import weakref

import torch

ATTENTION_NAME = "kvplan_packed"
# Queries longer than this (prefill) use SDPA over dequantized + residual states.
MAX_FUSED_QUERY = 16


class TensorMarks:
    """Layers marked on a tensor their ``update`` returned, read once by the attention call that gets
    that very tensor. Looked up by the tensor's ``id`` and checked to be the same object: a mark nobody
    read (a cache updated outside a forward) would otherwise hand its layer to a later tensor that
    reuses the freed id. An entry goes when its tensor or its layer is freed. ``key``: how tensors are
    looked up (``id``; tests force collisions with a constant)."""

    def __init__(self, key=id) -> None:
        self._key = key
        self._entries: dict[int, tuple[weakref.ref, weakref.ref]] = {}

    def put(self, tensor: torch.Tensor, layer) -> None:
        k = self._key(tensor)

        def drop(_ref, k=k) -> None:  # the tensor or the layer was freed: forget the entry if it is still theirs
            entry = self._entries.get(k)
            if entry is not None and (entry[0]() is None or entry[1]() is None):
                del self._entries[k]

        self._entries[k] = (weakref.ref(tensor, drop), weakref.ref(layer, drop))

    def pop(self, tensor: torch.Tensor):
        """The layer marked on ``tensor`` (and the mark removed), or ``None``."""
        k = self._key(tensor)
        entry = self._entries.get(k)
        if entry is None or entry[0]() is not tensor:
            return None
        del self._entries[k]
        return entry[1]()

    def __len__(self) -> int:
        return len(self._entries)


# layers whose fused-route update returned their dense tail: the attention call runs the cache's kernel
_PENDING = TensorMarks()
# layers whose forward committed tokens that its attention call scores (heavy-hitter copies)
_OBSERVED = TensorMarks()
# layers whose dequantize-route update returned keys with positions (KVPlanLayer.read_hidden) that their
# streamed heads must not attend to
_STREAMED = TensorMarks()


def mark_pending(key_residual: torch.Tensor, layer) -> None:
    _PENDING.put(key_residual, layer)


def mark_observed(keys: torch.Tensor, layer) -> None:
    _OBSERVED.put(keys, layer)


def mark_streamed(keys: torch.Tensor, layer) -> None:
    _STREAMED.put(keys, layer)


def _streamed_query_heads(layer, Hq: int, device) -> torch.Tensor:
    """bool ``[Hq]``: the query heads that read the layer's streamed KV heads (GQA: ``j // (Hq // H_kv)``)."""
    kv = torch.zeros(layer.owner.geometry.num_kv_heads, dtype=torch.bool, device=device)
    kv[list(layer.streamed)] = True
    return kv.repeat_interleave(Hq // kv.shape[0])


def _hide(layer, mask, B: int, Hq: int, Tq: int, T: int, a: int, b: int, device):
    """``mask`` (``None``, bool True = attend, or additive ``[B or 1, 1 or Hq, Tq, T]``) as a bool ``[B, Hq,
    Tq, T]`` with positions ``[a, b)`` hidden from the query heads of the layer's streamed KV heads."""
    if mask is None:
        out = torch.ones(Tq, T, dtype=torch.bool, device=device).tril(T - Tq)  # causal, newest Tq queries
        out = out.expand(B, Hq, Tq, T).clone()
    elif mask.dtype == torch.bool:
        out = mask.expand(B, Hq, Tq, T).clone()
    else:  # additive: masked positions hold -inf or the dtype's most negative number
        out = (mask > torch.finfo(mask.dtype).min / 2).expand(B, Hq, Tq, T).clone()
    out[:, _streamed_query_heads(layer, Hq, device), :, a:b] = False
    return out


def _with_stream_copies(layer, query, key, value, mask):
    """The fused kernels' dense tail and mask with the layer's streamed heads: their copies
    (:meth:`KVPlanLayer.stream_reads`, zeros in the other heads) appended after the tail ``key`` /
    ``value [B, H_kv, T_r, D]``, visible to the streamed heads' query heads only, and their committed
    positions without stored codes (:meth:`KVPlanLayer.stream_hidden`) masked off."""
    if layer.stream_copies is None:
        return key, value, mask
    B, Hq, Tq = query.shape[0], query.shape[1], query.shape[2]
    T = sum(blocks[0].length for blocks in layer.packed_segments("k") if blocks) + key.shape[2]
    hidden = layer.stream_hidden() or (0, 0)
    m = layer.stream_copies["k"].length
    ext = _hide(layer, mask, B, Hq, Tq, T, hidden[0] - layer.dropped, hidden[1] - layer.dropped, key.device)
    tail = _streamed_query_heads(layer, Hq, key.device)[None, :, None, None].expand(B, Hq, Tq, m)
    return (torch.cat([key, layer.stream_reads("k", key.dtype)], dim=2),
            torch.cat([value, layer.stream_reads("v", value.dtype)], dim=2), torch.cat([ext, tail], dim=-1))


def _with_heavy_copies(layer, query, key, value, mask):
    """The fused kernels' dense tail and mask with the layer's heavy-hitter copies: each used copy
    (:meth:`KVPlanLayer.heavy_reads`) is appended after the tail ``key`` / ``value [B, H_kv, T_r, D]``
    and its position in the packed segments is masked out for the query heads of its KV head; a
    copy of a token in the tail (a recent copy, the same codes) or of a 16-bit slot is masked off
    instead. ``mask``: ``None``, bool (True = attend) or additive ``[B or 1, 1 or Hq, Tq, T]``."""
    heavy = layer.heavy_reads()
    if heavy is None:
        return key, value, mask
    pos, used = heavy  # [B, H_kv, m]
    B, H, m = pos.shape
    Hq, Tq = query.shape[1], query.shape[2]
    T = sum(blocks[0].length for blocks in layer.packed_segments("k") if blocks) + key.shape[2]
    used = used & (pos < layer.committed - layer.recent["k"].length)  # in the packed segments
    additive = mask is not None and mask.dtype != torch.bool
    if mask is None:
        ext = torch.ones(B, Hq, Tq, T + m, dtype=torch.bool, device=key.device)
    else:
        pad = torch.zeros if additive else torch.ones
        ext = torch.cat([mask.expand(B, Hq, Tq, T), pad(B, Hq, Tq, m, dtype=mask.dtype, device=mask.device)], -1)
    view = ext.view(B, H, Hq // H, Tq, T + m)
    use = used[:, :, None, None, :].expand(B, H, Hq // H, Tq, m)
    idx = (pos - layer.dropped)[:, :, None, None, :].expand(B, H, Hq // H, Tq, m)
    old = view.gather(-1, idx)
    if additive:
        view.scatter_(-1, idx, torch.where(use, float("-inf"), old))
        view[..., T:] = torch.where(use, 0.0, float("-inf"))
    else:
        view.scatter_(-1, idx, old & ~use)
        view[..., T:] = use
    h = layer.heavy
    return (torch.cat([key, h.read("k", key.dtype)], dim=2), torch.cat([value, h.read("v", value.dtype)], dim=2),
            ext)


def kvplan_packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: ``query [B, Hq, Tq, D]``; returns ``([B, Tq, Hq, D], None)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layer = _PENDING.pop(key)
    if layer is None:
        streamed = _STREAMED.pop(key)
        if streamed is not None:  # the dequantize route: hide what the streamed heads do not store
            B, Hq, Tq = query.shape[:3]
            attention_mask = _hide(streamed, attention_mask, B, Hq, Tq, key.shape[2], *streamed.read_hidden, key.device)
            kwargs["is_causal"] = False
        out = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                     **kwargs)
        observer = _OBSERVED.pop(key)
        if observer is not None:  # a prompt: its last queries choose the heavy-hitter copies
            observer.observe_prompt(query, key, scaling, attention_mask)
        return out
    key_blocks = layer.packed_segments("k")
    value_blocks = layer.packed_segments("v")
    mask = attention_mask
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(torch.float32)
    key, value, mask = _with_heavy_copies(layer, query, key, value, mask)
    key, value, mask = _with_stream_copies(layer, query, key, value, mask)
    with torch.no_grad():  # inference kernels (out= buffers, packed codes): no autograd through them
        out = layer.owner.attention_kernel(query, key_blocks, value_blocks, key, value, mask, scaling)
    layer._commit()
    if layer.heavy is not None:
        layer.heavy.resolve()  # tokens committed by a decode step: no prompt scores them
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
