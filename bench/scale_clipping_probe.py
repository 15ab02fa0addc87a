"""Probe (not product code): would clipping each group's range lower the KL at the same bytes?

    python bench/scale_clipping_probe.py bench/results/search-2.5bpv.yaml   # -> results/scale_clipping_probe.md

Weight quantizers (AWQ's clip search, OmniQuant) shrink each group's range below its min / max
(or max |x|) when that lowers the group's squared error: a 2-bit uniform grid over the extremes of
128 near-Gaussian values spends its outer levels on a few values. Same bytes (only the stored scale /
zero-point values change), so it would be free. How: the error-feedback encoder's scales
(``kvplan.kernels.feedback.group_scales``, every slot block of the plan) are replaced by the best of
ratios ``c`` per group (range ``mid ± c * half-range``, or ``c * max |x|``), the one whose
nearest-level codes give the group the smallest squared error; error feedback then codes against
those scales. Keys (channel axis), values (token axis), or both. Scored by the **validation**
scorer of ``kvplan search`` (16 samples, 512-token history, the deployed route).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from _stamp import stamp  # noqa: E402
import kvplan.kernels.feedback as feedback  # noqa: E402
from kvplan import Plan  # noqa: E402
from kvplan.kernels import reference  # noqa: E402
from kvplan.kernels.formats import store_scale  # noqa: E402
from kvplan.kernels.qtypes import channel_group_size, qtype  # noqa: E402
from kvplan.plans import atomic_write_text  # noqa: E402
from kvplan.search.scorers import task_scorers  # noqa: E402

RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)
_CLIP = {"channel": False, "token": False}  # which axis' blocks get clipped scales
_group_scales = reference.group_scales


def _group_sum(e, group_size, axis, start_offset):
    B, h, T, D = e.shape
    if axis == "token":
        g = channel_group_size(group_size, D)
        return e.reshape(B, h, T, D // g, g).sum(-1)
    n_groups = -(-(start_offset + T) // group_size)
    back = n_groups * group_size - start_offset - T
    return torch.nn.functional.pad(e, (0, 0, start_offset, back)).reshape(B, h, n_groups, group_size, D).sum(3)


def _scales_at(xf, bits, group_size, axis, start_offset, fmt, c):
    legacy = fmt is None or fmt.legacy
    sym = not legacy and fmt.spec.symmetric
    lo, hi = reference._group_stats(xf, group_size, axis, start_offset, sym)
    if sym:
        return store_scale(hi * c, fmt), None
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    if legacy:
        return reference._scale_zero(mid - c * half, mid + c * half, qtype(bits).qmax)
    zero = (mid - c * half).to(fmt.spec.zero_dtype)
    return store_scale((mid + c * half - zero.float()) / ((1 << fmt.bits) - 1), fmt), zero


def _nearest_error(xf, s, z, bits, group_size, axis, start_offset, fmt):
    sv = reference._per_value(s.float(), group_size, axis, start_offset, xf.shape)
    zv = 0.0 if z is None else reference._per_value(z.float(), group_size, axis, start_offset, xf.shape)
    levels = None if fmt is None or fmt.legacy else fmt.level_units(xf.device)
    if levels is None:
        levels = torch.arange(1 << bits, dtype=torch.float32)
    code = torch.bucketize((xf - zv) / torch.where(sv > 0, sv, torch.ones_like(sv)), (levels[1:] + levels[:-1]) / 2)
    return _group_sum((xf - levels[code] * sv - zv) ** 2, group_size, axis, start_offset)


def clipped_scales(x, bits, group_size, axis, start_offset=0, fmt=None):
    """``group_scales`` with each group's range at the ratio of smallest squared error."""
    if not _CLIP[axis]:
        return _group_scales(x, bits, group_size, axis, start_offset, fmt)
    xf = x.float()
    best = None
    for c in RATIOS:
        s, z = _scales_at(xf, bits, group_size, axis, start_offset, fmt, c)
        e = _nearest_error(xf, s, z, bits, group_size, axis, start_offset, fmt)
        if best is None:
            best = [e, s, z]
            continue
        take = e < best[0]
        best = [torch.where(take, e, best[0]), torch.where(take, s.float(), best[1].float()).to(s.dtype),
                None if z is None else torch.where(take, z.float(), best[2].float()).to(z.dtype)]
    return best[1], best[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "scale_clipping_probe.md"))
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("KVPLAN_THREADS", "1")))
    t0 = time.time()
    plan = Plan.from_yaml(args.plan)
    q = plan.quantizer
    val = task_scorers(n_calibration=1, n_validation=16, n_test=0, progress=False).validation
    feedback.group_scales = clipped_scales
    lines = ["# Scale clipping probe: validation KL of a fixed plan with clipped group ranges", "",
             f"Command: {stamp()} (method in the "
             f"script's docstring). Keys on the {q.key_axis} axis, values on the {q.value_axis} axis; honest bpv "
             f"{plan.bpv().total:.4f} in every row; ratios {list(RATIOS)}.", "",
             "| clipped | validation KL [95% CI] |", "|---|---|"]
    for name, axes in (("none (min / max, max abs)", ()), ("keys", (q.key_axis,)), ("values", (q.value_axis,)),
                       ("keys and values", (q.key_axis, q.value_axis))):
        for axis in _CLIP:
            _CLIP[axis] = axis in axes
        r = val(plan)
        lines.append(f"| {name} | {r['kl']:.5f} [{r['kl_ci95_lo']:.4f}, {r['kl_ci95_hi']:.4f}] |")
        print(lines[-1], flush=True)
    lines += ["", f"Wall time {time.time() - t0:.0f} s."]
    atomic_write_text(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
