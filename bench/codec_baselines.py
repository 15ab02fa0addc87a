"""The searched plan against codec-only baselines at its budget: validation and test KL.

    python bench/codec_baselines.py bench/results/search-2.5bpv.yaml   # -> bench/results/codec_baselines.md
    python bench/codec_baselines.py bench/results/gemma3/plan.yaml --model gemma3-270m \
        --out bench/results/gemma3/codec_baselines.md                  # the second real model (issue 19)

Does the search earn its place beyond the codec? Every baseline gets kvplan's best codec, the
searched plan's own quantizer (slot formats, Hadamard + pre-RoPE rotations, group, residual,
sink, key-correction basis), and no search:

* **uniform**: every key and value slot at the same bits (2 bits: the only uniform plan under a
  2.5 bpv budget), with and without the key correction on every key slot;
* **HeadGuard-style** (``../shared/DESIGN.md`` source 2): the physical KV heads whose keys the
  search's calibration sensitivity profile (``<plan>.search.json``; per-head entries where the
  profile has them, else the layer's entry) ranks most damaging keep their keys at 4 (or 3) bits,
  the rest 2 bits, adding heads in that order while the plan stays within the budget;
* **rank-based streaming** (when the searched plan streams KV heads, ``--stream-window``): n heads streamed
  in the order of the profile's streaming damage (least first, ``Lxx.stream.hy``) for n in a grid around
  the searched plan's count (1/2, 3/4, 1, 3/2 and 2 times it), the bpv they free spent on HeadGuard's
  ladder (the other key heads to 3 bits in the key profile's order, then value heads to 3 bits in the
  value profile's order, then key heads to 4 bits) while the plan fits: a DuoAttention-style ranking
  given the same level as the search.

Every plan is scored by the **validation** and the **test** scorers of ``kvplan search`` (16 samples each,
512-token history, the deployed route). The best codec-only baseline, the one the searched plan is
compared with, is chosen on validation (as a user would choose among these recipes); test is reported
only. HeadGuard's heads and the streaming order come from the calibration profile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

try:  # bench/ is sys.path[0] when run as python bench/x.py, not when imported as bench.x from elsewhere
    from _stamp import stamp  # noqa: E402
except ModuleNotFoundError:
    from bench._stamp import stamp  # noqa: E402
from kvplan import Plan  # noqa: E402
from kvplan.plans import STREAMED, atomic_write_text, slot_code  # noqa: E402
from kvplan.search.streaming import stream_key  # noqa: E402
from kvplan.search.scorers import task_scorers  # noqa: E402


def key_ranking(profile: dict, n_layers: int, n_heads: int) -> list[tuple[int, int]]:
    """``(layer, head)`` by decreasing key sensitivity in the calibration profile."""
    score = {}
    for layer in range(n_layers):
        for head in range(n_heads):
            per_head = profile.get(f"L{layer:02d}.k.h{head}")
            score[layer, head] = per_head if per_head is not None else profile.get(f"L{layer:02d}.k", 0.0) / n_heads
    return sorted(score, key=lambda lh: -score[lh])


def baseline_plans(searched: Plan, profile: dict, budget: float) -> list[tuple[str, Plan]]:
    """The codec-only baselines of ``searched`` at ``budget`` (its quantizer, no search): uniform K2V2
    (with and without the key correction on every key when the plan corrects keys) and the
    HeadGuard-style plans with key heads at 4 or 3 bits in ``profile``'s order; ``(label, plan)``."""
    g, q = searched.geometry, searched.quantizer
    corr = bool(q.key_correction_rank)  # keys at 2 bits carry the key correction

    def plan_of(key_codes: np.ndarray, name: str) -> Plan:  # key codes [L, H_kv], every value slot 2 bits
        table = np.full((g.num_layers, g.num_kv_heads, 2, len(searched.modalities)), 2, dtype=np.int64)
        table[:, :, 0, :] = key_codes[:, :, None]
        return searched.replace(name=name, metrics={}).with_table(table)

    base = np.full((g.num_layers, g.num_kv_heads), 2, dtype=np.int64)
    rows = [("uniform K2V2", plan_of(base, "uniform-k2v2"))]
    if corr:
        rows.append(("uniform K2V2, key correction on every key",
                     plan_of(slot_code(base, corrected=True), "uniform-k2v2-corr")))
    order = key_ranking(profile, g.num_layers, g.num_kv_heads)
    for high in (4, 3):
        keys = slot_code(base, corr)
        n = 0
        for layer, head in order:
            trial = keys.copy()
            trial[layer, head] = high
            if plan_of(trial, f"headguard-k{high}-trial").bpv().total > budget + 1e-9:
                break
            keys, n = trial, n + 1
        rows.append((f"HeadGuard-style: {n} key heads at {high} bits, rest K2{'+corr' if corr else ''}V2",
                     plan_of(keys, f"headguard-k{high}")))
    n_streamed = len(searched.streamed_heads())
    if n_streamed:
        for n in sorted({max(1, round(n_streamed * f)) for f in (0.5, 0.75, 1, 1.5, 2)}):
            rows.append(rank_streaming(searched, profile, budget, n))
    return rows


def rank_streaming(searched: Plan, profile: dict, budget: float, n_stream: int) -> tuple[str, Plan]:
    """The rank-based streaming baseline of the module docstring: ``(label, plan)``."""
    g, q = searched.geometry, searched.quantizer
    L, H = g.num_layers, g.num_kv_heads
    measured = [(profile[stream_key(l, h)], l, h) for l in range(L) for h in range(H) if stream_key(l, h) in profile]
    streamed = {(l, h) for _, l, h in sorted(measured)[:n_stream]}
    table = np.full(searched.code_table().shape, 2, dtype=np.int64)
    table[:, :, 0] = slot_code(table[:, :, 0], bool(q.key_correction_rank))
    for l, h in streamed:
        table[l, h] = STREAMED
    values = {k.replace(".v", ".k"): v for k, v in profile.items() if ".v" in k}  # key_ranking reads ".k" names
    ladder = ([(lh, 0, 3) for lh in key_ranking(profile, L, H)] + [(lh, 1, 3) for lh in key_ranking(values, L, H)]
              + [(lh, 0, 4) for lh in key_ranking(profile, L, H)])
    raised: dict = {}
    for (l, h), kind, bits in ladder:
        if (l, h) in streamed:
            continue
        trial = table.copy()
        trial[l, h, kind] = bits
        if searched.with_table(trial).bpv().total > budget + 1e-9:
            break
        table = trial
        raised[kind, bits] = raised.get((kind, bits), 0) + 1
    what = ", ".join(f"{n} {'key' if kind == 0 else 'value'} heads at {bits} bits" for (kind, bits), n in raised.items())
    return (f"rank-based: {n_stream} least-damaged heads streamed, then {what or 'nothing raised'}",
            searched.replace(name="rank-streaming", metrics={}).with_table(table))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--model", default="smollm2-135m", help="the model the plan was searched on (a kvplan.load_model "
                    "name, .gguf file or directory; default: the embedded default model)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "codec_baselines.md"))
    ap.add_argument("--samples", type=int, default=16, help="validation and test samples each (default 16, the "
                    "recorded tables'; fewer for a quick check)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("KVPLAN_THREADS", "1")))
    t0 = time.time()
    searched = Plan.from_yaml(args.plan)
    sidecar = os.path.splitext(args.plan)[0] + ".search.json"
    profile = json.load(open(sidecar))["profile"]
    budget = searched.target_bpv or searched.bpv().total
    scorers = task_scorers(args.model, n_calibration=1, n_validation=args.samples, n_test=args.samples,
                           progress=False)
    rows = [("searched (kvplan search)", searched)] + baseline_plans(searched, profile, budget)
    lines = [f"# Searched plan vs codec-only baselines at {budget:g} bpv (best baseline chosen on validation)", "",
             f"Command: {stamp()} (method in the script's docstring).", "",
             "| plan | honest bpv | validation KL | test KL [95% CI] |", "|---|---|---|---|"]
    results = []  # (label, bpv, validation KL, test KL)
    for label, plan in rows:
        val, m = scorers.validation(plan), scorers.test(plan)
        results.append((label, plan.bpv().total, val["kl"], m["kl"]))
        lines.append(f"| {label} | {plan.bpv().total:.4f} | {val['kl']:.4f} | {m['kl']:.4f} "
                     f"[{m['kl_ci95_lo']:.4f}, {m['kl_ci95_hi']:.4f}] |")
        print(lines[-1], flush=True)
    best = min(results[1:], key=lambda r: r[2])
    lines += ["", f"Best codec-only baseline on validation: {best[0]} (validation KL {best[2]:.4f}, test {best[3]:.4f}); "
              f"the searched plan's test KL is {results[0][3] / best[3]:.2f}x of its test KL, its validation KL "
              f"{results[0][2] / best[2]:.2f}x (target: at most 0.5x).", "",
              f"Wall time {time.time() - t0:.0f} s."]
    atomic_write_text(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
