"""Sensitivity landscape: {FP16, INT8, INT4, INT2} x {each modality} x {K, V}.

Each condition quantizes only one (modality, kind) part of the historical cache at one
bit width; every other part stays 16-bit. ``residual_length`` is 0 so the whole history is
quantized apart from the trailing partial group (< ``group_size`` tokens).
"""

from __future__ import annotations

import csv
import io
import json
import os
import time
from typing import Any, Sequence

import numpy as np

from ..models.geometry import Geometry
from ..plans import uniform_plan
from ..plans._files import write_file_set
from .harness import bootstrap_ratio, evaluate

SWEEP_BITS = (16, 8, 4, 2)
CSV_FIELDS = ("condition", "bits", "modality", "kind", "kl", "kl_lo", "kl_hi", "kl_answer", "nll", "nll_fp",
              "delta_nll", "delta_nll_lo", "delta_nll_hi", "top1", "acc", "acc_lo", "acc_hi", "acc_fp",
              "quantized_tokens", "quantized_tokens_per_sample", "bpv", "bpv_measured", "bpv_accounting")


def condition_plan(geometry: Geometry, modalities: Sequence[str], bits: int, modality: str | None, kind: str | None,
                   group_size: int = 32):
    """16-bit everywhere except ``(modality, kind)`` at ``bits`` (residual_length 0)."""
    plan = uniform_plan(geometry, 16, 16, modalities=tuple(modalities), residual_length=0, group_size=group_size)
    if bits == 16 or modality is None:
        return plan.replace(name="fp16")
    t = plan.table()
    t[:, :, 0 if kind == "k" else 1, list(modalities).index(modality)] = bits
    return plan.with_table(t, name=f"int{bits}-{modality}-{kind.upper()}")


def sweep_prepared(model, prepared, modalities: Sequence[str], bits: Sequence[int] = SWEEP_BITS, seed: int = 0,
                   group_size: int = 32, progress: bool = True) -> dict[str, Any]:
    """Run every condition on already prepared samples. Returns ``{"rows": [...], "ratios": {...}, ...}``."""
    from tqdm.auto import tqdm

    g = Geometry.of(model)
    conds = [(16, None, None)] + [(b, m, k) for b in bits if b != 16 for m in modalities for k in ("k", "v")]
    rows, results = [], {}
    bar = tqdm(conds, desc="sweep", disable=not progress)
    for b, m, k in bar:
        plan = condition_plan(g, modalities, b, m, k, group_size)
        bar.set_postfix_str(plan.name)
        expect = [] if b == 16 else [(k, m)]
        r = evaluate(model, plan, prepared, expect_quantized=expect, seed=seed, progress=False)
        results[plan.name] = r
        qt = 0.0 if b == 16 else r["quantized_tokens"].get(k, {}).get(m, 0.0)
        rows.append({
            "condition": plan.name, "bits": b, "modality": m or "all", "kind": (k or "kv").upper(),
            "kl": r["kl"]["mean"], "kl_lo": r["kl"]["ci95"][0], "kl_hi": r["kl"]["ci95"][1],
            "kl_answer": r.get("kl_answer", {}).get("mean"),
            "nll": r["nll"]["mean"], "nll_fp": r["nll_fp"]["mean"],
            "delta_nll": r["delta_nll"]["mean"], "delta_nll_lo": r["delta_nll"]["ci95"][0],
            "delta_nll_hi": r["delta_nll"]["ci95"][1], "top1": r["top1"]["mean"],
            "acc": r.get("acc", {}).get("mean"), "acc_lo": (r.get("acc", {}).get("ci95") or [None])[0],
            "acc_hi": (r.get("acc", {}).get("ci95") or [None, None])[1], "acc_fp": r.get("acc_fp", {}).get("mean"),
            "quantized_tokens": qt, "quantized_tokens_per_sample": qt / max(1, r["n"]),
            "bpv": r["bpv"], "bpv_measured": r["bpv_measured"],
            "bpv_accounting": r.get("bpv_accounting"),
        })
    ratios = {}
    for b in bits:
        if b == 16:
            continue
        for m in modalities:
            kk, vv = results[f"int{b}-{m}-K"], results[f"int{b}-{m}-V"]
            a = [s["kl"] for s in kk["samples"]]
            d = [s["kl"] for s in vv["samples"]]
            est, lo, hi = bootstrap_ratio(a, d, seed=seed)
            ratios[f"int{b}/{m}"] = {"k_over_v": est, "ci95": [lo, hi], "kl_k": float(np.mean(a)),
                                     "kl_v": float(np.mean(d))}
    return {"rows": rows, "ratios": ratios, "results": results}


def write_sweep(out: dict[str, Any], out_dir: str, meta: dict[str, Any]) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = {"csv": os.path.join(out_dir, "sweep.csv"), "json": os.path.join(out_dir, "sweep.json"),
             "png": os.path.join(out_dir, "sweep.png")}
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS)
    w.writeheader()
    for r in out["rows"]:
        w.writerow({k: r.get(k) for k in CSV_FIELDS})
    # the figure drawn first, then CSV, JSON and PNG written as one set: a failure leaves the old set whole,
    # never new data beside an old figure
    png = sweep_png(out["rows"], title=meta.get("title", "KV sensitivity"))
    write_file_set({paths["csv"]: buf.getvalue(), paths["json"]: json.dumps(
        {"meta": meta, "rows": out["rows"], "ratios": out["ratios"], "results": out["results"]}, indent=1,
        default=float), paths["png"]: png})
    return paths


def sweep_png(rows: Sequence[dict], title: str = "") -> bytes:
    """The sweep's figure (KL and NLL change per condition) as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = sorted({(r["modality"], r["kind"]) for r in rows if r["bits"] != 16})
    bits = sorted({r["bits"] for r in rows if r["bits"] != 16}, reverse=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(1, len(parts))
    for j, (m, k) in enumerate(parts):
        sel = [next(r for r in rows if r["bits"] == b and r["modality"] == m and r["kind"] == k) for b in bits]
        x = np.arange(len(bits)) + (j - (len(parts) - 1) / 2) * width
        kl = np.array([max(r["kl"], 1e-9) for r in sel])
        err = np.array([[max(r["kl"] - r["kl_lo"], 0), max(r["kl_hi"] - r["kl"], 0)] for r in sel]).T
        axes[0].bar(x, kl, width, yerr=err, capsize=2, label=f"{m} {k}")
        dn = np.array([r["delta_nll"] for r in sel])
        derr = np.array([[max(r["delta_nll"] - r["delta_nll_lo"], 0), max(r["delta_nll_hi"] - r["delta_nll"], 0)]
                         for r in sel]).T
        axes[1].bar(x, dn, width, yerr=derr, capsize=2, label=f"{m} {k}")
    for ax, lab in ((axes[0], "KL(P_fp || P_q), mean over continuation tokens"), (axes[1], "NLL - NLL_fp (nats)")):
        ax.set_xticks(np.arange(len(bits)))
        ax.set_xticklabels([f"INT{b}" for b in bits])
        ax.set_ylabel(lab)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    return png.getvalue()


def format_layers(geometry: Geometry) -> str:
    """One line naming each layer's type: every sweep condition sets the bits of all layers, and a
    sliding-window layer quantizes (and keeps) only the history its window still needs."""
    types = geometry.layer_types
    if "sliding" not in types:
        return f"layers: {len(types)} full-attention"
    def names(t):
        return " ".join(f"L{i:02d}" for i, x in enumerate(types) if x == t)
    return (f"layers: {types.count('sliding')} sliding-window (window {geometry.sliding_window}): {names('sliding')}; "
            f"{types.count('full')} full: {names('full') or '-'}")


def format_table(rows: Sequence[dict]) -> str:
    head = ("| condition | bits | modality | kind | KL mean [95% CI] | ΔNLL [95% CI] | top-1 | acc (FP) "
            "| quantized tok/sample | bpv | bpv (real bytes) |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        acc = "" if r["acc"] is None else f"{r['acc']:.3f} ({r['acc_fp']:.3f})"
        lines.append(
            f"| {r['condition']} | {r['bits']} | {r['modality']} | {r['kind']} | {r['kl']:.5f} "
            f"[{r['kl_lo']:.5f}, {r['kl_hi']:.5f}] | {r['delta_nll']:+.4f} [{r['delta_nll_lo']:+.4f}, "
            f"{r['delta_nll_hi']:+.4f}] | {r['top1']:.3f} | {acc} | {r['quantized_tokens_per_sample']:.1f} "
            f"| {r['bpv']:.3f} | {r['bpv_measured']:.3f} |")
    return "\n".join(lines)


def format_ratios(ratios: dict) -> str:
    lines = ["| bits/modality | KL_K / KL_V [95% CI] | KL_K | KL_V |", "|---|---|---|---|"]
    for k, v in ratios.items():
        lines.append(f"| {k} | {v['k_over_v']:.2f} [{v['ci95'][0]:.2f}, {v['ci95'][1]:.2f}] | {v['kl_k']:.5f} "
                     f"| {v['kl_v']:.5f} |")
    return "\n".join(lines)


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *a):
        self.seconds = time.perf_counter() - self.t0
