"""Probe (not product code): how much would a HeadQ-style key side code help at 2 bits?

    python bench/headq_probe.py        # -> bench/results/headq_probe.md (~4 min on 2 cores)

HeadQ (``../shared/seeds/003``, DESIGN.md source 3) stores, beside each low-bit key, a
rank-``r`` code of its quantization residual in a per-KV-head basis ``U`` learned offline
from calibration queries (top eigenvectors of ``E[q qᵀ]`` over the post-RoPE queries of
the head's GQA group), and reads keys as ``k̂ + U ẑ``: the part of the key error that
queries can see. kvplan does not implement it; this script measures what it would buy on
the default task before anyone builds it.

How: the runtime's ``PackedBlock.encode`` / ``decode_into`` / ``append`` are wrapped so
that channel-axis (key) blocks carry the correction ``U ẑ`` (``ẑ = U^T (k - k̂)``, kept in
fp32 or rounded to ``z_bits`` symmetric with one fp16 scale per token and head), then the
held-out scorer of ``kvplan search`` (16 samples, 512-token history) scores uniform
KIVI-style int2 (group 128, residual 0) on the dequantize route (the one that reads blocks
through ``decode_into``). The side code's storage is not in the cache's
bytes; its cost is computed and listed separately (per key value ``(r·z_bits + 16) / 64``
bits; half that per cached value).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from _stamp import stamp  # noqa: E402
from kvplan.plans import atomic_write_text, uniform_plan  # noqa: E402
from kvplan.runtime import cache as cache_mod  # noqa: E402
from kvplan.runtime.storage import PackedBlock  # noqa: E402
from kvplan.search.scorers import task_scorers  # noqa: E402

# settings of the wrapped storage: basis [L, H_kv, D, r] or None (off), z bits (0 = fp32)
_PROBE = {"basis": None, "z_bits": 0, "layer": None}


def query_second_moments(model, prepared, n_kv: int) -> torch.Tensor:
    """``Σ q qᵀ`` per layer and KV head ``[L, H_kv, D, D]`` over the post-RoPE queries of the
    calibration samples (history + evaluated tokens), captured through a registered attention."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cfg = model.config
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n_rep = cfg.num_attention_heads // n_kv
    acc = torch.zeros(cfg.num_hidden_layers, n_kv, D, D, dtype=torch.float64)

    def capture(module, query, key, value, attention_mask, **kw):
        q = query[0].double()  # [Hq, T, D]; query head j reads KV head j // n_rep
        for h in range(n_kv):
            rows = q[h * n_rep : (h + 1) * n_rep].reshape(-1, D)
            acc[module.layer_idx, h] += rows.T @ rows
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("kvplan_probe_capture", capture)
    previous = cfg._attn_implementation
    model.set_attn_implementation("kvplan_probe_capture")
    try:
        with torch.no_grad():
            for p in prepared:
                model(input_ids=torch.tensor([list(p.sample.history_ids) + list(p.sample.eval_ids)]))
    finally:
        model.set_attn_implementation(previous)
    return acc


def _install_wrappers() -> None:
    encode, decode_into, append = PackedBlock.encode.__func__, PackedBlock.decode_into, PackedBlock.append
    head_range, token_range = PackedBlock.head_range, PackedBlock.token_range
    commit = cache_mod.KVPlanLayer._commit

    def commit_w(self, *args, **kwargs):
        _PROBE["layer"] = self.layer_idx
        return commit(self, *args, **kwargs)

    def encode_w(cls, x, heads, bits, axis, group_size, start, *args, **kwargs):
        block = encode(cls, x, heads, bits, axis, group_size, start, *args, **kwargs)
        U = _PROBE["basis"]
        if U is not None and axis == "channel" and 0 < bits < 16:  # keys (values are per token here)
            Uh = U[_PROBE["layer"], list(heads)]  # [h, D, r]
            z = torch.einsum("bhtd,hdr->bhtr", x.float() - block.decode(torch.float32), Uh)
            if _PROBE["z_bits"]:
                qmax = 2 ** (_PROBE["z_bits"] - 1) - 1
                s = (z.abs().amax(-1, keepdim=True).clamp_min(1e-8) / qmax).half().float()  # per token & head
                z = torch.round(z / s).clamp(-qmax - 1, qmax) * s
            # [B, h, T, D]; not `correction`, the block's field for kvplan's own key correction code
            block._headq = torch.einsum("bhtr,hdr->bhtd", z, Uh)
        return block

    def decode_into_w(self, out):
        decode_into(self, out)
        corr = getattr(self, "_headq", None)
        if corr is not None:
            out += corr.to(out.dtype)
        return out

    def append_w(self, other):
        append(self, other)
        if getattr(self, "_headq", None) is not None:
            self._headq = torch.cat([self._headq, other._headq], dim=2)

    def head_range_w(self, i0, i1):  # dataclasses.replace does not carry the probe's attribute
        part = head_range(self, i0, i1)
        if getattr(self, "_headq", None) is not None:
            part._headq = self._headq[:, i0:i1]
        return part

    def token_range_w(self, a, b):
        part = token_range(self, a, b)
        if part is not self and getattr(self, "_headq", None) is not None:
            part._headq = self._headq[:, :, a:b]
        return part

    cache_mod.KVPlanLayer._commit = commit_w
    PackedBlock.encode = classmethod(encode_w)
    PackedBlock.decode_into = decode_into_w
    PackedBlock.append = append_w
    PackedBlock.head_range = head_range_w
    PackedBlock.token_range = token_range_w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration-samples", type=int, default=12, help="samples the query basis is learned from "
                    "(default 12, the recorded table's)")
    ap.add_argument("--samples", type=int, default=16, help="held-out samples (default 16, the recorded table's; "
                    "fewer for a quick check)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "headq_probe.md"))
    args = ap.parse_args()
    t0 = time.time()
    # the dequantize route: the side code is added where blocks are decoded (PackedBlock.decode_into); the
    # chunked and native kernels read the codes themselves and would never see it
    scorers = task_scorers(n_calibration=args.calibration_samples, n_validation=0, n_test=args.samples,
                           progress=False, attention="dequantize")
    cal, held = scorers.calibration, scorers.test
    g = held.geometry
    moments = query_second_moments(cal.model, cal.prepared, g.num_kv_heads)
    evals, evecs = torch.linalg.eigh(moments)  # ascending
    _install_wrappers()
    base = uniform_plan(g, 2, 2, group_size=128, residual_length=0, modalities=held.modalities,
                        reference=held.reference)
    lines = ["# HeadQ-style key side code on uniform int2: held-out KL (probe)", "",
             f"Command: {stamp()} (method in the script's docstring). Not a kvplan feature: "
             "the side code's bytes are not in the cache; its cost is the column on the right.", "",
             "| rank r | z | query energy in U (mean / min over heads) | held-out KL [95% CI] | "
             "side-code cost, bpv | int2 + side code, bpv |",
             "|---|---|---|---|---|---|"]
    bpv = base.bpv().total
    for rank, z_bits in ((0, 0), (4, 0), (8, 0), (16, 0), (4, 4), (8, 4), (8, 3)):
        if rank:
            _PROBE["basis"] = evecs[..., -rank:].float()
            energy = evals[..., -rank:].sum(-1) / evals.sum(-1)
            e_txt = f"{energy.mean():.3f} / {energy.min():.3f}"
        else:
            _PROBE["basis"], e_txt = None, "—"
        _PROBE["z_bits"] = z_bits
        m = held(base)
        cost = 0.0 if not rank else (rank * (z_bits or 32) + (16 if z_bits else 0)) / 64 / 2
        lines.append(f"| {rank} | {f'int{z_bits}' if z_bits else ('fp32' if rank else '—')} | {e_txt} | "
                     f"{m['kl']:.4f} [{m['kl_ci95_lo']:.4f}, {m['kl_ci95_hi']:.4f}] | {cost:.3f} | "
                     f"{bpv + cost:.3f} |")
        print(lines[-1], flush=True)
    _PROBE["basis"] = None  # where the damage is: one kind at 2 bits, the other at full precision
    split = []
    for kb, vb in ((2, 16), (16, 2)):
        p = uniform_plan(g, kb, vb, group_size=128, residual_length=0, modalities=held.modalities,
                         reference=held.reference)
        m = held(p)
        split.append(f"K{kb}/V{vb} {m['kl']:.4f} [{m['kl_ci95_lo']:.4f}, {m['kl_ci95_hi']:.4f}]")
        print(split[-1], flush=True)
    lines += ["", f"Uniform int2 alone is {bpv:.4f} bpv. Without side code, one kind at 2 bits and the other "
              f"at full precision (held-out KL): {'; '.join(split)}. Wall time {time.time() - t0:.0f} s."]
    atomic_write_text(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
