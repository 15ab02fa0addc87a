"""Probe (not product code): value groups over more than one token (issue 14's format list).

    python bench/value_axis_probe.py bench/results/search-2.5bpv.yaml   # -> results/value_axis_probe.md

Searched plans group values per token over head_dim (``value_axis: token``: one e4m3 scale per 64
values with ``absmax-e4m3``). Grouping them along time instead (``value_axis: channel``: one scale
per channel and ``group_size`` tokens, KIVI's key layout) makes each scale serve more values, so
the scales cost less. The probe swaps the axis of the recorded plan's values, keeping every slot's
bits, and scores it with the **validation** scorer of ``kvplan search`` (16 samples, 512-token
history, the deployed route): as written, with the value codebooks refitted for the longer groups
(``default_codebook``), without the error-feedback metric (fitted for per-token coding), and with
asymmetric fp16 scales (``minmax-fp16``). Bytes are the plan's own accounting.

The other reading, groups of head_dim x n tokens (one scale for n adjacent tokens' values), is not a
kvplan layout; its KL cost is probed by letting the slot encoder (``feedback.group_scales``) give each
run of n tokens of a block the largest of their per-token scales (codes then chosen against it). Bytes
are then counted as today's; such a format would save ``(1 - 1/n)`` of the value scales.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from _stamp import stamp  # noqa: E402
import kvplan.kernels.feedback as feedback  # noqa: E402
from kvplan import Plan  # noqa: E402
from kvplan.kernels.formats import default_codebook  # noqa: E402
from kvplan.plans import atomic_write_text  # noqa: E402
from kvplan.search.scorers import task_scorers  # noqa: E402


_per_token_scales = feedback.group_scales
SHARED = {"tokens": 1}  # adjacent tokens whose value slots share one scale (the probe's patch)


def shared_scales(x, bits, group_size, axis, start_offset=0, fmt=None):
    """``group_scales`` where each run of ``SHARED["tokens"]`` tokens of a token-axis block (from the
    block's first token) takes the largest of their scales; symmetric formats only."""
    scale, zero = _per_token_scales(x, bits, group_size, axis, start_offset, fmt)
    n = SHARED["tokens"]
    if axis != "token" or n == 1:
        return scale, zero
    if zero is not None:
        raise ValueError("the shared-scale probe covers symmetric value formats only")
    B, h, T, G = scale.shape  # [B, H_kv, T, D / g]
    runs = -(-T // n)
    padded = torch.nn.functional.pad(scale.float(), (0, 0, 0, runs * n - T))  # scales are >= 0
    run_max = padded.reshape(B, h, runs, n, G).amax(dim=3, keepdim=True).expand(B, h, runs, n, G)
    return run_max.reshape(B, h, runs * n, G)[:, :, :T].to(scale.dtype), None


def value_scale_bpv(plan: Plan) -> float:
    """The bpv the plan's value scales take (``absmax-e4m3``: 1 byte per group), from its own
    accounting: ``minmax-e4m3`` stores 3 bytes per group (e4m3 scale, fp16 zero), so the difference
    of the two plans' scale bytes is twice the value scales'."""
    q = plan.quantizer
    if q.value_scaling != "absmax-e4m3":
        raise ValueError(f"value_scale_bpv expects absmax-e4m3 value scales, not {q.value_scaling}")
    books = tuple((kind, bits, levels if kind != "v" else default_codebook(bits, "minmax-e4m3",
                                                                          plan.geometry.head_dim))
                  for kind, bits, levels in q.codebooks)
    wider = plan.replace(quantizer=dataclasses.replace(q, value_scaling="minmax-e4m3", codebooks=books))
    return (wider.bpv().scales_zeros - plan.bpv().scales_zeros) / 2


def variants(plan: Plan) -> list[tuple[str, Plan]]:
    q = plan.quantizer

    def with_values(axis: str, scaling: str | None = None, refit: bool = False, feedback: bool = True) -> Plan:
        scaling = scaling or q.value_scaling
        books = q.codebooks
        if refit or scaling != q.value_scaling:
            group_len = q.group_size if axis == "channel" else plan.geometry.head_dim
            books = tuple((kind, bits, levels if kind != "v" else default_codebook(bits, scaling, group_len))
                          for kind, bits, levels in books)
        p = plan.replace(quantizer=dataclasses.replace(q, value_axis=axis, value_scaling=scaling, codebooks=books))
        return p if feedback else p.replace(feedback_metric=None)

    return [("token (the recorded plan)", plan),
            ("token, no error feedback", with_values("token", feedback=False)),
            ("channel", with_values("channel")),
            ("channel, codebooks refitted", with_values("channel", refit=True)),
            ("channel, codebooks refitted, no error feedback", with_values("channel", refit=True, feedback=False)),
            ("channel, minmax-fp16 scales", with_values("channel", scaling="minmax-fp16"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "value_axis_probe.md"))
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("KVPLAN_THREADS", "1")))
    t0 = time.time()
    plan = Plan.from_yaml(args.plan)
    validation = task_scorers(n_calibration=1, n_validation=16, n_test=0, progress=False).validation
    lines = ["# Value groups along time (value_axis: channel) vs per token", "",
             f"Command: {stamp()} (method in the script's docstring). Every slot keeps the recorded plan's bits.", "",
             "| values grouped | value scaling | honest bpv | scales+zeros bpv | validation KL [95% CI] |",
             "|---|---|---:|---:|---|"]
    for label, p in variants(plan):
        b, m = p.bpv(), validation(p)
        lines.append(f"| {label} | {p.quantizer.value_scaling} | {b.total:.4f} | {b.scales_zeros:.4f} | "
                     f"{m['kl']:.4f} [{m['kl_ci95_lo']:.4f}, {m['kl_ci95_hi']:.4f}] |")
        print(lines[-1], flush=True)
    lines += ["", "One scale shared by n adjacent tokens' values (the recorded plan; bytes as written, the "
              "scales such a format would save in the last column):", "",
              "| n tokens per value scale | value scales it would save, bpv | validation KL [95% CI] |",
              "|---:|---:|---|"]
    feedback.group_scales = shared_scales
    for n in (1, 2, 4):
        SHARED["tokens"] = n
        m = validation(plan)
        saved = value_scale_bpv(plan) * (1 - 1 / n)
        lines.append(f"| {n} | {saved:.4f} | {m['kl']:.4f} [{m['kl_ci95_lo']:.4f}, {m['kl_ci95_hi']:.4f}] |")
        print(lines[-1], flush=True)
    feedback.group_scales = _per_token_scales
    lines += ["", f"Wall time {time.time() - t0:.0f} s."]
    atomic_write_text(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
