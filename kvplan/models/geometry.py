"""Model geometry: what a plan must match (layers, KV heads, head_dim, layer types, window)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

LAYER_TYPES = ("full", "sliding")
MAX_SLIDING_WINDOW = 2 ** 24
# the dtypes kvplan caches (and load_model takes), by name, and the bits one full-precision cached value takes
STORAGE_BITS = {"float32": 32, "float16": 16, "bfloat16": 16}


def storage_bits(model) -> int:
    """Bits a full-precision cached value takes on ``model``: its dtype's (see :data:`STORAGE_BITS`). Other
    dtypes are refused: a plan states its full-precision storage as 16 or 32 bits."""
    from ..errors import KVPlanError, or_list

    name = str(next(model.parameters()).dtype).removeprefix("torch.")
    if name not in STORAGE_BITS:
        raise KVPlanError(f"model dtype {name}: kvplan caches {or_list(STORAGE_BITS)} models (cast it with "
                          "model.to(torch.float32), for example)")
    return STORAGE_BITS[name]


def text_config(config):
    """The decoder's text config of a transformers config: a VLM's language model's, a text model's own."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


@dataclass(frozen=True)
class Geometry:
    """KV-cache geometry of a decoder: cache per layer is ``[B, num_kv_heads, T, head_dim]``.

    ``layer_types[i]`` is ``"full"`` (attends over the whole history) or ``"sliding"`` (a
    sliding-window layer, or a chunked-attention one: from the cache's point of view both
    need only the newest ``sliding_window - 1`` past tokens, as transformers'
    ``DynamicSlidingWindowLayer`` keeps them). ``sliding_window`` is ``None`` when no layer
    slides; a geometry with sliding layers and no window (plan files written before windows
    were recorded) keeps every token of those layers.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    model_type: str
    sliding_window: int | None = None

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
        w = self.sliding_window
        if w is not None:
            if not isinstance(w, int) or isinstance(w, bool) or not 1 <= w <= MAX_SLIDING_WINDOW:
                raise ValueError(f"geometry.sliding_window must be an integer in 1 .. {MAX_SLIDING_WINDOW} or None, "
                                 f"got {w!r}")
            if "sliding" not in self.layer_types:
                raise ValueError(f"geometry.sliding_window is {w} but no layer is 'sliding'")

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (``None``: the layer keeps its whole history)."""
        return self.sliding_window if self.layer_types[layer] == "sliding" else None

    @property
    def fingerprint(self) -> str:
        """Stable hash of the geometry; a plan records it and is refused by other models."""
        fields = [self.model_type, self.num_layers, self.num_kv_heads, self.head_dim, list(self.layer_types)]
        if self.sliding_window is not None:  # absent: the hash of geometries without a window is unchanged
            fields.append(self.sliding_window)
        blob = json.dumps(fields, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()[:16]

    @classmethod
    def from_config(cls, config) -> "Geometry":
        """Geometry of a transformers config (VLM configs use their text config)."""
        text = text_config(config)
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
        window = None
        if "sliding" in types:
            # transformers' DynamicCache sizes sliding layers by sliding_window, chunked ones by attention_chunk_size
            chunked = "chunked_attention" in raw_types
            if chunked and "sliding_attention" in raw_types:
                raise ValueError("a model mixing sliding-window and chunked-attention layers is not supported")
            window = getattr(text, "attention_chunk_size" if chunked else "sliding_window", None)
            if window is not None:
                window = int(window)
        return cls(n_layers, n_kv, head_dim, tuple(types), getattr(config, "model_type", "unknown"), window)

    @classmethod
    def of(cls, model_or_geometry) -> "Geometry":
        if isinstance(model_or_geometry, Geometry):
            return model_or_geometry
        return cls.from_config(model_or_geometry.config)
