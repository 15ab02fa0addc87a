"""Model geometry: what a plan must match (layers, KV heads, head_dim, layer types)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

LAYER_TYPES = ("full", "sliding")


@dataclass(frozen=True)
class Geometry:
    """KV-cache geometry of a decoder: cache per layer is ``[B, num_kv_heads, T, head_dim]``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    model_type: str

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"geometry.{name} must be a positive integer, got {v!r}")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"geometry.layer_types has {len(self.layer_types)} entries, expected num_layers={self.num_layers}"
            )
        for i, t in enumerate(self.layer_types):
            if t not in LAYER_TYPES:
                raise ValueError(f"geometry.layer_types[{i}] = {t!r}; expected one of {LAYER_TYPES}")

    @property
    def fingerprint(self) -> str:
        """Stable hash of the geometry; a plan records it and is refused by other models."""
        blob = json.dumps(
            [self.model_type, self.num_layers, self.num_kv_heads, self.head_dim, list(self.layer_types)],
            separators=(",", ":"),
        )
        return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()[:16]

    @classmethod
    def from_config(cls, config) -> "Geometry":
        """Geometry of a transformers config (VLM configs use their text config)."""
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        n_layers = text.num_hidden_layers
        n_heads = text.num_attention_heads
        n_kv = getattr(text, "num_key_value_heads", None) or n_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // n_heads
        raw_types = getattr(text, "layer_types", None)
        if raw_types is None:
            sliding = getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)
            raw_types = ["sliding_attention" if sliding else "full_attention"] * n_layers
        types = []
        for i, t in enumerate(raw_types):
            if t == "full_attention":
                types.append("full")
            elif t in ("sliding_attention", "chunked_attention"):
                types.append("sliding")
            else:
                raise ValueError(f"layer {i} has attention type {t!r}, which kvplan does not support")
        return cls(n_layers, n_kv, head_dim, tuple(types), getattr(config, "model_type", "unknown"))

    @classmethod
    def of(cls, model_or_geometry) -> "Geometry":
        if isinstance(model_or_geometry, Geometry):
            return model_or_geometry
        return cls.from_config(model_or_geometry.config)
