"""Slot formats (kvplan.kernels.formats) on the default task: uniform plans, validation KL.

    python bench/codec_formats.py              # -> bench/results/codec_formats.md (~10 min on 2 cores)

Uniform plans (keys per channel in groups of 128 tokens, values per token; Hadamard rotation,
pre-RoPE keys, residual 0, sink 1, no key correction, so the formats alone differ) scored by the
**validation** scorer of ``kvplan search`` (16 samples, 512-token history, the deployed route:
kvplan.make_cache + the chunked kernel on CPU). Validation, because this table chooses the
default formats of the search; the test split is reported only by the search itself.

Formats: ``int``: uniform levels; ``lloyd``: Lloyd-Max levels for Gaussian groups
(:func:`kvplan.kernels.formats.default_codebook`); scalings ``minmax-fp16`` (the v1 format, 4 bytes
per group), ``minmax-e4m3`` (3 bytes), ``absmax-e4m3`` (symmetric, 1 byte). The honest bpv counts
each format's own bytes.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from _stamp import stamp  # noqa: E402
from kvplan.kernels.formats import default_codebook  # noqa: E402
from kvplan.models import rope_inv_freq  # noqa: E402
from kvplan.plans import atomic_write_text, uniform_plan  # noqa: E402
from kvplan.search.scorers import task_scorers  # noqa: E402

# (label, key bits, value bits, key scaling, key codebook?, value scaling, value codebook?)
ROWS = [
    ("v1", 2, 2, "minmax-fp16", False, "minmax-fp16", False),
    ("K lloyd", 2, 2, "minmax-fp16", True, "minmax-fp16", False),
    ("V lloyd", 2, 2, "minmax-fp16", False, "minmax-fp16", True),
    ("V int absmax", 2, 2, "minmax-fp16", False, "absmax-e4m3", False),
    ("V lloyd absmax", 2, 2, "minmax-fp16", False, "absmax-e4m3", True),
    ("K e4m3, V lloyd absmax", 2, 2, "minmax-e4m3", False, "absmax-e4m3", True),
    ("v1", 3, 2, "minmax-fp16", False, "minmax-fp16", False),
    ("V lloyd absmax", 3, 2, "minmax-fp16", False, "absmax-e4m3", True),
    ("v1", 4, 4, "minmax-fp16", False, "minmax-fp16", False),
    ("V lloyd absmax", 4, 4, "minmax-fp16", False, "absmax-e4m3", True),
]


def with_formats(plan, key_scaling, key_lloyd, value_scaling, value_lloyd, group_size, head_dim):
    books = []
    for kind, sc, lloyd, glen in (("k", key_scaling, key_lloyd, group_size), ("v", value_scaling, value_lloyd,
                                                                               min(group_size, head_dim))):
        if lloyd:
            books += [(kind, b, default_codebook(b, sc, glen)) for b in (2, 3, 4)]
    q = dataclasses.replace(plan.quantizer, key_scaling=key_scaling, value_scaling=value_scaling,
                            codebooks=tuple(books))
    return plan.replace(quantizer=q)


def main() -> None:
    torch.set_num_threads(int(os.environ.get("KVPLAN_THREADS", "1")))
    t0 = time.time()
    scorers = task_scorers(n_calibration=1, n_validation=16, n_test=0, progress=False)
    val = scorers.validation
    g = val.geometry
    inv_freq = rope_inv_freq(val.model)
    lines = ["# Slot formats: validation KL of uniform plans", "",
             f"Command: {stamp()} (method in the script's docstring).", "",
             "| plan | formats | honest bpv | scales+zeros bpv | validation KL [95% CI] |", "|---|---|---|---|---|"]
    for label, kb, vb, ks, kl, vs, vl in ROWS:
        base = uniform_plan(g, kb, vb, group_size=128, residual_length=0, modalities=val.modalities,
                            reference=val.reference)
        q = dataclasses.replace(base.quantizer, rotation="hadamard", key_pre_rope=True, sink_length=1)
        plan = with_formats(base.replace(quantizer=q, rope_inv_freq=inv_freq), ks, kl, vs, vl, 128, g.head_dim)
        m = val(plan)
        b = plan.bpv()
        fk = plan.quantizer.format("k", kb).name
        fv = plan.quantizer.format("v", vb).name
        lines.append(f"| K{kb}V{vb} {label} | K {fk}, V {fv} | {b.total:.4f} | {b.scales_zeros:.4f} | "
                     f"{m['kl']:.4f} [{m['kl_ci95_lo']:.4f}, {m['kl_ci95_hi']:.4f}] |")
        print(lines[-1], flush=True)
    lines += ["", f"Wall time {time.time() - t0:.0f} s."]
    atomic_write_text(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "codec_formats.md"),
                      "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
