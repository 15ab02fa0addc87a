"""Held-out KL of uniform int2 with the first tokens (attention sinks) kept at full precision.

    python bench/sink_tokens.py        # -> bench/results/sink_tokens.md

Same held-out scorer as ``kvplan search``'s final measurement (built-in task, 16 samples,
512-token history); uniform KIVI-style int2, residual 0, ``quantizer.sink_length`` 0 / 1 / 4.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _stamp import stamp  # noqa: E402
from kvplan.plans import atomic_write_text, uniform_plan  # noqa: E402
from kvplan.search.scorers import harness_scorers  # noqa: E402


def main() -> None:
    t0 = time.time()
    _, held = harness_scorers(n_calibration=1, n_heldout=16, progress=False)
    lines = ["# Attention-sink tokens at full precision: uniform int2, held-out KL", "",
             f"Command: {stamp()}", "",
             "| group size | sink_length | honest bpv | held-out KL [95% CI] |", "|---|---|---|---|"]
    for gs in (128, 64):
        for sink in (0, 1, 4):
            p = uniform_plan(held.geometry, 2, 2, group_size=gs, residual_length=0, sink_length=sink,
                             modalities=held.modalities, reference=held.reference)
            m = held(p)
            lines.append(f"| {gs} | {sink} | {p.bpv().total:.4f} | {m['kl']:.4f} [{m['kl_ci95_lo']:.4f}, "
                         f"{m['kl_ci95_hi']:.4f}] |")
            print(lines[-1], flush=True)
    lines += ["", f"Wall time {time.time() - t0:.0f} s."]
    atomic_write_text(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "sink_tokens.md"),
                      "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
