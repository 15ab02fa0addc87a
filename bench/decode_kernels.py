"""Decode-attention kernel benchmark: fused packed attention vs fp16 SDPA vs dequantize+SDPA.

(Named decode_kernels.py, not kernels.py: scripts run from bench/ put it first on sys.path, where a
kernels.py shadows the `kernels` package that transformers imports.)

    python bench/decode_kernels.py                 # full table on a CUDA GPU
    python bench/decode_kernels.py --contexts 4096 --batches 1 --iters 10

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

``--step-table`` (what ``bench/gpu.sh`` runs after the kernel tests) times instead, on a
random-weight model of the default model's config (SmolLM2-135M: 30 layers, hidden 576, 9 heads,
3 KV heads, head_dim 64; the GGUF weights are not needed for timing), for ``sdpa`` /
``DynamicCache`` and kvplan ``int4``, ``int2``, ``k4v2`` and the default searched plan
(``bench/results/search-2.5bpv.yaml``) at each history x batch: the decode attention of all 30
layers (one kernel call per layer on the filled cache; SDPA over the DynamicCache's tensors) and
a whole decode step of the model (``kvplan.load(model, plan, attention="triton")``; the
DynamicCache step includes its ``torch.cat`` of the history). Histories are random K/V states
fed to the caches' ``update`` (what a prefill does to a cache). One cell per kvplan config also
reports the max difference of the Triton kernel to the PyTorch reference attention computed on
CPU copies of the same packed layer. ``--cpu-smoke`` runs it with tiny shapes on CPU under
``TRITON_INTERPRET=1`` (timings meaningless).
"""

from __future__ import annotations

import argparse
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

from _stamp import command, commit  # noqa: E402

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


# ----------------------------------------------------------------------------- whole-model decode steps
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=True)
SEARCHED = ROOT / "bench" / "results" / "search-2.5bpv.yaml"
STEP_CONFIGS = ["sdpa", "int4", "int2", "k4v2", "searched"]


def random_model(device, dtype, max_positions: int):
    """``LlamaForCausalLM`` with SmolLM2-135M's config and random weights (seed 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**SMOLLM2, max_position_embeddings=max_positions)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def _plan(name, model):
    from kvplan.runtime.load import resolve_plan

    return resolve_plan(str(SEARCHED) if name == "searched" else name, model)


def _filled_cache(name, model, T, B, dtype, device):
    """A cache of ``name`` holding a random T-token history in every layer (seeded per layer)."""
    import kvplan
    from transformers import DynamicCache

    from kvplan.plans import layout_labels

    if name == "sdpa":
        kvplan.unload(model)
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=model.config)
    else:
        plan = _plan(name, model)
        # the fused attention set up by a baseline plan (kvplan.load refuses the searched plan's
        # "doc" modality for a model whose prompts it would label "text"); the cache takes the plan
        kvplan.load(model, "int2", attention="triton")
        cache = kvplan.KVPlanCache(plan, model, attention_kernel=model._kvplan_attention_kernel)
        if len(plan.modalities) > 1:  # the searched plan: its reference layout (text header, doc bulk)
            cache.assign_labels(layout_labels(T, plan.reference.modality_mix))
    Hkv, D = SMOLLM2["num_key_value_heads"], SMOLLM2["head_dim"]
    for i in range(SMOLLM2["num_hidden_layers"]):
        g = torch.Generator(device=device).manual_seed(1000 + i)
        k = torch.randn(B, Hkv, T, D, generator=g, device=device).to(dtype)
        v = torch.randn(B, Hkv, T, D, generator=g, device=device).to(dtype)
        cache.update(k, v, i)
    return cache


def _attention_all_layers(name, cache, q):
    """One decode-attention call per layer over the filled cache: ``q [B, Hq, 1, D]``."""
    import torch.nn.functional as F

    if name == "sdpa":
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        return lambda: [F.scaled_dot_product_attention(q, k, v, enable_gqa=True) for k, v in layers]
    kernel = cache.attention_kernel
    calls = [([s.blocks for s in lay.segments["k"]], [s.blocks for s in lay.segments["v"]], lay.residual["k"].read(),
              lay.residual["v"].read()) for lay in cache.layers]
    return lambda: [kernel(q, kb, vb, kr, vr) for kb, vb, kr, vr in calls]


def _streamed_positions_hidden(lay, B: int, Hq: int) -> torch.Tensor | None:
    """bool ``[B, Hq, 1, T_total]`` (True = attend) hiding, from the query heads of each streamed KV head, the
    segment positions its blocks store nothing for (``bits`` 0), as the kernel skips them; ``None`` when no
    block is streamed. Positions run as the reference assembles them: the segments in order, then the residual."""
    from kvplan.plans import STREAMED

    segments = lay.segments["k"]
    total = sum(seg.length for seg in segments) + lay.residual["k"].length
    n_rep = Hq // SMOLLM2["num_key_value_heads"]
    mask, start = torch.ones(B, Hq, 1, total, dtype=torch.bool), 0
    for seg in segments:
        for block in seg.blocks:
            if block.bits == STREAMED:
                for h in block.heads:
                    mask[:, h * n_rep:(h + 1) * n_rep, :, start:start + seg.length] = False
        start += seg.length
    return None if bool(mask.all()) else mask


def _reference_diff(cache, q) -> float:
    """Max |Triton - reference| of layer 0's decode attention over its packed segments and residual; the
    reference (PyTorch dequantize + softmax attention) runs on CPU copies of the packed blocks, with the
    streamed heads' unstored positions hidden as the kernel skips them (a streamed head's window copies and
    sink are the deployed attention's, ``kvplan.runtime.fused``, and not in this raw kernel call)."""
    from kvplan.kernels.attention_reference import reference_decode_attention
    from tests.kernels.attention_cases import on_device

    lay = cache.layers[0]
    kb, vb = [s.blocks for s in lay.segments["k"]], [s.blocks for s in lay.segments["v"]]
    out = cache.attention_kernel(q, kb, vb, lay.residual["k"].read(), lay.residual["v"].read())
    ref = reference_decode_attention(q.cpu(), on_device(kb, "cpu"), on_device(vb, "cpu"),
                                     lay.residual["k"].read().cpu(), lay.residual["v"].read().cpu(),
                                     attn_mask=_streamed_positions_hidden(lay, q.shape[0], q.shape[1]))
    return (out.float().cpu() - ref.float()).abs().max().item()


def step_rows(cells, configs, iters, steps, device, dtype, warmup: int = 1, on_row=None) -> list[dict]:
    """The rows of the table; ``on_row(rows)`` after each (the table is rewritten as it grows, so a
    run cut short by its time limit keeps what it measured)."""
    model = random_model(device, dtype, max(T for T, _ in cells) + steps + 64)
    Hq, D = SMOLLM2["num_attention_heads"], SMOLLM2["head_dim"]
    rows = []
    for T, B in cells:
        g = torch.Generator(device=device).manual_seed(T + B)
        q = torch.randn(B, Hq, 1, D, generator=g, device=device).to(dtype)
        tok = torch.randint(0, SMOLLM2["vocab_size"], (B, 1), generator=g, device=device)
        for name in configs:
            t0 = time.perf_counter()
            cache = _filled_cache(name, model, T, B, dtype, device)
            fill_s = time.perf_counter() - t0
            row = dict(T=T, B=B, config=name, fill_s=fill_s, cache_mb=_cache_bytes(cache) / 2**20)
            row["attn_ms"] = _time(_attention_all_layers(name, cache, q), iters, warmup, device) * 1e3
            if name != "sdpa" and (T, B) == cells[0]:
                row["ref_diff"] = _reference_diff(cache, q)
            pos = [T]

            def step():
                p = torch.full((B, 1), pos[0], device=device, dtype=torch.long)
                with torch.no_grad():
                    model(input_ids=tok, cache=cache, position_ids=p, use_cache=True, logits_to_keep=1)
                pos[0] += 1

            row["step_ms"] = _time(step, steps, warmup, device) * 1e3
            rows.append(row)
            if on_row is not None:
                on_row(rows)
            print(f"  T={T} B={B} {name}: attention {row['attn_ms']:.2f} ms, step {row['step_ms']:.2f} ms"
                  + (f", |triton - reference| {row['ref_diff']:.2e}" if "ref_diff" in row else ""), flush=True)
            del cache
            if device.type == "cuda":
                torch.cuda.empty_cache()
    import kvplan

    kvplan.unload(model)
    return rows


def _cache_bytes(cache) -> int:
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def step_table(rows, meta: dict) -> str:
    lines = [f"# Decode on {meta['device']}", "",
             f"Commit `{meta['commit']}`; command `{meta['command']}`; {meta['date']}; torch {meta['torch']}, "
             f"triton {meta['triton']}, dtype {meta['dtype']}.", "",
             "Random-weight model of SmolLM2-135M's config (30 layers, Hq=9, Hkv=3, D=64); random K/V histories. "
             "`attention`: decode attention of all 30 layers (one call per layer, median of "
             f"{meta['iters']}); `step`: one whole decode step of the model (median of {meta['steps']} consecutive "
             "steps; kvplan through `kvplan.load(..., attention='triton')`, sdpa on a DynamicCache). "
             "Ratios against sdpa of the same cell.", ""]
    if meta.get("tests"):
        lines += [f"Kernel tests on this device (`{meta['tests_command']}`): {meta['tests']}", ""]
    lines += ["| T | B | config | cache MiB | attention ms | x sdpa | step ms | x sdpa | x int2 (step) | |triton - ref| |",
              "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    base = {(r["T"], r["B"]): r for r in rows if r["config"] == "sdpa"}
    int2 = {(r["T"], r["B"]): r for r in rows if r["config"] == "int2"}
    for r in rows:
        b, i2 = base.get((r["T"], r["B"])), int2.get((r["T"], r["B"]))
        ra = f"{r['attn_ms'] / b['attn_ms']:.2f}x" if b else ""
        rs = f"{r['step_ms'] / b['step_ms']:.2f}x" if b else ""
        ri = f"{r['step_ms'] / i2['step_ms']:.2f}x" if i2 else ""
        diff = f"{r['ref_diff']:.1e}" if "ref_diff" in r else ""
        lines.append(f"| {r['T']} | {r['B']} | {r['config']} | {r['cache_mb']:.1f} | {r['attn_ms']:.2f} | {ra} | "
                     f"{r['step_ms']:.2f} | {rs} | {ri} | {diff} |")
    return "\n".join(lines) + "\n"


def run_step_table(args) -> int:
    import triton

    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, dtype, name = torch.device("cpu"), torch.float32, "CPU (Triton interpreter; timings meaningless)"
        cells, iters, steps = [(160, 2)], 1, 1  # 30 layers under the interpreter: ~1 min per config
    else:
        if not torch.cuda.is_available():
            print("No CUDA GPU is available: --step-table needs one (or --cpu-smoke). Nothing measured.")
            return 1
        device, dtype, name = torch.device("cuda"), torch.float16, torch.cuda.get_device_name()
        cells = [(T, B) for T in args.contexts for B in args.batches]
        iters, steps = args.iters, args.steps
    meta = dict(device=name, commit=commit(), command=args.command or command(),
                date=time.strftime("%Y-%m-%d %H:%M"), torch=torch.__version__, triton=triton.__version__,
                dtype=str(dtype).split(".")[1], iters=iters, steps=steps, tests=args.tests,
                tests_command=args.tests_command)
    out = None
    if not args.cpu_smoke:
        slug = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()
        out = args.out or ROOT / "bench" / "results" / f"gpu-{slug}.md"
        out.parent.mkdir(parents=True, exist_ok=True)

    def write(rows):
        if out is not None:
            out.write_text(step_table(rows, meta) + ("" if len(rows) == len(cells) * len(args.configs) else
                                                     f"\n(incomplete: {len(rows)} of {len(cells) * len(args.configs)} rows)\n"))

    rows = step_rows(cells, args.configs, iters, steps, device, dtype, warmup=0 if args.cpu_smoke else 1,
                     on_row=write)
    print(step_table(rows, meta))
    if out is not None:
        print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="markdown file (default bench/results/kernels-<gpu>.md)")
    ap.add_argument("--smoke-cpu", action="store_true", help="tiny run on CPU under TRITON_INTERPRET=1; writes nothing")
    ap.add_argument("--step-table", action="store_true", help="30-layer decode attention + decode step table")
    ap.add_argument("--cpu-smoke", action="store_true", help="--step-table on CPU, tiny shapes, TRITON_INTERPRET=1")
    ap.add_argument("--configs", nargs="+", default=STEP_CONFIGS, help="--step-table configs")
    ap.add_argument("--steps", type=int, default=8, help="--step-table: decode steps per cell")
    ap.add_argument("--tests", default="", help="--step-table: the kernel-test summary to stamp into the table")
    ap.add_argument("--tests-command", default="", help="--step-table: the command that produced --tests")
    ap.add_argument("--command", default="", help="--step-table: the command to stamp (bench/gpu.sh passes its own)")
    args = ap.parse_args(argv)
    if args.step_table or args.cpu_smoke:
        return run_step_table(args)

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
