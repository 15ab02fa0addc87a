"""What the codec's rotations buy on the default task: uniform plans, held-out KL.

    python bench/rotation_probe.py      # -> bench/results/rotation_probe.md (~3 min on 2 cores)

Uniform KIVI-style plans (keys per channel, values per token, group 128, residual 0) scored
by the held-out scorer of ``kvplan search`` (16 samples, 512-token history), with
``quantizer.rotation`` none / hadamard and ``quantizer.key_pre_rope`` off / on
(:mod:`kvplan.kernels.rotation`). The rotations are plan constants: the honest bpv is the
same in every row of one plan.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _stamp import stamp  # noqa: E402
from kvplan.models import rope_inv_freq  # noqa: E402
from kvplan.plans import atomic_write_text, uniform_plan  # noqa: E402
from kvplan.search.scorers import harness_scorers  # noqa: E402


def main() -> None:
    t0 = time.time()
    _, held = harness_scorers(n_calibration=12, n_heldout=16, progress=False)
    g = held.geometry
    inv_freq = rope_inv_freq(held.model)
    lines = ["# Rotations before quantization: held-out KL of uniform plans", "",
             f"Command: {stamp()} (method in the script's docstring).", "",
             "| plan (group 128, residual 0) | honest bpv | rotation | keys pre-RoPE | held-out KL [95% CI] |",
             "|---|---|---|---|---|"]
    for kb, vb in ((2, 16), (16, 2), (2, 2), (3, 2), (4, 4)):
        base = uniform_plan(g, kb, vb, group_size=128, residual_length=0, modalities=held.modalities,
                            reference=held.reference)
        for rotation, pre_rope in (("none", False), ("none", True), ("hadamard", False), ("hadamard", True)):
            if kb == 16 and pre_rope:
                continue  # keys at full precision: nothing to rotate
            q = dataclasses.replace(base.quantizer, rotation=rotation, key_pre_rope=pre_rope)
            plan = base.replace(quantizer=q, rope_inv_freq=inv_freq if pre_rope else None)
            m = held(plan)
            lines.append(f"| K{kb}V{vb} | {plan.bpv().total:.3f} | {rotation} | {'yes' if pre_rope else 'no'} | "
                         f"{m['kl']:.4f} [{m['kl_ci95_lo']:.4f}, {m['kl_ci95_hi']:.4f}] |")
            print(lines[-1], flush=True)
    lines += ["", f"Wall time {time.time() - t0:.0f} s."]
    atomic_write_text(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "rotation_probe.md"),
                      "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
