"""The residual's interim format (``quantizer.residual_bits``): bytes and KL where tokens wait uncommitted.

    python bench/residual_bits.py bench/results/search-2.5bpv.yaml   # -> bench/results/residual_bits.md

A plan commits tokens in whole groups; the newest ones (the ``residual_length`` window and the group
still filling) wait in the residual, as written (16: the model's dtype, fp32 on CPU) or, with
``residual_bits`` 8 / 4, as per-token codes once their first forward is over. The recorded plan
(group 128, residual 0) is scored with each setting on the **validation** split (this is a choice of a
default, never made on test) of the built-in task at history lengths whose last group is partly filled
(600 and 700 tokens: 88 and 60 tokens wait) and at a group boundary (512: nothing waits, so all three
must agree), through the deployed route (``evaluate``: ``kvplan.make_cache``, the chunked CPU kernel);
the bytes are the caches' own (``bpv_measured``) next to ``plan.bpv(T)``.
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
import kvplan  # noqa: E402
from kvplan.evaluation import default_task_samples, evaluate, pad_token_id, prepare_samples  # noqa: E402
from kvplan.evaluation.parallel import usable_processes  # noqa: E402
from kvplan.plans import atomic_write_text  # noqa: E402

BITS = (16, 8, 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--history", type=int, nargs="+", default=[512, 600, 700])
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "residual_bits.md"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    base = kvplan.Plan.from_yaml(args.plan)
    model, tok = kvplan.load_model(args.model)
    procs = usable_processes(model, args.samples)
    plans = {b: base.replace(quantizer=dataclasses.replace(base.quantizer, residual_bits=b), metrics={})
             for b in BITS}
    lines = ["# Residual held as written vs per-token codes (validation split)", "",
             f"Command: {stamp()} (method in the "
             f"script's docstring); {args.samples} validation samples per length, 32 evaluated tokens each.", "",
             "| history tokens | waiting (uncommitted) | residual | KL [95% CI] | bpv measured | plan.bpv(T) |",
             "|---|---|---|---|---|---|"]
    q = base.quantizer
    for T in args.history:
        samples = default_task_samples(tok, split="validation", n=args.samples, history_tokens=T)
        samples = [dataclasses.replace(s, question_ids=None, options=None, answer=None) for s in samples]
        prepared = prepare_samples(model, samples, pad_token_id(tok), progress=False, processes=procs)
        waiting = T - kvplan.plans.committed_length(T, q.residual_length, q.group_size)
        for b, plan in plans.items():
            r = evaluate(model, plan, prepared, progress=False, processes=procs)
            kl = r["kl"]
            lines.append(f"| {T} | {waiting} | {'as written (fp32)' if b == 16 else f'{b}-bit codes'} | "
                         f"{kl['mean']:.5f} [{kl['ci95'][0]:.5f}, {kl['ci95'][1]:.5f}] | {r['bpv_measured']:.4f} | "
                         f"{plan.bpv(context_len=T, full_precision_bits=32).total:.4f} |")
            print(lines[-1], flush=True)
    lines += ["", f"Wall time {time.time() - t0:.0f} s."]
    atomic_write_text(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
