"""Runtime benchmark: cache memory and decode speed of kvplan against transformers' caches.

    python bench/runtime.py                       # default (CPU-feasible) grid
    python bench/runtime.py --full                # 1k/4k/16k x batch 1/8 decode, prefill 1k/4k x 1/8
    python bench/runtime.py --plan-file plan.yaml # add a searched plan

On the embedded default model (SmolLM2-135M, fp32 on CPU) it measures, for each cache:

* ``dynamic-fp32`` / ``dynamic-fp16``: transformers ``DynamicCache`` (the fp16 one runs the
  model in fp16);
* ``quanto-int{4,2}`` / ``hqq-int{4,2}``: transformers ``QuantizedCache`` (defaults: group
  64, residual 128), as far as the backends install;
* ``kvplan-int4`` / ``kvplan-int2`` / ``kvplan-k4v2`` (and ``plan:<file>`` for each ``--plan-file``):
  :class:`kvplan.KVPlanCache` with the decode attention ``kvplan.load`` picks
  (``--kvplan-attention auto``: the chunked PyTorch kernel on CPU, Triton on CUDA;
  ``dequantize``: dequantize the history, then the model's SDPA). Other configs run the
  model's SDPA; the attention implementation is switched per config before it is timed;
* ``kvplan-…@fp16`` (prefill only, CPU): the same kvplan plans on the fp16 copy of the model,
  so that prefill memory compares with ``dynamic-fp16`` at the same activation dtype;

**decode** (per history length T and batch B): cache bytes (peak over the run), bytes per
token, honest bits per value, and latency of one decode step. The history is filled
once per T with a real ``DynamicCache`` prefill of B=1 (text from ``pydoc_data``); its
per-layer key/value states are fed to every cache's ``update`` (what a prefill does to a
cache), repeated along the batch for B>1 (rows are identical; the work per step is not
data dependent); a plan with heavy-hitter copies chooses them with that prefill's last 32 queries
per layer, as kvplan's attention function does in a prompt's forward. Configs are then timed
*interleaved*: ``--rounds`` rounds, each running ``--steps`` consecutive decode steps of every
config in a rotating order; the reported
latency is the median over all steps (the mean, which includes periodic commits and
re-quantizations, is in the JSON). The history grows by ``rounds * steps`` tokens during
the measurement. Ratios are against ``dynamic-fp32`` measured in the same run.

**prefill** (per T and B in ``--prefill-cells``): one child process per config and repeat
(repeats interleaved across configs) loads the model, runs a warm-up, returns freed memory
to the OS (``malloc_trim``), resets the peak RSS (``/proc/self/clear_refs``), runs one
prefill with ``logits_to_keep=1`` (as ``generate`` does) and reports wall time, the peak
RSS (``VmHWM``) and the peak above the RSS just before the prefill. On CUDA the peak is
``torch.cuda.max_memory_allocated`` in the main process instead.

Also checked: kvplan's measured ``cache.bpv()`` against its plan's prediction
``plan.bpv(context_len=T, modality_mix=<history labels>, full_precision_bits=<model dtype bits>)``,
where the history is labelled by the plan's reference layout scaled to T (all ``text`` for
single-modality plans; a plan searched on the default task gets its text header + ``doc`` bulk).

Writes ``bench/results/runtime-<device>.md`` and ``.json``. Cells that were not run are
listed with the reason; no number is estimated.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from _stamp import command, commit  # noqa: E402

QUANTIZED = [("quanto", 4), ("quanto", 2), ("hqq", 4), ("hqq", 2)]
KVPLAN_BASELINES = ["int4", "int2", "k4v2"]
REFERENCE = "dynamic-fp32"
FP16_SUFFIX = "@fp16"  # a kvplan config run on the fp16 copy of the model (prefill memory only)


# ----------------------------------------------------------------------------- configs
def config_names(plan_files: list[str], skip: dict) -> list[str]:
    names = ["dynamic-fp32", "dynamic-fp16"]
    for backend, nbits in QUANTIZED:
        name = f"{backend}-int{nbits}"
        if not backend_available(backend):
            skip[name] = f"backend {backend!r} does not import (pip install hqq optimum-quanto)"
            continue
        names.append(name)
    kvplan_names = [f"kvplan-{b}" for b in KVPLAN_BASELINES] + ["plan:" + f for f in plan_files]
    # prefill only (CPU): the same plans on the fp16 model, compared with the fp16 model's DynamicCache
    return names + kvplan_names + [n + FP16_SUFFIX for n in kvplan_names]


def backend_available(backend: str) -> bool:
    try:
        if backend == "quanto":
            import optimum.quanto  # noqa: F401
        else:
            import hqq  # noqa: F401
    except Exception:
        return False
    return True


def config_dtype(name: str, base_dtype: torch.dtype) -> torch.dtype:
    return torch.float16 if name == "dynamic-fp16" or name.endswith(FP16_SUFFIX) else base_dtype


def config_bits(name: str) -> str:
    name = name.removesuffix(FP16_SUFFIX)
    if name.startswith("dynamic"):
        return name.split("-fp")[1]
    if name.startswith("plan:"):
        return "plan"
    return name.split("-")[1]


def load_plan(name: str, model):
    from kvplan.runtime.load import resolve_plan

    name = name.removesuffix(FP16_SUFFIX)
    return resolve_plan(name[5:] if name.startswith("plan:") else name.split("-", 1)[1], model)


def make_cache(name: str, model, plan=None):
    from transformers import DynamicCache, QuantizedCache

    import kvplan

    if name.startswith("dynamic"):
        return DynamicCache(config=model.config)
    if name.startswith(("quanto", "hqq")):
        backend, bits = name.split("-int")
        return QuantizedCache(backend=backend, config=model.config, nbits=int(bits))
    kernel = getattr(model, "_kvplan_attention_kernel", None)  # set by kvplan.load (decode only)
    return kvplan.KVPlanCache(plan if plan is not None else load_plan(name, model), model, attention_kernel=kernel)


def use_attention(model, name: str) -> None:
    """kvplan configs decode through kvplan.load's attention (when it set one); others the model's SDPA."""
    from kvplan.runtime.fused import ATTENTION_NAME, set_text_attention

    packed = getattr(model, "_kvplan_attention_kernel", None) is not None and name.startswith(("kvplan", "plan:"))
    want = ATTENTION_NAME if packed else "sdpa"
    if model.config._attn_implementation != want:
        set_text_attention(model, want)


# ----------------------------------------------------------------------------- memory accounting
def tensor_bytes(t) -> int:
    """Bytes held by a tensor, looking inside tensor subclasses (quanto's packed tensors)."""
    if isinstance(t, torch.Tensor):
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            inner, _ = t.__tensor_flatten__()
            return sum(tensor_bytes(getattr(t, n)) for n in inner)
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(tensor_bytes(x) for x in t)
    if isinstance(t, dict):
        return sum(tensor_bytes(x) for x in t.values())
    return 0


def cache_bytes(cache) -> int:
    """K/V storage bytes held by any of the benchmarked caches."""
    if hasattr(cache, "nbytes") and callable(cache.nbytes):  # KVPlanCache
        return cache.nbytes()
    total = 0
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True):
            continue
        total += tensor_bytes(getattr(layer, "keys", None)) + tensor_bytes(getattr(layer, "values", None))
        total += tensor_bytes(getattr(layer, "_quantized_keys", None))
        total += tensor_bytes(getattr(layer, "_quantized_values", None))
    return total


def num_values(model, batch: int, tokens: int) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * batch * c.num_hidden_layers * c.num_key_value_heads * tokens * head_dim


# ----------------------------------------------------------------------------- process memory
_LIBC = None


def trim_memory() -> None:
    global _LIBC
    gc.collect()
    try:
        _LIBC = _LIBC or ctypes.CDLL("libc.so.6")
        _LIBC.malloc_trim(0)
    except OSError:
        pass


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ----------------------------------------------------------------------------- model and text
def load(model_dir: str | None, dtype: torch.dtype, device: str):
    if model_dir:  # the weights saved by save_weights (a GGUF-loaded model cannot save_pretrained)
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        state = torch.load(os.path.join(model_dir, "weights.pt"), mmap=True)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or any("lm_head" not in k for k in missing):
            raise RuntimeError(f"weights do not match the model: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
        del state
        torch.set_grad_enabled(False)
        return model.eval().to(device), None
    from kvplan.models.loading import load_model

    model, tok = load_model(dtype=dtype, device=device)
    return model, tok


def save_weights(model, folder: str) -> None:
    config = model.config
    had = getattr(config, "quantization_config", None)
    if had is not None:
        del config.quantization_config
    try:
        config.save_pretrained(folder)
    finally:
        if had is not None:
            config.quantization_config = had
    torch.save(model.state_dict(), os.path.join(folder, "weights.pt"))


def text_ids(tokenizer, n: int) -> torch.Tensor:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    while ids.numel() < n:
        ids = torch.cat([ids, ids])
    return ids[:n]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- prefill child
def prefill_child(spec: dict) -> dict:
    """Runs in a fresh process: one config, the prefill cells in order."""
    torch.set_num_threads(spec["threads"])
    name = spec["config"]
    dtype = getattr(torch, spec["dtype"])
    model, _ = load(spec["model_dir"], dtype, "cpu")
    ids_all = torch.load(spec["ids"])
    plan = None if name.startswith(("dynamic", "quanto", "hqq")) else load_plan(name, model)
    if plan is not None:  # the model as kvplan.load leaves it (its attention and mask functions)
        import kvplan

        kvplan.load(model, plan, attention=spec["kvplan_attention"])
    warm = ids_all[:64].unsqueeze(0)
    model(input_ids=warm, cache=make_cache(name, model, plan), logits_to_keep=1)
    out = []
    for T, B in spec["cells"]:
        ids = ids_all[:T].unsqueeze(0).repeat(B, 1)
        cache = make_cache(name, model, plan)
        trim_memory()
        rss0 = _status_kb("VmRSS")
        ok = reset_peak_rss()
        t0 = time.perf_counter()
        model(input_ids=ids, cache=cache, logits_to_keep=1)
        dt = time.perf_counter() - t0
        hwm = _status_kb("VmHWM")
        out.append({"T": T, "B": B, "prefill_s": dt, "rss_before_mib": rss0 / 1024, "peak_rss_mib": hwm / 1024,
                    "peak_above_before_mib": (hwm - rss0) / 1024 if ok else None, "peak_reset": ok,
                    "cache_bytes": cache_bytes(cache)})
        del cache, ids
    return {"config": name, "cells": out}


def run_prefill(args, names, model_dir, ids_path, dtype, skip) -> dict:
    """Per config and repeat, a child process; repeats interleaved across configs."""
    results: dict = {n: [] for n in names}
    cells = args.prefill_cells
    for r in range(args.prefill_repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            spec = {"config": name, "threads": args.threads, "dtype": str(config_dtype(name, dtype)).split(".")[1],
                    "model_dir": model_dir, "ids": ids_path, "cells": cells,
                    "kvplan_attention": args.kvplan_attention}
            t0 = time.time()
            env = dict(os.environ)
            if args.mmap_threshold:  # glibc: tensors above this size are mmapped and go back to the OS when freed
                env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
            proc = subprocess.run([sys.executable, __file__, "--_child", json.dumps(spec)], capture_output=True,
                                  text=True, env=env)
            if proc.returncode != 0:
                msg = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
                skip[f"prefill {name}"] = f"child failed: {msg}"
                print(f"  prefill {name}: FAILED {msg}", flush=True)
                continue
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            results[name].append(res["cells"])
            print(f"  prefill round {r} {name}: " + ", ".join(
                f"{c['T']}x{c['B']} {c['prefill_s']:.2f}s peak+{c['peak_above_before_mib']:.0f}MiB"
                for c in res["cells"]) + f" ({time.time() - t0:.0f}s)", flush=True)
    summary = {}
    for name, reps in results.items():
        for i, (T, B) in enumerate(cells):
            runs = [rep[i] for rep in reps]
            if not runs:
                continue
            summary[f"{name}|{T}|{B}"] = {
                "config": name, "T": T, "B": B, "repeats": len(runs),
                "prefill_s": statistics.median(x["prefill_s"] for x in runs),
                "prefill_s_all": [x["prefill_s"] for x in runs],
                "peak_rss_mib": statistics.median(x["peak_rss_mib"] for x in runs),
                "peak_above_before_mib": statistics.median(x["peak_above_before_mib"] for x in runs)
                if all(x["peak_above_before_mib"] is not None for x in runs) else None,
                "cache_bytes": runs[0]["cache_bytes"],
            }
    return summary


def run_prefill_cuda(args, names, model, ids_all, plans) -> dict:
    summary = {}
    for T, B in args.prefill_cells:
        ids = ids_all[:T].unsqueeze(0).repeat(B, 1).to(args.device)
        times: dict = {n: [] for n in names}
        peaks: dict = {n: [] for n in names}
        for r in range(args.prefill_repeats + 1):
            for name in names[r % len(names):] + names[: r % len(names)]:
                m = model if name != "dynamic-fp16" else plans["__fp16_model"]
                use_attention(m, name)
                cache = make_cache(name, m, plans.get(name))
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                sync(args.device)
                t0 = time.perf_counter()
                m(input_ids=ids, cache=cache, logits_to_keep=1)
                sync(args.device)
                if r:  # round 0 is warm-up
                    times[name].append(time.perf_counter() - t0)
                    peaks[name].append((torch.cuda.max_memory_allocated() - base) / 2**20)
                del cache
        for name in names:
            summary[f"{name}|{T}|{B}"] = {"config": name, "T": T, "B": B, "repeats": len(times[name]),
                                          "prefill_s": statistics.median(times[name]), "prefill_s_all": times[name],
                                          "peak_rss_mib": None,
                                          "peak_above_before_mib": statistics.median(peaks[name])}
    return summary


# ----------------------------------------------------------------------------- decode
def fill_states(model, ids: torch.Tensor):
    """Per-layer ``(keys, values [1, H_kv, T, D], window queries)`` of a real DynamicCache prefill (the
    model's SDPA): the window queries are each layer's last 32 queries and scaling, with which a plan's
    heavy-hitter copies are chosen (what kvplan's attention function does at a deployed prompt)."""
    from transformers import DynamicCache

    from kvplan.runtime.heavy import recording_window_queries

    use_attention(model, REFERENCE)  # the model's own SDPA
    cache, queries = DynamicCache(config=model.config), {}
    with recording_window_queries(model, queries):
        model(input_ids=ids.unsqueeze(0).to(model.device), cache=cache, logits_to_keep=1)
    return [(layer.keys, layer.values, queries.get(i)) for i, layer in enumerate(cache.layers)]


def history_labels(plan, T: int) -> list[str]:
    """Modality labels of a T-token history: the plan's reference layout scaled to T (a plan
    searched on the default task stores its bulk ``doc`` history at doc bits), or all text."""
    from kvplan.plans import layout_labels

    if len(plan.modalities) == 1:
        return [plan.modalities[0]] * T
    return layout_labels(T, plan.reference.modality_mix)


def fill(cache, states, batch: int, dtype):
    """Write the prefill states into ``cache`` (every layer's ``update``, as a prefill does); a kvplan
    layer keeping heavy-hitter copies scores its tokens with the recorded queries, as kvplan's attention
    function does in the prompt's forward (the search's harness does the same)."""
    for i, (k, v, window) in enumerate(states):
        if batch > 1:
            k, v = k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1)
        k, v = k.to(dtype).contiguous(), v.to(dtype).contiguous()
        cache.update(k, v, i)
        observe = getattr(cache.layers[i], "observe_prompt", None)  # kvplan layers (a no-op without copies)
        if observe is not None:
            query, scaling, mask = window
            observe(query.expand(batch, -1, -1, -1).to(dtype), k, scaling, mask)
    return cache


def run_decode(args, names, models, states, T, B, plans) -> dict:
    device = args.device
    caches, bytes_seen, rows, times = {}, {}, {}, {n: [] for n in names}
    labels = {name: history_labels(plan, T) for name, plan in plans.items()}
    for name in names:
        model = models[name]
        use_attention(model, name)  # a plan that streams KV heads needs kvplan's attention to make its cache
        cache = make_cache(name, model, plans.get(name))
        if name in plans:
            cache.assign_labels(labels[name])
        caches[name] = fill(cache, states, B, model.dtype)
        bytes_seen[name] = [(T, cache_bytes(caches[name]))]
        rows[name] = {}
        if name in plans:  # target (a): measured bpv right after filling vs the plan's prediction
            fp_bits = 32 if model.dtype == torch.float32 else 16
            rows[name]["bpv_check"] = {"T": T, "measured": caches[name].bpv(),
                                       "predicted": plans[name].bpv(context_len=T, modality_mix=labels[name],
                                                                    full_precision_bits=fp_bits).total}
    tok = torch.full((B, 1), 504, dtype=torch.long, device=device)
    # warm-up: one step each, not timed
    for name in names:
        use_attention(models[name], name)
        models[name](input_ids=tok, cache=caches[name], logits_to_keep=1)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            model, cache = models[name], caches[name]
            use_attention(model, name)
            for _ in range(args.steps):
                sync(device)
                t0 = time.perf_counter()
                model(input_ids=tok, cache=cache, logits_to_keep=1)
                sync(device)
                times[name].append(time.perf_counter() - t0)
            bytes_seen[name].append((cache.get_seq_length(), cache_bytes(cache)))
    out = {}
    for name in names:
        peak_t, peak_b = max(bytes_seen[name], key=lambda x: x[1])
        t_end = caches[name].get_seq_length()
        end_bytes = bytes_seen[name][-1][1]
        row = {"config": name, "T": T, "B": B, "steps": len(times[name]),
               "decode_ms": 1e3 * statistics.median(times[name]),
               "decode_ms_mean": 1e3 * statistics.fmean(times[name]),
               "decode_ms_all": [1e3 * t for t in times[name]],
               "peak_cache_bytes": peak_b, "peak_at_tokens": peak_t,
               "bytes_per_token": peak_b / (B * peak_t),
               "bpv": 8 * end_bytes / num_values(models[name], B, t_end), "bpv_at_tokens": t_end,
               **rows[name]}
        if name in plans:
            fp_bits = 32 if models[name].dtype == torch.float32 else 16
            generated = ["text"] * (t_end - T)  # decoded tokens are text
            row["bpv_check_end"] = {"T": t_end, "measured": caches[name].bpv(),
                                    "predicted": plans[name].bpv(context_len=t_end,
                                                                 modality_mix=labels[name] + generated,
                                                                 full_precision_bits=fp_bits).total}
        out[f"{name}|{T}|{B}"] = row
    del caches
    trim_memory()
    return out


# ----------------------------------------------------------------------------- report
def fmt(x, spec=".2f"):
    return "—" if x is None else format(x, spec)


def render(meta, decode, prefill, skip, targets) -> str:
    L = [f"# Runtime benchmark ({meta['device']})", "",
         f"Command: `{meta['command']}` at commit {meta.get('commit', '?')}", "",
         f"{meta['model']}, {meta['dtype']}, torch {meta['torch']}, transformers {meta['transformers']}, "
         f"{meta['threads']} torch thread(s), {meta['cpu']}; {meta['date']}. Host load average at start: "
         f"{meta['loadavg']}.", "",
         f"kvplan decode attention: `{meta.get('kvplan_attention_kernel')}` "
         f"(`--kvplan-attention {meta.get('kvplan_attention')}`); prefill always dequantizes and runs SDPA.", "",
         "Ratios are against `dynamic-fp32` (DynamicCache, the model's own dtype) measured in the same run, "
         f"interleaved. Decode: median of {meta['rounds']}×{meta['steps']} steps per config. ", ""]
    L += ["## Decode", "",
          "| T | B | config | bits | peak cache MiB | bytes/token | bpv | decode ms/step | × dyn-fp32 | mean ms | "
          "× dyn-fp32 (mean) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, row in decode.items():
        ref = decode.get(f"{REFERENCE}|{row['T']}|{row['B']}")
        ratio = row["decode_ms"] / ref["decode_ms"] if ref else None
        ratio_m = row["decode_ms_mean"] / ref["decode_ms_mean"] if ref else None
        L.append(f"| {row['T']} | {row['B']} | {row['config']} | {config_bits(row['config'])} | "
                 f"{row['peak_cache_bytes'] / 2**20:.1f} | {row['bytes_per_token']:.0f} | {row['bpv']:.2f} | "
                 f"{row['decode_ms']:.1f} | {fmt(ratio)} | {row['decode_ms_mean']:.1f} | {fmt(ratio_m)} |")
    L += ["", "## Prefill", "",
          "| T | B | config | prefill s | × dyn-fp32 | peak above pre-prefill MiB | peak RSS MiB | cache MiB after |",
          "|---|---|---|---|---|---|---|---|"]
    for key, row in prefill.items():
        ref = prefill.get(f"{REFERENCE}|{row['T']}|{row['B']}")
        ratio = row["prefill_s"] / ref["prefill_s"] if ref else None
        cb = row.get("cache_bytes")
        L.append(f"| {row['T']} | {row['B']} | {row['config']} | {row['prefill_s']:.2f} | {fmt(ratio)} | "
                 f"{fmt(row['peak_above_before_mib'], '.0f')} | {fmt(row['peak_rss_mib'], '.0f')} | "
                 f"{fmt(None if cb is None else cb / 2**20, '.1f')} |")
    L += ["", "## Targets", ""] + [f"- {t}" for t in targets]
    L += ["", "## Not run", ""] + ([f"- {k}: {v}" for k, v in skip.items()] or ["- nothing"])
    return "\n".join(L) + "\n"


def check_targets(decode, prefill) -> list[str]:
    out = []
    # (a) bpv
    for row in decode.values():
        for key in ("bpv_check", "bpv_check_end"):
            c = row.get(key)
            if c:
                ok = abs(c["measured"] - c["predicted"]) < 1e-9
                out.append(f"(a) {'MET' if ok else 'MISSED'}: {row['config']} B={row['B']} at {c['T']} tokens: "
                           f"measured bpv {c['measured']:.6f}, plan predicts {c['predicted']:.6f}")
    # (b) decode speed at 4k
    for row in decode.values():
        if row["T"] != 4096 or not row["config"].startswith(("kvplan", "plan:")):
            continue
        ref = decode.get(f"{REFERENCE}|4096|{row['B']}")
        if not ref:
            continue
        r = row["decode_ms"] / ref["decode_ms"]
        bits = config_bits(row["config"])
        peers = [p for k, p in decode.items() if p["T"] == 4096 and p["B"] == row["B"]
                 and p["config"].startswith(("quanto", "hqq")) and config_bits(p["config"]) == bits]
        peer_txt = ", ".join(f"{p['config']} {p['decode_ms']:.1f} ms" for p in peers) or "no peer at these bits"
        faster = all(row["decode_ms"] < p["decode_ms"] for p in peers) if peers else None
        out.append(f"(b) {'MET' if r <= 1.5 and faster is not False else 'MISSED'}: {row['config']} B={row['B']} "
                   f"4k: {row['decode_ms']:.1f} ms/step = {r:.2f}× dynamic-fp32 ({ref['decode_ms']:.1f} ms; "
                   f"limit 1.5×); peers at equal bits: {peer_txt}")
    # (c) prefill peak memory
    for row in prefill.values():
        if not row["config"].startswith(("kvplan", "plan:")):
            continue
        # same model dtype first (the fp16 model's kvplan vs its DynamicCache), then fp32 kvplan vs fp16
        refs = ("dynamic-fp16",) if row["config"].endswith(FP16_SUFFIX) else ("dynamic-fp32", "dynamic-fp16")
        for refname in refs:
            ref = prefill.get(f"{refname}|{row['T']}|{row['B']}")
            if not ref or row["peak_above_before_mib"] is None or ref["peak_above_before_mib"] is None:
                continue
            ok = row["peak_above_before_mib"] <= ref["peak_above_before_mib"]
            out.append(f"(c) {'MET' if ok else 'MISSED'}: {row['config']} prefill {row['T']}x{row['B']}: peak "
                       f"+{row['peak_above_before_mib']:.0f} MiB vs {refname} +{ref['peak_above_before_mib']:.0f} MiB")
    return out


def parse_cells(text: str) -> list[tuple[int, int]]:
    cells = []
    for part in text.split(","):
        if part.strip():
            t, b = part.lower().split("x")
            cells.append((int(t), int(b)))
    return cells


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096], help="decode history lengths")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--decode-cells", type=parse_cells, default=None,
                   help="decode cells TxB, comma separated (instead of the --contexts x --batches grid; \"\": none)")
    p.add_argument("--prefill-cells", type=parse_cells, default="1024x1,4096x1",
                   help="prefill cells TxB, comma separated (each runs once per config and repeat)")
    p.add_argument("--prefill-repeats", type=int, default=2)
    p.add_argument("--mmap-threshold", type=int, default=0,
                   help="set glibc's MALLOC_MMAP_THRESHOLD_ (bytes) in the prefill children, so freed tensors leave "
                        "RSS at once and the peak RSS tracks live tensors rather than allocator retention")
    p.add_argument("--rounds", type=int, default=5, help="interleaved decode rounds")
    p.add_argument("--steps", type=int, default=4, help="consecutive decode steps per config per round")
    p.add_argument("--full", action="store_true", help="full grid: decode 1k/4k/16k x 1/8, prefill 1k/4k x 1/8")
    p.add_argument("--configs", nargs="+", help="only these configs (names as in the table)")
    p.add_argument("--kvplan-attention", default="auto", choices=["auto", "native", "chunked", "triton", "dequantize"],
                   help="decode attention of the kvplan configs, as kvplan.load(..., attention=...)")
    p.add_argument("--plan-file", action="append", default=[],
                   help="a searched plan file (YAML) to add (repeat for several)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="torch intra-op threads (1 is steadier on a shared CPU)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--_child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    global REFERENCE
    if args._child:
        print(json.dumps(prefill_child(json.loads(args._child))))
        return 0
    if args.full:
        args.contexts, args.batches = [1024, 4096, 16384], [1, 8]
        args.prefill_cells = [(1024, 1), (1024, 8), (4096, 1), (4096, 8)]
    torch.set_num_threads(args.threads)
    import transformers

    skip: dict = {}
    names = config_names(args.plan_file, skip)
    if args.configs:
        names = [n for n in names if n.removesuffix(FP16_SUFFIX) in args.configs or n.startswith("dynamic")]
    is_cuda = args.device.startswith("cuda")
    prefill_names = [n for n in names if not (is_cuda and n.endswith(FP16_SUFFIX))]  # CUDA: the model is fp16
    names = [n for n in names if not n.endswith(FP16_SUFFIX)]
    dtype = torch.float16 if is_cuda else torch.float32
    if is_cuda:  # the model runs in fp16 there: its DynamicCache is the reference
        names = [n for n in names if n != "dynamic-fp32"]
        REFERENCE = "dynamic-fp16"
    print(f"configs: {names}", flush=True)
    model, tok = load(None, dtype, args.device)
    models = {n: model for n in names}
    fp16_model = model if is_cuda else None
    if "dynamic-fp16" in names and not is_cuda:
        import copy

        fp16_model = copy.deepcopy(model).to(torch.float16)
        models["dynamic-fp16"] = fp16_model
    plans = {n: load_plan(n, model) for n in names if n.startswith(("kvplan", "plan:"))}
    if plans:  # sets the decode attention kernel kvplan configs use (use_attention switches per config)
        import kvplan

        kvplan.load(model, next(iter(plans.values())), attention=args.kvplan_attention)
    decode_cells = (args.decode_cells if args.decode_cells is not None  # "": no decode (a prefill-only run)
                    else [(T, B) for T in args.contexts for B in args.batches])
    max_t = max([t for t, _ in decode_cells] + [t for t, _ in args.prefill_cells])
    ids_all = text_ids(tok, max_t)
    meta = {"commit": commit(),
            "device": args.device if not is_cuda else torch.cuda.get_device_name(),
            "command": command(None if argv is None else [__file__, *argv]),
            "model": "SmolLM2-135M-Instruct (embedded)", "dtype": str(dtype).split(".")[1],
            "torch": torch.__version__, "transformers": transformers.__version__, "threads": args.threads,
            "cpu": f"{os.cpu_count()} CPUs ({platform.machine()})", "loadavg": os.getloadavg()[0],
            "date": time.strftime("%Y-%m-%d %H:%M"), "rounds": args.rounds, "steps": args.steps,
            "kvplan_attention": args.kvplan_attention if plans else None,
            "kvplan_attention_kernel": getattr(getattr(model, "_kvplan_attention_kernel", None), "__name__",
                                               "dequantize-then-SDPA")}

    # ---------------------------------------------------------------- prefill / peak memory
    prefill: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.prefill_cells:  # decode-only run: no prefill children
            pass
        elif is_cuda:
            plans_and_models = dict(plans, __fp16_model=fp16_model)
            prefill = run_prefill_cuda(args, prefill_names, model, ids_all, plans_and_models)
        else:
            save_weights(model, tmp)
            ids_path = os.path.join(tmp, "ids.pt")
            torch.save(ids_all, ids_path)
            print(f"prefill cells {args.prefill_cells}, {args.prefill_repeats} repeats", flush=True)
            prefill = run_prefill(args, prefill_names, tmp, ids_path, dtype, skip)

    # ---------------------------------------------------------------- decode
    decode = {}
    for T in sorted({t for t, _ in decode_cells}):
        t0 = time.time()
        states = fill_states(model, ids_all[:T])
        print(f"history {T}: DynamicCache prefill for the fill states {time.time() - t0:.1f}s", flush=True)
        for B in [b for t, b in decode_cells if t == T]:
            t0 = time.time()
            try:
                res = run_decode(args, names, models, states, T, B, plans)
            except (MemoryError, RuntimeError) as e:
                skip[f"decode T={T} B={B}"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                print(f"  decode T={T} B={B}: FAILED {e}", flush=True)
                continue
            decode.update(res)
            print(f"  decode T={T} B={B} ({time.time() - t0:.0f}s): " + ", ".join(
                f"{r['config']} {r['decode_ms']:.1f}ms" for r in res.values()), flush=True)
        del states
        trim_memory()
    if not args.full:
        missing = [f"{t}x{b}" for t in (1024, 4096, 16384) for b in (1, 8) if (t, b) not in decode_cells]
        if missing:
            skip[f"decode {','.join(missing)}"] = ("not in this run's grid (default grid keeps the run within "
                                                   "minutes on a 2-core CPU; --full or --decode-cells runs it)")
        missing = [f"{t}x{b}" for t in (1024, 4096) for b in (1, 8) if (t, b) not in args.prefill_cells]
        if missing:
            skip[f"prefill {','.join(missing)}"] = ("not in this run's grid (prefill of T×B tokens per config and "
                                                    "repeat; --full or --prefill-cells runs it)")
    if any(t == 16384 for t, _ in decode_cells) and not is_cuda:
        skip.setdefault("prefill 16384xB", "never run on CPU by this script (one 16k-token prefill per config and "
                        "repeat is too slow on a 2-core CPU); decode at 16k uses one DynamicCache fill prefill")
    targets = check_targets(decode, prefill)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "runtime-" + ("cpu" if not is_cuda else "gpu")
    (out_dir / f"{stem}.json").write_text(json.dumps({"meta": meta, "decode": decode, "prefill": prefill,
                                                      "skipped": skip, "targets": targets}, indent=1))
    md = render(meta, decode, prefill, skip, targets)
    (out_dir / f"{stem}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
