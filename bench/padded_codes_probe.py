"""What a left-padded row stores, next to what the same prompt stores alone: code by code.

    python bench/padded_codes_probe.py bench/results/search-2.5bpv.yaml   # -> bench/results/padded_codes_probe.md

``bench/padded_batches.py`` reads a padded row's KL within a paired interval of the unpadded one's, a
few ten-thousandths above it. This probe says where that can come from. For each validation sample the
history (512 tokens) is written into ``kvplan.load``'s cache (``make_cache`` with the prompt's mask)
alone, and left-padded by ``P`` as row 0 of a two-row batch (row 1: another sample's text, unpadded),
one torch thread. Every committed slot block of the padded row is compared with the same block alone
(the padded sink run's last tokens with the sink alone): the share of code bytes that differ, and the
largest difference of the decoded values. The model's own full-precision K/V of the two prefills are
compared too (``DynamicCache``, the same prompts): the float rounding a padded prompt starts from (the
model runs at another sequence length and with a mask).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import kvplan  # noqa: E402
from _stamp import stamp  # noqa: E402
from kvplan.evaluation import default_task_samples  # noqa: E402
from kvplan.plans import atomic_write_text  # noqa: E402
from kvplan.runtime.load import make_cache  # noqa: E402
from padded_batches import parse_args  # noqa: E402


@torch.no_grad()
def prefill(model, rows: list[list[int]], mask: torch.Tensor, cache):
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    model(input_ids=torch.tensor(rows), attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
    return cache


def compare_codes(alone, padded) -> tuple[int, int, float]:
    """``(differing code bytes, code bytes, max |decoded difference|)`` over every committed quantized
    block of row 0, the padded sink runs cut to their last tokens (the unpadded sink's length)."""
    differing = total = 0
    worst = 0.0
    for la, lp in zip(alone.layers, padded.layers):
        for kind in ("k", "v"):
            for sa, sp in zip(la.segments[kind], lp.segments[kind]):
                for ba, bp in zip(sa.blocks, sp.blocks):
                    if bp.length != ba.length:  # the sink run: padding + the sinks
                        bp = bp.token_range(bp.length - ba.length, bp.length)
                    if ba.scale is None or ba.codes.numel() == 0:  # full precision / streamed: no codes
                        continue
                    differing += int((ba.codes[0] != bp.codes[0]).sum())
                    total += ba.codes[0].numel()
                    diff = (ba.decode(torch.float32)[0] - bp.decode(torch.float32)[0]).abs().max()
                    worst = max(worst, float(diff))
    return differing, total, worst


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], "bench/results/padded_codes_probe.md")
    t0 = time.time()
    torch.set_num_threads(1)
    model, tokenizer = kvplan.load_model()
    samples = default_task_samples(tokenizer, split="validation", n=args.samples)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = []
    for pad in args.pads:
        differing = total = 0
        worst = fp_worst = 0.0
        for i, s in enumerate(samples):
            h = s.history_ids
            other = samples[(i + 1) % len(samples)]
            companion = ((other.history_ids + other.eval_ids) * 2)[:pad + len(h)]
            one = torch.ones(1, len(h), dtype=torch.long)
            mask = torch.ones(2, pad + len(h), dtype=torch.long)
            mask[0, :pad] = 0
            batch = [[pad_id] * pad + h, companion]
            fp_alone = prefill(model, [h], one, DynamicCache())
            fp_padded = prefill(model, batch, mask, DynamicCache())
            for la, lp in zip(fp_alone.layers, fp_padded.layers):
                for a, p in ((la.keys, lp.keys), (la.values, lp.values)):
                    fp_worst = max(fp_worst, float((a[0] - p[0, :, pad:]).abs().max()))
            kvplan.load(model, args.plan)
            plan = model.kvplan_plan
            alone = prefill(model, [h], one, make_cache(model, plan, torch.tensor([h]), one))
            padded = prefill(model, batch, mask, make_cache(model, plan, torch.tensor(batch), mask))
            kvplan.unload(model)
            d, n, w = compare_codes(alone, padded)
            differing, total, worst = differing + d, total + n, max(worst, w)
            print(f"pad {pad} sample {i}: {d}/{n} code bytes differ, max decoded diff {w:.3g}", flush=True)
        rows.append((pad, differing, total, worst, fp_worst))
    lines = ["# A left-padded row's codes against the same prompt's alone (validation split)", "",
             f"Command: {stamp()} (method in the script's docstring); {len(samples)} validation samples, "
             "512-token history, one torch thread.", "",
             "| padding | code bytes that differ | max abs. difference of decoded values | "
             "max abs. difference of the model's full-precision K/V |", "|---:|---|---:|---:|"]
    lines += [f"| {pad} | {d} of {n} ({d / n:.2e}) | {w:.3g} | {f:.3g} |" for pad, d, n, w, f in rows]
    lines += ["", f"Wall time {time.time() - t0:.0f} s."]
    atomic_write_text(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
