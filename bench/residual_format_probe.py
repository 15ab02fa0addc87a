"""Probe: a cheaper interim format for the residual (issue 14's saw-tooth item), before building one.

    python bench/residual_format_probe.py bench/results/search-2.5bpv.yaml   # -> bench/results/residual_format_probe.md

Today a token waiting for its group to commit (and every recent / streamed-window copy, which keep that
form) is held as a per-token v1 code (``quantizer.residual_bits`` 8: uniform levels, fp16 scale and zero
per ``head_dim`` channels, 8.5 bits a value at head_dim 64), in the model's own frame. The slots code the
same vectors after a Hadamard rotation, where coordinates are near Gaussian, so 4 bits with a symmetric
fp8 (e4m3) scale might hold them as well as 8 unrotated bits at half the bytes. This probe replaces, in
this process only, how :class:`kvplan.runtime.storage.Residual` codes and reads tokens (no plan field, no
kernel change: every attention route reads the residual dense, through ``Residual.read``):

* ``v1`` at 8 / 4 bits: today's format (``residual_bits`` 8 / 4);
* ``hadamard + absmax-e4m3`` at 8 / 4 bits: each token multiplied by the Hadamard matrix, coded per token
  with one e4m3 scale per head_dim channels, uniform or Lloyd-Max levels (fitted for Gaussian groups of
  head_dim values, as the value slots' codebooks are), multiplied back on read.

Scored on the **validation** split through the deployed route (``evaluate``: ``kvplan.make_cache``, the
chunked CPU kernel; one process, so that the replacement holds), at 512 history tokens (nothing waits; the
4 recent copies and the streamed heads' 16-token windows are in residual form) and at 600 / 700 (88 / 60
tokens wait). ``bpv measured`` is the caches' own bytes; the probe's format has no plan field, so there
is no ``plan.bpv(T)`` beside it.
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
from kvplan.kernels.formats import Format, lloyd_max_levels  # noqa: E402
from kvplan.kernels.qtypes import FULL_PRECISION_BITS  # noqa: E402
from kvplan.kernels.rotation import hadamard_matrix  # noqa: E402
from kvplan.plans import atomic_write_text  # noqa: E402
from kvplan.runtime import storage  # noqa: E402
from kvplan.runtime.storage import PackedBlock, Residual  # noqa: E402

ORIGINAL = {name: getattr(Residual, name) for name in ("seal", "read", "oldest")}


def rotated_residual(head_dim: int, bits: int, levels) -> None:
    """Make every :class:`Residual` code its tokens as ``bits``-bit absmax-e4m3 codes of ``x H`` (``levels``:
    a codebook, or ``None`` for uniform levels) and read them back as ``decode · H``."""
    fmt = Format(bits, "absmax-e4m3", levels)
    h = hadamard_matrix(head_dim)  # fp32 [D, D], symmetric and orthogonal

    def seal(self) -> None:
        if self.fresh.shape[-2] == 0:
            return
        heads = tuple(range(self.fresh.shape[1]))
        block = PackedBlock.encode(self.fresh.float() @ h, heads, bits, "token", self.group_size, 0, fmt=fmt)
        if self.sealed is None:
            self.sealed = block
        else:
            self.sealed.append(block)
        B, H, _, D = self.fresh.shape
        self.fresh = self.fresh.new_empty((B, H, 0, D))

    def decoded(block: PackedBlock, dtype) -> torch.Tensor:
        return (block.decode(torch.float32) @ h).to(dtype)

    def read(self) -> torch.Tensor:
        if self.sealed is None:
            return self.fresh
        return torch.cat([decoded(self.sealed, self.fresh.dtype), self.fresh], dim=-2)

    def oldest(self, n: int) -> torch.Tensor:
        if self.sealed is None:
            return self.fresh[:, :, :n]
        m = self.sealed.length
        if n <= m:
            return decoded(self.sealed.token_range(0, n), self.fresh.dtype)
        return torch.cat([decoded(self.sealed, self.fresh.dtype), self.fresh[:, :, : n - m]], dim=-2)

    Residual.seal, Residual.read, Residual.oldest = seal, read, oldest


def restore() -> None:
    for name, fn in ORIGINAL.items():
        setattr(Residual, name, fn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--history", type=int, nargs="+", default=[512, 600, 700])
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "residual_format_probe.md"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    base = kvplan.Plan.from_yaml(args.plan)
    q = base.quantizer
    if q.residual_bits == FULL_PRECISION_BITS:
        raise SystemExit(f"{args.plan}: holds its residual as written (residual_bits 16); the probe compares codes")
    model, tok = kvplan.load_model(args.model)
    D = base.geometry.head_dim
    conditions = [  # (label, residual_bits of the plan, rotated codebook or None for today's v1 codes)
        ("v1, 8 bits (today)", 8, None),
        ("v1, 4 bits", 4, None),
        ("hadamard + absmax-e4m3, 8 bits, uniform", 8, ("uniform", 8)),
        ("hadamard + absmax-e4m3, 4 bits, uniform", 4, ("uniform", 4)),
        ("hadamard + absmax-e4m3, 4 bits, Lloyd-Max", 4, ("lloyd", 4)),
        ("hadamard + absmax-e4m3, 3 bits, Lloyd-Max", 3, ("lloyd", 3)),
    ]
    lines = ["# Residual interim format probe (validation split)", "",
             f"Command: {stamp()} (method "
             f"in the script's docstring); {args.samples} validation samples per length, 32 evaluated tokens each, "
             f"the recorded plan's slots, sink and copies (group {q.group_size}, {q.recent_length} recent copies, "
             f"stream window {q.stream_window}).", "",
             "| history tokens | waiting (uncommitted) | residual form | KL [95% CI] | bpv measured |",
             "|---|---|---|---|---|"]
    for T in args.history:
        samples = default_task_samples(tok, split="validation", n=args.samples, history_tokens=T)
        samples = [dataclasses.replace(s, question_ids=None, options=None, answer=None) for s in samples]
        prepared = prepare_samples(model, samples, pad_token_id(tok), progress=False)
        waiting = T - kvplan.plans.committed_length(T, q.residual_length, q.group_size)
        for label, bits, rotated in conditions:
            plan = base.replace(quantizer=dataclasses.replace(q, residual_bits=bits if rotated is None else 8),
                                metrics={})
            try:
                if rotated is not None:
                    kind, b = rotated
                    rotated_residual(D, b, lloyd_max_levels(b, True, D) if kind == "lloyd" else None)
                r = evaluate(model, plan, prepared, progress=False, processes=1)
            finally:
                restore()
            kl = r["kl"]
            lines.append(f"| {T} | {waiting} | {label} | {kl['mean']:.5f} [{kl['ci95'][0]:.5f}, {kl['ci95'][1]:.5f}] "
                         f"| {r['bpv_measured']:.4f} |")
            print(lines[-1], flush=True)
    lines += ["", f"Wall time {time.time() - t0:.0f} s."]
    atomic_write_text(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    assert storage.Residual is Residual
    main()
