"""Decode-attention kernel benchmark: fused packed attention vs fp16 SDPA vs dequantize+SDPA.

    python bench/kernels.py                 # full table on a CUDA GPU
    python bench/kernels.py --contexts 4096 --batches 1 --iters 10

For contexts 4k / 16k / 64k and batch 1 / 16, with real head shapes (Hq=28, Hkv=4, D=128,
one decode token), it times:

* ``sdpa-fp16``: ``torch.nn.functional.scaled_dot_product_attention`` on an fp16 cache;
* ``deq+sdpa``: Triton dequantize of every packed block into an fp16 cache, then SDPA;
* ``packed``: :func:`kvplan.kernels.triton_kernels.packed_decode_attention`, straight from
  the packed blocks;

for an int4 plan (KIVI: keys per-channel, values per-token, group 128), an int2 plan and a
mixed plan (KV heads 0-1 at 4 bits, heads 2-3 at 2 bits), each with a 128-token fp16
residual. "Effective bandwidth" is the bytes the method must read (packed codes +
scales / zero-points + residual, or the fp16 cache) divided by its time. The table is
printed and written to ``bench/results/kernels-<gpu name>.md``.

Without a CUDA GPU it says so and exits 0 (``--smoke-cpu`` runs a tiny configuration under
``TRITON_INTERPRET=1`` on CPU to check the script itself; no numbers are written).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

HQ, HKV, D = 28, 4, 128
RESIDUAL = 128
GROUP = 128

# plan name -> list of (kv heads, bits) groups; keys on the channel axis, values on the token axis.
PLANS = {
    "int4": [((0, 1, 2, 3), 4)],
    "int2": [((0, 1, 2, 3), 2)],
    "mixed 4/2": [((0, 1), 4), ((2, 3), 2)],
}


def _time(fn, iters: int, warmup: int, device) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _build_cache(B: int, T: int, plan, device):
    """Packed segment (T - RESIDUAL tokens) + fp16 residual; also the fp16 reference cache."""
    from kvplan.runtime.storage import PackedBlock

    T_seg = T - RESIDUAL
    g = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(B, HKV, T, D, device=device, dtype=torch.float16, generator=g)
    v = torch.randn(B, HKV, T, D, device=device, dtype=torch.float16, generator=g)
    kb, vb = [], []
    for heads, bits in plan:
        idx = list(heads)
        kb.append(PackedBlock.encode(k[:, idx, :T_seg].contiguous(), heads, bits, "channel", GROUP, 0))
        vb.append(PackedBlock.encode(v[:, idx, :T_seg].contiguous(), heads, bits, "token", GROUP, 0))
    kr = k[:, :, T_seg:].contiguous()
    vr = v[:, :, T_seg:].contiguous()
    packed_bytes = sum(t.nbytes for blk in kb + vb for t in blk.tensors()) + kr.nbytes + vr.nbytes
    return [kb], [vb], kr, vr, k, v, packed_bytes


def _dequant_sdpa(q, key_blocks, value_blocks, kr, vr):
    import torch.nn.functional as F

    def assemble(blocks_per_seg, res):
        parts = []
        for blocks in blocks_per_seg:
            seg = torch.empty(res.shape[0], HKV, blocks[0].length, D, dtype=torch.float16, device=res.device)
            for blk in blocks:
                seg[:, list(blk.heads)] = blk.decode(torch.float16)
            parts.append(seg)
        parts.append(res)
        return torch.cat(parts, dim=2)

    k = assemble(key_blocks, kr)
    v = assemble(value_blocks, vr)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def run(contexts, batches, iters, warmup, device) -> list[dict]:
    import torch.nn.functional as F

    from kvplan.kernels import triton_kernels as tk

    rows = []
    for B in batches:
        for T in contexts:
            q = torch.randn(B, HQ, 1, D, device=device, dtype=torch.float16)
            fp16_done = False
            for name, plan in PLANS.items():
                kb, vb, kr, vr, k16, v16, packed_bytes = _build_cache(B, T, plan, device)
                if not fp16_done:
                    fp16_bytes = k16.nbytes + v16.nbytes
                    t = _time(lambda: F.scaled_dot_product_attention(q, k16, v16, enable_gqa=True), iters, warmup, device)
                    rows.append(dict(B=B, T=T, plan="fp16", method="sdpa-fp16", ms=t * 1e3,
                                     bytes=fp16_bytes, gbps=fp16_bytes / t / 1e9))
                    fp16_done = True
                ref = F.scaled_dot_product_attention(q, k16, v16, enable_gqa=True)
                del k16, v16
                t = _time(lambda: _dequant_sdpa(q, kb, vb, kr, vr), iters, warmup, device)
                rows.append(dict(B=B, T=T, plan=name, method="deq+sdpa", ms=t * 1e3,
                                 bytes=packed_bytes, gbps=packed_bytes / t / 1e9))
                out = tk.packed_decode_attention(q, kb, vb, kr, vr)
                check = _dequant_sdpa(q, kb, vb, kr, vr)
                err = (out.float() - check.float()).abs().max().item()
                qerr = (out.float() - ref.float()).abs().max().item()
                t = _time(lambda: tk.packed_decode_attention(q, kb, vb, kr, vr), iters, warmup, device)
                rows.append(dict(B=B, T=T, plan=name, method="packed", ms=t * 1e3,
                                 bytes=packed_bytes, gbps=packed_bytes / t / 1e9, err=err, qerr=qerr))
                del kb, vb, kr, vr
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def _table(rows, device_name: str) -> str:
    lines = [
        f"# Decode attention kernels on {device_name}",
        "",
        f"Hq={HQ}, Hkv={HKV}, D={D}, 1 query token, fp16 q; packed caches: keys per-channel, values "
        f"per-token, group {GROUP}, {RESIDUAL}-token fp16 residual. Median time per call; "
        "GB/s = bytes the method must read / time. Diff columns (packed only): max abs difference to "
        "dequantize+SDPA on the same quantized cache, and to fp16 SDPA on the unquantized cache.",
        "",
        "| batch | context | plan | method | time (ms) | MB read | GB/s | speedup vs fp16 SDPA | diff vs deq+sdpa | diff vs fp16 |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = {(r["B"], r["T"]): r["ms"] for r in rows if r["method"] == "sdpa-fp16"}
    for r in rows:
        sp = base[(r["B"], r["T"])] / r["ms"]
        err = f"{r['err']:.2e} | {r['qerr']:.2e}" if "err" in r else " | "
        lines.append(
            f"| {r['B']} | {r['T']} | {r['plan']} | {r['method']} | {r['ms']:.3f} | {r['bytes'] / 1e6:.1f} | "
            f"{r['gbps']:.0f} | {sp:.2f}x | {err} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="markdown file (default bench/results/kernels-<gpu>.md)")
    ap.add_argument("--smoke-cpu", action="store_true", help="tiny run on CPU under TRITON_INTERPRET=1; writes nothing")
    args = ap.parse_args(argv)

    if args.smoke_cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        rows = run([RESIDUAL + 64], [1], iters=1, warmup=0, device=torch.device("cpu"))
        print(_table(rows, "CPU (Triton interpreter; timings meaningless)"))
        return 0

    if not torch.cuda.is_available():
        print("No CUDA GPU is available: the kernel benchmark needs one. Nothing measured.")
        return 0
    try:
        import triton  # noqa: F401

        from kvplan.kernels import triton_kernels  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the install
        print(f"Triton kernels are unavailable ({exc!r}); nothing measured.")
        return 0

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    rows = run(args.contexts, args.batches, args.iters, args.warmup, device)
    table = _table(rows, name)
    print(table)
    out = args.out or ROOT / "bench" / "results" / f"kernels-{re.sub(r'[^A-Za-z0-9]+', '-', name).strip('-').lower()}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
