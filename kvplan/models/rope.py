"""The text decoder's RoPE frequencies, for quantizing keys in the pre-RoPE frame."""

from __future__ import annotations

from .geometry import Geometry

_VISION_WORDS = ("visual", "vision", "image")


def rope_inv_freq(model) -> tuple[float, ...] | None:
    """``inv_freq`` of the text decoder's rotary embedding (``[d/2]``, ``d <= head_dim``), or
    ``None`` when the model has none (no RoPE, or not a loaded transformers model).

    Taken from the module that computes it (``...rotary_emb.inv_freq``), so RoPE scaling
    variants that rewrite the frequencies (llama3, yarn, ...) come out as the model uses them.
    Vision-tower rotary embeddings are skipped.
    """
    if not hasattr(model, "named_buffers"):
        return None
    head_dim = Geometry.of(model).head_dim
    for name, buf in model.named_buffers():
        if not name.endswith("inv_freq") or any(w in name.lower() for w in _VISION_WORDS):
            continue
        if buf.dim() == 1 and 1 <= buf.numel() <= head_dim // 2:
            return tuple(float(f) for f in buf.float().cpu())
    return None


def multimodal_rope(model) -> bool:
    """Whether the text decoder uses multimodal RoPE (Qwen2-VL / Qwen2.5-VL ``mrope_section``:
    3-D positions for image tokens), where a key's rotation is not set by its cache index."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for params in (getattr(text, "rope_parameters", None), getattr(text, "rope_scaling", None)):
        if isinstance(params, dict) and params.get("mrope_section"):
            return True
    return False
