"""Would a 1-bit value format pay? Validation KL of value slots at 16 / 2 / 1 bits (a probe, not a format).

    python bench/one_bit_probe.py bench/results/search-2.5bpv.yaml   # -> bench/results/one_bit_probe.md (~2 min)

kvplan has no 1-bit format. ``bench/allocation_ceiling.py`` says what one could add to the search under
the damage model, given ``k``, the damage of a slot at 1 bit over its damage at 2 bits (Lloyd-Max codes
of a Gaussian: 0.363 / 0.1175 = 3.1). This probe measures ``k`` for the values: this process registers a
1-bit code type (8 codes per byte, which kvplan's byte packing and the chunked PyTorch decode kernel
read unchanged) and a 1-bit Lloyd-Max codebook fitted like the plan's others
(``formats.default_codebook``), then scores the plan with every value slot at 16, 2 and 1 bits (keys as
searched; the 1-bit row also without the plan's error feedback) through the chunked kernel (the native C kernel and Triton read 2 / 3 / 4 / 8 bits only),
on the **validation** split (16 samples, 512-token history): ``k ≈ (KL_1 - KL_16) / (KL_2 - KL_16)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from _stamp import stamp  # noqa: E402
import kvplan.kernels.qtypes as qtypes  # noqa: E402
from kvplan import Plan  # noqa: E402
from kvplan.kernels.formats import default_codebook  # noqa: E402
from kvplan.kernels.qtypes import FULL_PRECISION_BITS, QType  # noqa: E402
from kvplan.plans import STREAMED, atomic_write_text  # noqa: E402
from kvplan.search.scorers import task_scorers  # noqa: E402


def register_one_bit() -> None:
    """This process only: a 1-bit code type in the registry, and 1 among the bits plans may name."""
    import kvplan.kernels as kernels
    import kvplan.plans._fields as fields
    import kvplan.plans._parse as parse
    import kvplan.plans._plan as plan_mod

    qtypes.QTYPES[1] = QType(1, codes_per_unit=8, unit_bytes=1)
    bits = (1, *qtypes.SUPPORTED_BITS)
    for mod in (qtypes, kernels, fields, parse, plan_mod):
        mod.SUPPORTED_BITS = bits
    for mod in (fields, parse, plan_mod):  # what a plan's bits may say: the above and 0 (a streamed KV head)
        mod.PLAN_BITS = (STREAMED, *bits)
    assert qtypes.SUPPORTED_BITS[-1] == FULL_PRECISION_BITS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "one_bit_probe.md"))
    ap.add_argument("--samples", type=int, default=16, help="validation samples (default 16, the recorded table's; "
                    "fewer for a quick check)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("KVPLAN_THREADS", "1")))
    t0 = time.time()
    register_one_bit()
    plan = Plan.from_yaml(args.plan)
    q = plan.quantizer
    # fitted to the values' group length, as SearchSpace.codebooks_for fits the plan's (token axis)
    levels = default_codebook(1, q.value_scaling, min(q.group_size, plan.geometry.head_dim))
    plan = plan.replace(quantizer=dataclasses.replace(q, codebooks=tuple(q.codebooks) + (("v", 1, tuple(levels)),)))
    val = task_scorers(n_calibration=1, n_validation=args.samples, n_test=0, progress=False,
                       attention="chunked").validation
    lines = ["# A 1-bit value format? Validation KL with every value slot at 16 / 2 / 1 bits", "",
             f"Command: {stamp()} (method in the script's "
             f"docstring; 1-bit levels {[round(x, 4) for x in levels]} x the group's absmax, {q.value_scaling}).", "",
             "| value slots | honest bpv | validation KL [95% CI] |", "|---|---:|---|"]
    kl = {}
    table = plan.code_table()
    rows = (("as searched", None, True), ("all 16 bits", 16, True), ("all 2 bits", 2, True), ("all 1 bit", 1, True),
            ("all 1 bit, nearest-level codes (no error feedback)", 1, False))
    for label, bits, feedback in rows:
        t = table.copy()
        if bits is not None:
            t[:, :, 1] = np.where(t[:, :, 1] == STREAMED, STREAMED, bits)  # a streamed head stays streamed
        p = plan.with_table(t) if feedback else plan.replace(feedback_metric=None).with_table(t)
        m = val(p)
        kl[label] = m["kl"]
        lines.append(f"| {label} | {p.bpv().total:.4f} | {m['kl']:.4f} [{m['kl_ci95_lo']:.4f}, {m['kl_ci95_hi']:.4f}] |")
        print(lines[-1], flush=True)
    k = (kl["all 1 bit"] - kl["all 16 bits"]) / (kl["all 2 bits"] - kl["all 16 bits"])
    lines += ["", f"k = (KL_1 - KL_16) / (KL_2 - KL_16) = {k:.1f} (Gaussian Lloyd-Max: 3.1; the search's prior: 9).",
              "", f"Wall time {time.time() - t0:.0f} s."]
    atomic_write_text(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
