"""The text decoder's RoPE frequencies, for quantizing keys in the pre-RoPE frame."""

from __future__ import annotations

from .geometry import Geometry, text_config

_VISION_WORDS = ("visual", "vision", "image")
# transformers' layer type prefixes of per-type rotary buffers (Gemma 3: "sliding_attention_inv_freq")
_TYPE_PREFIXES = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "sliding"}


def rope_inv_freq(model) -> tuple[float, ...] | dict[str, tuple[float, ...]] | None:
    """``inv_freq`` of the text decoder's rotary embedding (``[d/2]``, ``d <= head_dim``), or
    ``None`` when the model has none (no RoPE, or not a loaded transformers model).

    Taken from the module that computes it (``...rotary_emb.inv_freq``), so RoPE scaling
    variants that rewrite the frequencies (llama3, yarn, ...) come out as the model uses them.
    Vision-tower rotary embeddings are skipped. A model with one rotary buffer per layer type
    (Gemma 3: ``full_attention_inv_freq`` and ``sliding_attention_inv_freq``, two RoPE bases)
    gives a dict from kvplan's layer types (``"full"``, ``"sliding"``) to their frequencies
    when they differ, one tuple when they agree; ``None`` when a layer type of the model has
    no frequencies (keys of such layers cannot be rotated back).
    """
    if not hasattr(model, "named_buffers"):
        return None
    geometry = Geometry.of(model)
    head_dim = geometry.head_dim
    single = None
    per_type: dict[str, tuple[float, ...]] = {}
    for name, buf in model.named_buffers():
        leaf = name.rsplit(".", 1)[-1]
        if not leaf.endswith("inv_freq") or "original" in leaf or any(w in name.lower() for w in _VISION_WORDS):
            continue
        if not (buf.dim() == 1 and 1 <= buf.numel() <= head_dim // 2):
            continue
        freqs = tuple(float(f) for f in buf.float().cpu())
        prefix = leaf[: -len("inv_freq")].rstrip("_")
        if not prefix:
            if single is None:
                single = freqs
        elif prefix in _TYPE_PREFIXES:
            per_type.setdefault(_TYPE_PREFIXES[prefix], freqs)
    if not per_type:
        return single
    types = sorted(set(geometry.layer_types))
    if any(t not in per_type for t in types):
        return None
    values = {t: per_type[t] for t in types}
    if len(set(values.values())) == 1:
        return values[types[0]]
    return values


def multimodal_rope(model) -> bool:
    """Whether the text decoder uses multimodal RoPE (Qwen2-VL / Qwen2.5-VL ``mrope_section``:
    3-D positions for image tokens), where a key's rotation is not set by its cache index."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    text = text_config(config)
    for params in (getattr(text, "rope_parameters", None), getattr(text, "rope_scaling", None)):
        if isinstance(params, dict) and params.get("mrope_section"):
            return True
    return False
