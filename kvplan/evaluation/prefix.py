"""Skip the full-precision layers in front of a plan's first quantized layer.

A sensitivity-profile plan quantizes one (layer, kind) unit, or one head of it, and keeps every
other slot at 16 bits. Every layer before its first quantized layer reads exactly the
full-precision history, so that layer's output for the evaluated tokens is the same, bit for
bit, for every plan with the same codec settings (quantizer, key basis, RoPE frequencies,
labelling) under the same attention route. :class:`PrefixReplay` records those outputs once per
sample and replays them: each later evaluation runs the model's layers only from its first
quantized layer on. On the default model a profile evaluation runs on average half the layers.

Used for the profile only (``evaluate(..., reuse_prefix=True)``): a search trial quantizes every
layer. It applies to the continuation row of a sample without multiple-choice rows (those crop
the cache, which must then hold the continuation in every layer) and to models whose decoder
layers :func:`decoder_layers` finds; anything else runs the whole model as usual. Tested equal,
metric for metric, to the whole forward (tests/evaluation/test_prefix.py).
"""

from __future__ import annotations

import functools
import hashlib
from contextlib import contextmanager
from typing import Any

import torch

from ..kernels.qtypes import FULL_PRECISION_BITS
from ..models.geometry import text_config


def decoder_layers(model) -> list[torch.nn.Module] | None:
    """The text decoder's layer modules, in layer order, when they may be replayed: the
    ``ModuleList`` of ``num_hidden_layers`` modules whose ``self_attn.layer_idx`` is their index.
    ``None`` if not found, or if later layers read earlier layers' caches (Gemma 3n's
    ``num_kv_shared_layers``): a replayed layer writes nothing into its cache."""
    cfg = text_config(model.config)
    if getattr(cfg, "num_kv_shared_layers", 0):
        return None
    n = getattr(cfg, "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n and all(
                getattr(getattr(m, "self_attn", None), "layer_idx", None) == i for i, m in enumerate(module)):
            return list(module)
    return None


def first_quantized_layer(plan) -> int:
    """Index of the first layer storing any slot below 16 bits (``num_layers`` if none)."""
    codes = plan.code_table()  # [L, H_kv, 2, M]; key-correction codes count as quantized
    quantized = (codes != FULL_PRECISION_BITS).reshape(codes.shape[0], -1).any(axis=1)
    return int(quantized.argmax()) if quantized.any() else int(codes.shape[0])


def settings_key(plan, attention: str) -> str:
    """What a full-precision layer's computation depends on besides its inputs: the plan's codec
    settings, key basis, RoPE frequencies, modalities, labelling and geometry, and the attention
    route (not its bits: the layers this key is used for store every slot at 16 bits)."""
    h = hashlib.sha256(repr((attention, plan.quantizer, plan.modalities, plan.labelling, plan.rope_inv_freq,
                             plan.geometry)).encode())
    if plan.key_basis is not None:
        h.update(plan.key_basis.array.tobytes())
    return h.hexdigest()


def _clone(x: Any) -> Any:
    if torch.is_tensor(x):
        return x.detach().clone()
    if isinstance(x, tuple):
        return tuple(_clone(t) for t in x)
    return x


class PrefixReplay:
    """Recorded outputs of one sample's decoder layers for its continuation row, under one
    :func:`settings_key` (another key starts a new record)."""

    def __init__(self):
        self.key: str | None = None
        self.outputs: list[Any] = []  # layer i's output (e.g. hidden states [1, T_eval, d_model])

    @contextmanager
    def around(self, layers: list[torch.nn.Module], key: str, first_quantized: int):
        """Within: layers ``[0, n)`` return their recorded outputs without running (``n``: the
        recorded layers, at most ``first_quantized``) and layers ``[n, first_quantized)`` run and
        record theirs."""
        if key != self.key:
            self.key, self.outputs = key, []
        n = min(first_quantized, len(self.outputs))
        shadowed = []
        for i in range(n):
            shadowed.append(layers[i].__dict__.get("forward"))  # e.g. an accelerate hook's wrapper
            layers[i].forward = functools.partial(_replayed, self.outputs[i])
        hooks = [layers[i].register_forward_hook(functools.partial(self._record, i))
                 for i in range(n, first_quantized)]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()
            for layer, own in zip(layers, shadowed):
                if own is None:
                    del layer.forward
                else:
                    layer.forward = own

    def _record(self, index: int, module, args, output) -> None:
        if len(self.outputs) == index:  # layers run in order; a replayed forward records nothing
            self.outputs.append(_clone(output))


def _replayed(output: Any, *args, **kwargs) -> Any:
    return _clone(output)
