"""A fast, deterministic stand-in for the evaluation harness: KL as a function of the bit table.

Keys ~8x more sensitive than values, a few "hot" KV heads, layer-dependent weights, a
K x V interaction per layer, worse with larger groups, better with a longer residual; key
slots with the key correction do 5x less damage; 16 recent copies halve the KL; a streamed slot (bits 0)
does the damage of ~1.2 bits (finite, as a real scorer's KL is).
"""

from __future__ import annotations

import time

import numpy as np

from kvplan.models import Geometry
from kvplan.plans import Reference

GEOM = Geometry(6, 2, 64, ("full",) * 6, "llama")
MODS = ("text", "doc")
REF = Reference(1024, (("text", 0.0625), ("doc", 0.9375)))


class SyntheticScorer:
    def __init__(self, geometry=GEOM, modalities=MODS, reference=REF, seed=0, sleep=0.0, noise=0.0):
        self.geometry, self.modalities, self.reference = geometry, tuple(modalities), reference
        rng = np.random.default_rng(seed)
        L, H = geometry.num_layers, geometry.num_kv_heads
        w = rng.lognormal(0.0, 1.0, size=(L, H, 2, len(self.modalities)))
        w[:, :, 0] *= 8.0
        hot = rng.choice(L * H, size=max(1, L * H // 8), replace=False)
        w.reshape(L * H, 2, -1)[hot, 0] *= 20.0
        self.w = w
        self.sleep, self.noise, self.calls = sleep, noise, 0
        self.correction_factor = 0.2  # damage of a key slot with the key correction, relative
        self.data_hash = f"synthetic-{seed}"
        self.model_name = "synthetic"

    def __call__(self, plan):
        self.calls += 1
        if self.sleep:
            time.sleep(self.sleep)
        t = plan.table().astype(float)
        err = np.where(t >= 16, 0.0, (3.0 / (2.0 ** np.maximum(t, 1.2) - 1)) ** 2)
        err = err * np.where(plan.correction_table(), self.correction_factor, 1.0)
        q = plan.quantizer
        gs = (q.group_size / 32) ** 0.5
        res = (1.0 - 0.3 * min(q.residual_length, 128) / 128) / (1.0 + q.recent_length / 16)
        axis = 1.0 if q.key_axis == "channel" else 1.5
        kerr = (self.w[:, :, 0] * err[:, :, 0]).sum(axis=(1, 2))
        verr = (self.w[:, :, 1] * err[:, :, 1]).sum(axis=(1, 2))
        kl = 1e-3 * res * gs * (axis * kerr.sum() + verr.sum() + 0.05 * (kerr * verr).sum())
        if self.noise:
            kl *= float(np.exp(self.noise * np.sin(1e3 * kl)))
        return {"kl": float(kl), "bpv": plan.bpv().total, "nll": 2.0 + float(kl), "accuracy": 0.5,
                "kl_se": 0.1 * float(kl)}
