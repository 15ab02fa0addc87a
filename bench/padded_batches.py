"""A plan on left-padded prompts: the KL a padded row gets, next to the same prompt unpadded.

    python bench/padded_batches.py bench/results/search-2.5bpv.yaml   # -> bench/results/padded_batches.md

``model.generate`` on a batch of prompts of different lengths left-pads the shorter ones. The search
scores unpadded sequences, so a plan's sinks are each sequence's first tokens, and its pre-RoPE key
frame starts at the sequence's first token. For each validation sample of the built-in task (history
512 tokens, 32 evaluated tokens) the history goes through ``kvplan.load``'s cache (``make_cache`` with
the prompt's attention mask, the default attention route), then the evaluated tokens are decoded one
by one (teacher forcing); the KL of each step's next-token distribution from the full-precision
model's is averaged. Rows:

- ``alone``: the prompt unpadded;
- ``padded P, sinks moved``: the prompt left-padded by ``P`` tokens (``attention_mask`` 0 there, RoPE
  positions from the mask, as ``generate`` does), the cache as ``kvplan.load`` makes it: each row's
  first real tokens are its sinks (``KVPlanCache.align_sinks``);
- ``padded P, sinks not moved``: the same with ``align_sinks`` a no-op, the behaviour before it: the
  sink positions hold padding;
- ``padded P, sinks moved, frame shifted``: the same as the first padded row with the cache's RoPE
  tables shifted by ``P`` (a one-row batch only), so that the padded row's keys are quantized in the
  pre-RoPE frame of its own positions, as unpadded; what per-row frames would buy (kvplan's cache
  un-rotates keys by their cache index, shared by the rows of a batch).

A padded row is a one-row batch here: the cache's layout depends on the batch's longest left padding
only, so a longer unpadded companion row would not change the padded row's reads.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kvplan  # noqa: E402
import kvplan.kernels.rotation as rotation  # noqa: E402
from kvplan.evaluation.harness import bootstrap_ci  # noqa: E402
from kvplan.evaluation.tasks import default_task_samples  # noqa: E402
from kvplan.plans import atomic_write_text  # noqa: E402
from kvplan.runtime.cache import KVPlanCache  # noqa: E402
from kvplan.runtime.load import make_cache  # noqa: E402


@contextlib.contextmanager
def sinks_not_moved():
    """``KVPlanCache.align_sinks`` as a no-op: the sinks stay at the batch's first positions."""
    original = KVPlanCache.align_sinks
    KVPlanCache.align_sinks = lambda self, attention_mask: None
    try:
        yield
    finally:
        KVPlanCache.align_sinks = original


@contextlib.contextmanager
def frame_shifted(pad: int):
    """The caches' RoPE tables give cache index ``t`` the angle of position ``t - pad``."""
    original = rotation._cos_sin

    def shifted(start, stop, inv_freq, device):
        return original(start - pad, stop - pad, inv_freq, device)

    rotation._cos_sin = shifted
    try:
        yield
    finally:
        rotation._cos_sin = original


@torch.no_grad()
def decode_logits(model, history: list[int], evaluated: list[int], pad: int, pad_id: int) -> torch.Tensor:
    """Logits ``[E, V]`` after each evaluated token, the history (left-padded by ``pad``) in the plan's cache."""
    ids = torch.tensor([[pad_id] * pad + history])
    mask = torch.ones_like(ids)
    mask[:, :pad] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = make_cache(model, model.kvplan_plan, ids, mask)
    model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
    out = []
    for t, token in enumerate(evaluated):
        mask = torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], -1)
        step = model(input_ids=torch.tensor([[token]]), attention_mask=mask,
                     position_ids=torch.tensor([[len(history) + t]]), cache=cache, use_cache=True)
        out.append(step.logits[0, -1].float())
    return torch.stack(out)


def mean_kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over positions of KL(reference || logits), both ``[E, V]``."""
    return F.kl_div(F.log_softmax(logits, -1), F.log_softmax(reference, -1), log_target=True,
                    reduction="none").sum(-1).mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--samples", type=int, default=8, help="validation samples (default 8)")
    ap.add_argument("--pads", type=int, nargs="+", default=[40, 128], help="left paddings (default 40 128)")
    ap.add_argument("--out", default="bench/results/padded_batches.md")
    args = ap.parse_args()
    t0 = time.time()
    model, tokenizer = kvplan.load_model()
    samples = default_task_samples(tokenizer, split="validation", n=args.samples)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    references = []
    for s in samples:  # full precision: logits after each evaluated token
        full = torch.tensor([s.history_ids + s.eval_ids])
        with torch.no_grad():
            references.append(model(input_ids=full).logits[0, len(s.history_ids):].float())
    kvplan.load(model, args.plan)
    rows = [("alone", 0, contextlib.nullcontext)]
    for pad in args.pads:
        rows += [(f"padded {pad}, sinks moved", pad, contextlib.nullcontext),
                 (f"padded {pad}, sinks not moved", pad, sinks_not_moved),
                 (f"padded {pad}, sinks moved, frame shifted", pad, lambda pad=pad: frame_shifted(pad))]
    results = []
    for name, pad, context in rows:
        kls = []
        with context():
            for s, ref in zip(samples, references):
                kls.append(mean_kl(ref, decode_logits(model, s.history_ids, s.eval_ids, pad, pad_id)))
        results.append((name, *bootstrap_ci(kls)))
        print(f"{name}: {results[-1][1]:.5f}", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = ["# A plan on left-padded prompts (validation split)", "",
             f"Command: `python bench/padded_batches.py {args.plan}` at commit {commit} (method in the script's "
             f"docstring); {len(samples)} validation samples, 512-token history, {len(samples[0].eval_ids)} "
             "evaluated tokens each, decoded one by one through `kvplan.load`'s cache, default attention route.", "",
             "| prompt | KL [95% CI] |", "|---|---|"]
    lines += [f"| {name} | {kl:.4f} [{lo:.4f}, {hi:.4f}] |" for name, kl, lo, hi in results]
    lines += ["", f"Wall time {time.time() - t0:.0f} s."]
    atomic_write_text(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
