"""CPU decode attention of one layer: native and chunked packed attention vs dequantize-all + SDPA vs fp32 SDPA.

    python bench/attention_cpu.py          # -> bench/results/attention-cpu.md (~3 min, 1 thread)

One decode token, the default model's head shapes (Hq=9, H_kv=3, D=64, fp32), history
T ∈ {1k, 4k, 16k} × batch {1, 8}, packed like kvplan's runtime stores it (keys per channel,
values per token, group 128, no residual) for int4, int2, a mixed plan (head 1 at 4
bits, heads 0 and 2 at 2: a scattered head set) and the searched plans' codec at 2 bits
(Hadamard on K and V, pre-RoPE keys, key correction of rank 2, Lloyd-Max values with e4m3
absmax scales, as ``bench/results/search-2.5bpv.yaml`` stores most slots). Methods, median of
``--iters`` calls:

* ``sdpa-fp32``: SDPA on the unquantized fp32 cache (what a ``DynamicCache`` step reads);
* ``deq+sdpa``: every block dequantized into one ``[B, H_kv, T, D]`` buffer
  (``PackedBlock.decode_into``, as ``KVPlanLayer._read`` does), then SDPA: kvplan's
  ``attention="dequantize"`` route;
* ``chunked``: :func:`kvplan.kernels.attention_chunked.chunked_decode_attention`
  (``attention="chunked"``);
* ``native``: :func:`kvplan.kernels.attention_native.native_decode_attention`, the
  ``attention="auto"`` route on CPU.

The max abs difference between ``native`` and ``deq+sdpa`` on the same packed cache is listed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _stamp import stamp  # noqa: E402
from kvplan.kernels.attention_chunked import chunked_decode_attention  # noqa: E402
from kvplan.kernels.attention_native import native_decode_attention  # noqa: E402
from kvplan.kernels.formats import Format, default_codebook  # noqa: E402
from kvplan.kernels.rotation import Rotation, hadamard_matrix  # noqa: E402
from kvplan.plans import atomic_write_text  # noqa: E402
from kvplan.runtime.storage import PackedBlock  # noqa: E402

HQ, HKV, D, GROUP = 9, 3, 64, 128
PLANS = {"int4": [((0, 1, 2), 4)], "int2": [((0, 1, 2), 2)], "mixed 2/4/2": [((0, 2), 2), ((1,), 4)],
         "searched codec 2-bit": [((0, 1, 2), 2)]}
CODEC_PLANS = {"searched codec 2-bit"}  # Hadamard K/V, pre-RoPE keys, key correction, Lloyd-Max values


def _median_ms(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _packed(x: torch.Tensor, plan, axis: str, codec: bool = False) -> list:
    if not codec:
        return [PackedBlock.encode(x[:, list(h)].contiguous(), h, bits, axis, GROUP, 0) for h, bits in plan]
    H = hadamard_matrix(D)
    g = torch.Generator().manual_seed(7)
    blocks = []
    for h, bits in plan:
        if axis == "channel":  # keys: pre-RoPE frame + Hadamard, v1 codes, key correction of rank 2
            inv_freq = 1.0 / 100000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
            basis = torch.linalg.qr(torch.randn(len(h), D, D, generator=g))[0][..., :2].contiguous()
            blocks.append(PackedBlock.encode(x[:, list(h)].contiguous(), h, bits, axis, GROUP, 0, basis,
                                             rotation=Rotation(H, inv_freq)))
        else:  # values: Hadamard, Lloyd-Max levels with an e4m3 absmax scale per token
            fmt = Format(bits, "absmax-e4m3", default_codebook(bits, "absmax-e4m3", D))
            blocks.append(PackedBlock.encode(x[:, list(h)].contiguous(), h, bits, axis, GROUP, 0, rotation=Rotation(H),
                                             fmt=fmt))
    return blocks


def _deq_sdpa(q, kb, vb, B, T):
    def read(blocks):
        out = torch.empty(B, HKV, T, D)
        for block in blocks:
            for h0, h1, run in block.head_runs():
                run.decode_into(out[:, h0:h1])
        return out

    return F.scaled_dot_product_attention(q, read(kb), read(vb), enable_gqa=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "attention-cpu.md"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lines = ["# CPU decode attention, one layer (SmolLM2 head shapes)", "",
             f"Command: {stamp(None if argv is None else [__file__, *argv])}; "
             f"torch {torch.__version__}, {args.threads} thread(s), "
             f"{time.strftime('%Y-%m-%d %H:%M')}, load average at start {os.getloadavg()[0]:.2f}.", "",
             "Median ms per call; `native / sdpa-fp32`: the native kernel's time over fp32 SDPA on the "
             "unquantized cache.", "",
             "| batch | history | plan | sdpa-fp32 | deq+sdpa | chunked | native | native / sdpa-fp32 | "
             "max abs diff |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    g = torch.Generator().manual_seed(0)
    for B in args.batches:
        for T in args.contexts:
            k = torch.randn(B, HKV, T, D, generator=g)
            v = torch.randn(B, HKV, T, D, generator=g)
            q = torch.randn(B, HQ, 1, D, generator=g)
            t_fp = _median_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), args.iters)
            for name, plan in PLANS.items():
                codec = name in CODEC_PLANS
                kb, vb = _packed(k, plan, "channel", codec), _packed(v, plan, "token", codec)
                t_deq = _median_ms(lambda: _deq_sdpa(q, kb, vb, B, T), args.iters)
                t_ch = _median_ms(lambda: chunked_decode_attention(q, [kb], [vb], None, None), args.iters)
                t_nat = _median_ms(lambda: native_decode_attention(q, [kb], [vb], None, None), args.iters)
                diff = (native_decode_attention(q, [kb], [vb], None, None) - _deq_sdpa(q, kb, vb, B, T)).abs().max()
                lines.append(f"| {B} | {T} | {name} | {t_fp:.2f} | {t_deq:.2f} | {t_ch:.2f} | {t_nat:.2f} | "
                             f"{t_nat / t_fp:.2f}x | {diff:.1e} |")
                print(lines[-1], flush=True)
    atomic_write_text(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
