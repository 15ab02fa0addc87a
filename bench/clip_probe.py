"""Probe (not product code): does MSE-optimal clipping of the quantization range help at 2 bits?

    python bench/clip_probe.py        # -> bench/results/clip_probe.md (~3 min on 2 cores)

kvplan quantizes each group with its min-max range. Here ``kvplan.kernels.reference.quantize``
is replaced by a version that, per group, tries shrinking the low and the high end of the
range towards the centre (factors 1.0 ... 0.5, all pairs, or the same factor on both ends)
and keeps the pair with the smallest squared error; the stored format (fp16 scale and zero
per group) is unchanged. The held-out scorer of ``kvplan search`` then scores uniform int2
(group 128, residual 0) and each kind alone at 2 bits.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from _stamp import stamp  # noqa: E402
from kvplan.kernels import reference as R  # noqa: E402
from kvplan.kernels.qtypes import channel_group_size, qtype  # noqa: E402
from kvplan.plans import atomic_write_text, uniform_plan  # noqa: E402
from kvplan.search.scorers import harness_scorers  # noqa: E402

GRID = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5]
MODE = {"on": False, "grid2d": True}
_MINMAX_QUANTIZE = R.quantize


def best_range(xg: torch.Tensor, dim: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group (reduced over ``dim``): the clipped ``(lo, hi)`` with the least squared error."""
    mn, mx = xg.amin(dim=dim), xg.amax(dim=dim)
    c, half = (mn + mx) / 2, (mx - mn) / 2
    pairs = [(a, b) for a in GRID for b in GRID] if MODE["grid2d"] else [(a, a) for a in GRID]
    best = None
    for a, b in pairs:
        lo, hi = c - a * half, c + b * half
        s, z = (t.unsqueeze(dim) for t in R._scale_zero(lo, hi, qmax))  # kvplan's fp16 scale / zero
        q = R._encode(xg, s, z, qmax).float()
        err = ((q * s.float() + z.float() - xg) ** 2).sum(dim=dim)
        if best is None:
            best = (err, lo, hi)
        else:
            m = err < best[0]
            best = (torch.where(m, err, best[0]), torch.where(m, lo, best[1]), torch.where(m, hi, best[2]))
    return best[1], best[2]


def clipped_quantize(x, bits, group_size, axis, start_offset=0):
    if not MODE["on"]:
        return _MINMAX_QUANTIZE(x, bits, group_size, axis, start_offset)
    qt = qtype(bits)
    B, h, T, D = x.shape
    xf = x.float()
    if axis == "token":
        g = channel_group_size(group_size, D)
        xg = xf.reshape(B, h, T, D // g, g)
        lo, hi = best_range(xg, -1, qt.qmax)
        scale, zero = R._scale_zero(lo, hi, qt.qmax)
        codes = R._encode(xg, scale.unsqueeze(-1), zero.unsqueeze(-1), qt.qmax).reshape(B, h, T, D)
    else:
        n_groups = -(-(start_offset + T) // group_size)
        back = n_groups * group_size - start_offset - T
        xp = torch.nn.functional.pad(xf, (0, 0, start_offset, back), mode="replicate") if (start_offset or back) \
            else xf  # partial groups: edge tokens repeated (they do not change min / max)
        lo, hi = best_range(xp.reshape(B, h, n_groups, group_size, D), 3, qt.qmax)
        scale, zero = R._scale_zero(lo, hi, qt.qmax)
        codes = R._encode(xf, R._expand_groups(scale, group_size, start_offset, T),
                          R._expand_groups(zero, group_size, start_offset, T), qt.qmax)
    return R.pack_codes(codes, bits), scale, zero


def main() -> None:
    t0 = time.time()
    R.quantize = clipped_quantize
    _, held = harness_scorers(n_calibration=12, n_heldout=16, progress=False)
    g = held.geometry
    lines = ["# MSE-optimal clipping vs min-max at 2 bits: held-out KL (probe)", "",
             f"Command: {stamp()} (method in the script's docstring).", "",
             "| K / V bits (group 128, residual 0) | min-max (kvplan) | clip, same factor both ends | "
             "clip, independent ends |", "|---|---|---|---|"]
    for kb, vb in ((2, 2), (2, 16), (16, 2)):
        p = uniform_plan(g, kb, vb, group_size=128, residual_length=0, modalities=held.modalities,
                         reference=held.reference)
        cells = []
        for on, grid2d in ((False, True), (True, False), (True, True)):
            MODE["on"], MODE["grid2d"] = on, grid2d
            m = held(p)
            cells.append(f"{m['kl']:.4f} [{m['kl_ci95_lo']:.4f}, {m['kl_ci95_hi']:.4f}]")
        lines.append(f"| K{kb} / V{vb} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    lines += ["", f"Wall time {time.time() - t0:.0f} s."]
    atomic_write_text(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "clip_probe.md"),
                      "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
