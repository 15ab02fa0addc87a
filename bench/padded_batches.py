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
- ``batched, unpadded``: the prompt unpadded as row 0 of a batch whose row 1 is as long (another
  sample's text): what a batch changes without any padding (the matrix shapes, hence float rounding);
- ``padded P``: the prompt left-padded by ``P`` tokens (``attention_mask`` 0 there, RoPE positions
  from the mask, as ``generate`` does) in a batch with an unpadded row (another validation sample's
  text), the cache as ``kvplan.load`` makes it (``KVPlanCache.align_to_padding``): each row's first
  real tokens are its sinks and its keys are quantized in the pre-RoPE frame of its own positions;
- ``padded P, key frame at the cache index``: the same with ``Rotation.set_row_padding`` a no-op: the
  sinks and the group grid move, the keys are un-rotated by their cache index (db92d7b's keys; db92d7b's
  groups stayed on the absolute grid, which is the same when ``P`` is a whole number of groups);
- ``padded P, not aligned``: the same with ``align_to_padding`` a no-op: the sink positions hold
  padding (the behaviour before db92d7b);
- ``unpadded, beside a row padded P``: the prompt unpadded as row 0, the companion row left-padded by
  ``P``: the less-padded row of a batch. The cache aligns to the longest padding, so this row's first ``P``
  tokens are held with the sinks (at ``quantizer.sink_bits``) and its token groups start ``P`` tokens
  after its first token, not at it as alone: not the stored form the search scored, measured here.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from _stamp import stamp  # noqa: E402
import kvplan  # noqa: E402
from kvplan.kernels.rotation import Rotation  # noqa: E402
from kvplan.evaluation import bootstrap_ci, kl_divergence  # noqa: E402
from kvplan.evaluation.tasks import default_task_samples  # noqa: E402
from kvplan.plans import atomic_write_text  # noqa: E402
from kvplan.runtime.cache import KVPlanCache  # noqa: E402
from kvplan.runtime.load import make_cache  # noqa: E402


@contextlib.contextmanager
def replaced(owner, name: str, value):
    """``owner.name`` is ``value`` inside the block."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


@torch.no_grad()
def decode_logits(model, history: list[int], evaluated: list[int], pad: int, pad_id: int,
                  companion: list[int] | None, companion_pad: int = 0) -> torch.Tensor:
    """Logits ``[E, V]`` after each evaluated token, the history in the plan's cache: alone (``companion``
    None, ``pad`` 0) or left-padded by ``pad`` (0 or more) as row 0 of a batch whose row 1 is ``companion``
    (``len(history) + pad + E`` tokens), itself left-padded by ``companion_pad`` (0 or more)."""
    rows = [[pad_id] * pad + history]
    if companion is not None:
        rows.append([pad_id] * companion_pad + companion[:pad + len(history) - companion_pad])
    ids = torch.tensor(rows)
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    if companion is not None:
        mask[1, :companion_pad] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = make_cache(model, model.kvplan_plan, ids, mask)
    model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
    out = []
    for t, token in enumerate(evaluated):
        step_ids = [[token]] + ([[companion[pad + len(history) - companion_pad + t]]] if companion is not None
                                else [])
        mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype)], -1)
        step = model(input_ids=torch.tensor(step_ids), attention_mask=mask, position_ids=positions[:, -1:] + 1 + t,
                     cache=cache, use_cache=True)
        out.append(step.logits[0, -1].float())
    return torch.stack(out)


def mean_kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over positions of KL(reference || logits), both ``[E, V]``: the harness's KL (float64)."""
    return kl_divergence(torch.log_softmax(reference, -1), torch.log_softmax(logits, -1)).mean().item()


def parse_args(description: str, out: str) -> argparse.Namespace:
    """The plan, the validation samples and the paddings (this bench's and ``padded_codes_probe.py``'s)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("plan")
    ap.add_argument("--samples", type=int, default=8, help="validation samples (default 8)")
    ap.add_argument("--pads", type=int, nargs="+", default=[40, 128], help="left paddings (default 40 128)")
    ap.add_argument("--out", default=out)
    return ap.parse_args()


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], "bench/results/padded_batches.md")
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
    rows = [("alone", None, contextlib.nullcontext), ("batched, unpadded", 0, contextlib.nullcontext)]
    rows += [(f"unpadded, beside a row padded {pad}", (0, pad), contextlib.nullcontext) for pad in args.pads]
    for pad in args.pads:
        rows += [(f"padded {pad}", pad, contextlib.nullcontext),
                 (f"padded {pad}, key frame at the cache index", pad,
                  lambda: replaced(Rotation, "set_row_padding", lambda self, padding: None)),
                 (f"padded {pad}, not aligned", pad,
                  lambda: replaced(KVPlanCache, "align_to_padding", lambda self, attention_mask: None))]
    results, alone = [], None
    for name, pad, context in rows:
        kls = []
        with context():
            for i, (s, ref) in enumerate(zip(samples, references)):
                other = samples[(i + 1) % len(samples)]  # the companion row: another sample's text, twice
                companion = None if pad is None else (other.history_ids + other.eval_ids) * 2
                own, beside = pad if isinstance(pad, tuple) else (pad or 0, 0)
                kls.append(mean_kl(ref, decode_logits(model, s.history_ids, s.eval_ids, own, pad_id, companion,
                                                      beside)))
        alone = alone or kls  # the first row: the paired differences below are against it
        results.append((name, *bootstrap_ci(kls), *bootstrap_ci([k - a for k, a in zip(kls, alone)])))
        print(f"{name}: {results[-1][1]:.5f}", flush=True)
    lines = ["# A plan on left-padded prompts (validation split)", "",
             f"Command: {stamp()} (method in the script's "
             f"docstring); {len(samples)} validation samples, 512-token history, {len(samples[0].eval_ids)} "
             "evaluated tokens each, decoded one by one through `kvplan.load`'s cache, default attention route.", "",
             "| prompt | KL [95% CI] | minus `alone`, paired by sample [95% CI] |", "|---|---|---|"]
    lines += [f"| {name} | {kl:.4f} [{lo:.4f}, {hi:.4f}] | {d:+.5f} [{dlo:+.5f}, {dhi:+.5f}] |"
              for name, kl, lo, hi, d, dlo, dhi in results]
    lines += ["", f"Wall time {time.time() - t0:.0f} s."]
    atomic_write_text(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
