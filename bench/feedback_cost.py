"""What the error-feedback encoder costs: wall time to write a history into a plan's cache.

    python bench/feedback_cost.py bench/results/search-2.5bpv.yaml   # -> bench/results/feedback_cost.md (~1 min)

The plan as recorded (error feedback under its ``feedback_metric``) against the same plan without
the metric (nearest-level codes), on the default model's geometry: the per-layer key / value
states of a real full-precision prefill of ``T`` tokens (text from ``pydoc_data``) are written into
a fresh :class:`kvplan.KVPlanCache` layer by layer, as a prefill does (every whole group is
committed, encoded once); the median of ``--repeats`` runs, one torch thread. A decode step
commits a group once every ``group_size`` steps, so the per-step share is the 128-token row
divided by ``group_size``. CPU only; on CUDA the loop runs the same PyTorch ops on the GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from _stamp import stamp  # noqa: E402
from kvplan import KVPlanCache, Plan, load_model  # noqa: E402
from kvplan.plans import atomic_write_text  # noqa: E402


def history_states(model, tokenizer, T: int):
    """Per-layer (keys, values) ``[1, H_kv, T, D]`` of a full-precision prefill of ``T`` tokens."""
    from pydoc_data.topics import topics
    from transformers import DynamicCache

    text = " ".join(topics.values())
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :T]
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return [(layer.keys, layer.values) for layer in cache.layers]


def write_time(plan: Plan, model, states, repeats: int) -> float:
    from kvplan.runtime import attention_route

    times = []
    with attention_route(model, "auto", plan):  # as kvplan.load leaves the model (a streaming plan needs it)
        for _ in range(repeats):
            cache = KVPlanCache(plan, model)
            t0 = time.perf_counter()
            for layer, (k, v) in zip(cache.layers, states):
                layer.update(k, v)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 4096])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "feedback_cost.md"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    plan = Plan.from_yaml(args.plan)
    if plan.feedback_metric is None:
        raise SystemExit(f"{args.plan}: the plan has no feedback_metric")
    plain = plan.replace(feedback_metric=None)
    model, tokenizer = load_model()
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    lines = ["# Error-feedback encoder: time to write a history into the cache", "",
             f"Command: {stamp()} (method in the script's "
             f"docstring); 1 torch thread, load average at start {load}, median of {args.repeats}.", "",
             "| tokens written | nearest-level codes ms | error feedback ms | difference ms |", "|---:|---:|---:|---:|"]
    for T in args.lengths:
        states = history_states(model, tokenizer, T)
        a, b = write_time(plain, model, states, args.repeats), write_time(plan, model, states, args.repeats)
        lines.append(f"| {T} | {1e3 * a:.1f} | {1e3 * b:.1f} | {1e3 * (b - a):.1f} |")
        print(lines[-1], flush=True)
    atomic_write_text(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
