"""Recent copies (``quantizer.recent_length``) on a fixed plan: validation KL and honest bpv.

    python bench/recent_tokens.py bench/results/search-2.5bpv.yaml   # -> bench/results/recent_tokens.md (~3 min)

Part 1, **free copies**: the plan's bits, formats and rotations are kept; only
``quantizer.recent_length`` (the newest committed tokens that keep their residual form, read instead
of their slot codes) and ``quantizer.residual_bits`` (how those copies are held) change, so the bpv
grows. Part 2, **copies paid with slot bits**: the plan's bits are lowered by the search's own budget
repair (``kvplan.search.budget.repair``, the damage prior of the plan's ``.search.json`` profile) until
the plan with the copies fits the plan's budget again: the trade the search weighs. Scored by the **validation**
scorer of ``kvplan search`` (16 samples, 512-token history, the deployed route): this table chooses
the search's default choices (``DEFAULT_RECENT_LENGTHS``, ``DEFAULT_RESIDUAL_BITS``), so it never
looks at the test split. The bpv column is at the plan's 512-token reference, where every history
token is committed (group 128, residual 0), so the copies are all that changes.

Also a probe that is not a kvplan feature, to say where the KL comes from: the plan with every key
(or every value) slot at full precision.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from _stamp import stamp  # noqa: E402
from bench.allocation_ceiling import plan_space  # noqa: E402
from kvplan import Plan  # noqa: E402
from kvplan.plans import STREAMED, atomic_write_text  # noqa: E402
from kvplan.search import BpvModel  # noqa: E402
from kvplan.search.budget import group_damage, repair  # noqa: E402
from kvplan.search.scorers import task_scorers  # noqa: E402
from kvplan.search.sensitivity import correction_factor, slot_sensitivity  # noqa: E402

ROWS = [(0, 16), (4, 8), (8, 8), (16, 8), (32, 8), (16, 4), (16, 16)]  # (recent_length, residual_bits)
PAID = [0, 4, 8, 16]  # recent_length, 8-bit copies, within the plan's budget


def paid_plan(plan: Plan, profile: dict, recent: int) -> tuple[Plan | None, int]:
    """``plan`` with ``recent`` 8-bit copies, its slot bits lowered by the search's repair (damage prior
    from the search's ``profile``) until it fits its budget again; returns the plan and the number of
    slots lowered; ``(None, 0)`` when the copies alone do not fit the budget with the plan's other
    settings (its sink tokens at full precision, all slots at the lowest level)."""
    streamed = plan.streamed_heads()  # stay streamed: their slots have that one level
    extra = dict(streamed_heads=streamed, stream_window=plan.quantizer.stream_window) if streamed else {}
    space = plan_space(plan, residual_bits=8, recent_lengths=(0, recent), **extra)
    model = BpvModel(space, plan.reference)
    damage = group_damage(space, slot_sensitivity(space, profile), correction_factor(profile))
    levels = space.levels_of_table(plan.code_table())
    q = dataclasses.replace(plan.quantizer, recent_length=recent, residual_bits=8)
    lv, q2, _ = repair(model, levels, q, plan.target_bpv, damage)
    if q2.recent_length != recent:
        return None, 0
    return space.plan_of_table(space.table_of_levels(lv), q2, plan.reference), int((lv != levels).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "recent_tokens.md"))
    ap.add_argument("--samples", type=int, default=16, help="validation samples (default 16, the recorded table's; "
                    "fewer for a quick check)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("KVPLAN_THREADS", "1")))
    t0 = time.time()
    plan = Plan.from_yaml(args.plan)
    with open(args.plan[: -len(".yaml")] + ".search.json") as f:
        profile = json.load(f)["profile"]
    val = task_scorers(n_calibration=1, n_validation=args.samples, n_test=0, progress=False).validation
    lines = ["# Recent copies on a fixed plan: validation KL", "",
             f"Command: {stamp()} (method in the script's docstring).", "",
             "| recent_length | copies held as | honest bpv at 512 | residual bpv | validation KL [95% CI] |",
             "|---:|---|---:|---:|---|"]

    def row(label, held, p):
        m, b = val(p), p.bpv()
        lines.append(f"| {label} | {held} | {b.total:.4f} | {b.residual:.4f} | "
                     f"{m['kl']:.4f} [{m['kl_ci95_lo']:.4f}, {m['kl_ci95_hi']:.4f}] |")
        print(lines[-1], flush=True)

    for recent, bits in ROWS:
        q = dataclasses.replace(plan.quantizer, recent_length=recent, residual_bits=bits)
        held = "-" if recent == 0 else ("as written (fp32)" if bits == 16 else f"{bits}-bit per-token codes")
        row(str(recent), held, plan.replace(quantizer=q))
    table = plan.code_table()
    for kind, name in ((0, "keys"), (1, "values")):
        t = table.copy()
        t[:, :, kind] = np.where(t[:, :, kind] == STREAMED, STREAMED, 16)  # a streamed head stays streamed
        row(f"{plan.quantizer.recent_length} (the plan's), every {name[:-1]} slot at full precision (probe)", "-",
            plan.with_table(t))
    lines += ["", f"Copies paid with slot bits (8-bit copies, within the plan's {plan.target_bpv:g} bpv):", "",
              "| recent_length | slots lowered | honest bpv at 512 | residual bpv | validation KL [95% CI] |",
              "|---:|---:|---:|---:|---|"]
    for recent in PAID:
        p2, lowered = paid_plan(plan, profile, recent)
        if p2 is None:
            why = f"does not fit {plan.target_bpv:g} bpv with this plan's other settings"
            lines.append(f"| {recent} | - | - | - | {why} |")
            print(lines[-1], flush=True)
        else:
            row(str(recent), str(lowered), p2)
    lines += ["", f"Wall time {time.time() - t0:.0f} s."]
    atomic_write_text(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
