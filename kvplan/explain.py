"""``kvplan explain``: why a plan looks the way it does.

Works on the plan file alone (model, budget, honest bpv breakdown, memory at several
context lengths, allocation summaries, protected heads, measured metrics). When the
search's trial history sits beside the plan (``<stem>.trials.csv``, written by
:func:`kvplan.search.search`) it adds the consensus importance (random-forest impurity +
permutation + mean |SHAP|, each normalized, summed; see :mod:`kvplan.surrogates.importance`)
and the Pareto front; otherwise the report says what is missing.

>>> print(explain("plan.yaml"))                       # text report
>>> explain("plan.yaml", format="json", out_dir="figs")  # JSON text, PNG figures in figs/
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

from .errors import KVPlanError
from .plans import KINDS, Plan

CONTEXT_LENGTHS = (1024, 4096, 16384, 32768)
FORMATS = ("text", "json")


def _sidecars(plan_path: str) -> dict[str, str]:
    from .search._search import sidecar_paths

    return sidecar_paths(plan_path)


def load_history(path: str) -> dict[str, Any] | None:
    """Rows of a ``.trials.csv``: tables ``[N, L, H, 2, M]`` need the plan's shape; returns raw columns."""
    if not os.path.exists(path):
        return None
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return {"rows": rows}


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _num(v):
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def report(plan_path, importance: bool = True, seed: int = 0) -> dict[str, Any]:
    """The explanation as a JSON-able dict (what :func:`explain` renders)."""
    plan_path = os.fspath(plan_path)
    plan = Plan.from_yaml(plan_path)
    g = plan.geometry
    table = plan.table()  # [L, H, 2, M]
    mods = list(plan.modalities)
    ref = plan.reference
    bpv = plan.bpv()
    rep: dict[str, Any] = {"plan": plan_path, "name": plan.name, "missing": []}
    rep["model"] = {"model_type": g.model_type, "num_layers": g.num_layers, "num_kv_heads": g.num_kv_heads,
                    "head_dim": g.head_dim, "fingerprint": g.fingerprint}
    rep["quantizer"] = dataclasses.asdict(plan.quantizer)
    rep["budget"] = {"target_bpv": plan.target_bpv, "reference": {"context_len": ref.context_len,
                                                                   "modality_mix": dict(ref.modality_mix)},
                     "bpv": bpv.as_dict()}
    mem = []
    fpb = ref.full_precision_bits
    for T in sorted(set(CONTEXT_LENGTHS) | {ref.context_len}):
        b = plan.bpv(context_len=T).total
        n_values = g.num_layers * g.num_kv_heads * 2 * T * g.head_dim
        mem.append({"context_len": T, "bpv": b, "bytes": b * n_values / 8, "fp16_bytes": fpb * n_values / 8,
                    "saved_fraction": 1 - b / fpb})
    rep["memory"] = mem

    # allocation summaries
    def mean_bits(sel):
        return float(np.mean(sel))

    alloc: dict[str, Any] = {
        "mean_bits": {kind: mean_bits(table[:, :, k]) for k, kind in enumerate(KINDS)},
        "per_modality": {m: {kind: mean_bits(table[:, :, k, i]) for k, kind in enumerate(KINDS)}
                         for i, m in enumerate(mods)},
        "per_layer": [{"layer": l, "k": mean_bits(table[l, :, 0]), "v": mean_bits(table[l, :, 1])}
                      for l in range(g.num_layers)],
        "histogram": {kind: {str(b): int((table[:, :, k] == b).sum()) for b in np.unique(table)}
                      for k, kind in enumerate(KINDS)},
    }
    med = float(np.median(table))
    protected = []
    for l in range(g.num_layers):
        for h in range(g.num_kv_heads):
            for k, kind in enumerate(KINDS):
                for i, m in enumerate(mods):
                    b = int(table[l, h, k, i])
                    if b >= 8 and b > med:
                        protected.append({"layer": l, "head": h, "kind": kind, "modality": m, "bits": b})
    alloc["protected"] = protected
    alloc["median_bits"] = med
    corrected = plan.correction_table()  # [L, H, 2, M]
    alloc["corrected_keys"] = [{"layer": int(l), "head": int(h), "modality": mods[int(i)]}
                               for l, h, k, i in zip(*np.nonzero(corrected))]
    rep["allocation"] = alloc
    rep["metrics"] = dict(plan.metrics)
    if not plan.metrics:
        rep["missing"].append("measured metrics (the plan has none; produce it with kvplan search)")

    side = _sidecars(plan_path)
    hist = load_history(side["trials"])
    rep["history"] = {"trials_csv": side["trials"] if hist else None}
    sidecar = None
    if os.path.exists(side["search"]):
        with open(side["search"], encoding="utf-8") as f:
            sidecar = json.load(f)
    if hist is None:
        rep["missing"].append(f"trial history ({side['trials']} not found): no consensus importance and no "
                              "Pareto front; run kvplan search with --out next to this plan to produce it")
    else:
        rows = hist["rows"]
        shape = table.shape
        tables, kl, bpvs, q_fields, srcs = [], [], [], {"group_size": [], "residual_length": [], "key_axis": [],
                                                         "sink_length": []}, []
        for r in rows:
            bits = np.array([int(x) for x in r["bits"].split()], dtype=np.int64)
            if bits.size != table.size or _num(r["kl"]) is None:
                continue
            tables.append(bits.reshape(shape))
            kl.append(float(r["kl"]))
            bpvs.append(_num(r["bpv"]))
            srcs.append(r.get("source", ""))
            for k in q_fields:
                # histories written before sink_length existed have no such column: 0
                q_fields[k].append(r[k] if k == "key_axis" else int(r.get(k) or 0))
        rep["history"].update(n_trials=len(tables))
        pts = [(a, b) for a, b in zip(kl, bpvs) if b is not None]
        from .search._search import pareto_front

        front = pareto_front(pts)
        rep["history"]["pareto"] = [{"kl": pts[i][0], "bpv": pts[i][1]} for i in front]
        rep["history"]["points"] = [{"kl": a, "bpv": b, "source": s} for (a, b), s in zip(pts, srcs)]
        rep["history"]["baselines"] = [{"kl": a, "bpv": b, "source": s} for (a, b), s in zip(pts, srcs)
                                       if s.startswith("baseline:")]
        if importance and len(tables) >= 5:
            from .surrogates import component_importance, importance_from_history

            imp = importance_from_history(np.stack(tables), q_fields, kl, mods, seed=seed)
            comp = component_importance(imp, shape, mods)
            top_slots = sorted(comp["slot"].items(), key=lambda kv: -kv[1])[:15]
            rep["importance"] = {
                "n_trials": imp.n_trials, "oob_r2": imp.r2_oob, "methods": list(imp.methods),
                "kind": comp["kind"], "modality": comp["modality"], "layer": comp["layer"],
                "head": dict(sorted(comp["head"].items(), key=lambda kv: -kv[1])[:10]),
                "quantizer": comp["quantizer"], "top_slots": dict(top_slots),
                "per_method_kind": {m: {kind: float(100 * sum(v for n, v in zip(imp.names, arr)
                                                             if n.startswith("slot:") and f".{kind}." in n))
                                        for kind in KINDS} for m, arr in imp.methods.items()},
            }
        elif importance:
            rep["missing"].append(f"consensus importance (only {len(tables)} trials in the history; need >= 5)")
    if sidecar:
        rep["search"] = {k: sidecar.get(k) for k in ("space", "budgets", "seed", "study_name", "profile")}
    return rep


# ----------------------------------------------------------------------------- rendering
def _ci(metrics: dict, key: str) -> str:
    v = metrics.get(key)
    if v is None:
        return "n/a"
    lo, hi, se = metrics.get(f"{key}_ci95_lo"), metrics.get(f"{key}_ci95_hi"), metrics.get(f"{key}_se")
    s = f"{v:.4g}"
    if lo is not None and hi is not None:
        s += f" (95% CI {lo:.4g}–{hi:.4g})"
    elif se is not None:
        s += f" ± {se:.2g} (s.e.)"
    return s


def render_text(rep: dict) -> str:
    L = []
    m = rep["model"]
    L.append(f"kvplan plan: {rep['plan']}" + (f"  ({rep['name']})" if rep.get("name") else ""))
    L.append(f"model: {m['model_type']}, {m['num_layers']} layers x {m['num_kv_heads']} KV heads x head_dim "
             f"{m['head_dim']}  [{m['fingerprint']}]")
    q = rep["quantizer"]
    L.append(f"quantizer: group {q['group_size']}, keys per {q['key_axis']}, values per {q['value_axis']}, "
             f"residual {q['residual_length']} newest and {q.get('sink_length', 0)} first (attention-sink) tokens "
             "at full precision")
    if q.get("key_correction_rank"):
        L.append(f"key correction: key slots marked 'correct' also store a rank-{q['key_correction_rank']} "
                 f"{q['key_correction_bits']}-bit code of their error in per-head query bases learned on the "
                 "calibration data (HeadQ-style)")
    rot = [w for w, on in (("a Hadamard rotation of quantized K and V", q.get("rotation") == "hadamard"),
                           ("keys rotated back to the pre-RoPE frame", q.get("key_pre_rope"))) if on]
    if rot:
        L.append(f"rotations before quantization (undone on read, no bpv): {' and '.join(rot)}")
    b = rep["budget"]
    mix = ", ".join(f"{k} {v:.1%}" for k, v in b["reference"]["modality_mix"].items())
    L.append("")
    L.append(f"budget: {b['target_bpv'] if b['target_bpv'] is not None else 'none'} bpv at context "
             f"{b['reference']['context_len']} ({mix})")
    bp = b["bpv"]
    L.append(f"honest bpv: {bp['total']:.4f} = payload {bp['payload']:.4f} + scales/zeros "
             f"{bp['scales_zeros']:.4f} + full-precision residual {bp['residual']:.4f}"
             + (f" + key correction {bp['correction']:.4f}" if bp.get("correction") else ""))
    L.append("memory (KV cache, batch 1):")
    for r in rep["memory"]:
        L.append(f"  {r['context_len']:>6} tokens: {r['bpv']:.3f} bpv, {_fmt_bytes(r['bytes'])} vs fp16 "
                 f"{_fmt_bytes(r['fp16_bytes'])}  (saves {r['saved_fraction']:.1%})")
    a = rep["allocation"]
    L.append("")
    L.append(f"allocation: mean bits K {a['mean_bits']['k']:.2f}, V {a['mean_bits']['v']:.2f}")
    for kind in KINDS:
        h = ", ".join(f"{bits}b x{n}" for bits, n in a["histogram"][kind].items() if n)
        L.append(f"  {kind.upper()} slots: {h}")
    if len(a["per_modality"]) > 1:
        for mname, d in a["per_modality"].items():
            L.append(f"  modality {mname}: K {d['k']:.2f}, V {d['v']:.2f} bits")
    L.append("  per layer (mean K / V bits):")
    row = []
    for r in a["per_layer"]:
        row.append(f"L{r['layer']:02d} {r['k']:.1f}/{r['v']:.1f}")
        if len(row) == 6:
            L.append("    " + "  ".join(row))
            row = []
    if row:
        L.append("    " + "  ".join(row))
    if a["corrected_keys"]:
        heads = sorted({(c["layer"], c["head"]) for c in a["corrected_keys"]})
        L.append(f"  key correction on {len(a['corrected_keys'])} key slots ({len(heads)} KV heads): " +
                 ", ".join(f"L{l}.H{h}" for l, h in heads[:24]) +
                 (f" (+{len(heads) - 24} more)" if len(heads) > 24 else ""))
    if a["protected"]:
        heads = sorted({(p["layer"], p["head"], p["kind"]) for p in a["protected"]})
        L.append(f"  protected (>= 8 bits, above the median {a['median_bits']:g}): " +
                 ", ".join(f"L{l}.H{h}.{k.upper()}" for l, h, k in heads[:24]) +
                 (f" (+{len(heads) - 24} more)" if len(heads) > 24 else ""))
    else:
        L.append("  protected heads: none (no slot at >= 8 bits above the median)")
    met = rep.get("metrics") or {}
    L.append("")
    if met:
        for split in ("calibration", "heldout"):
            d = met.get(split)
            if d:
                extra = ""
                if d.get("acc") is not None:
                    extra = f", accuracy {_ci(d, 'acc')} (FP {d.get('acc_fp', float('nan')):.3g})"
                nll = f", NLL {_ci(d, 'nll')}" if d.get("nll") is not None else ""
                L.append(f"measured on {split}: KL {_ci(d, 'kl')}{nll}{extra}"
                         + (f" [{int(d['n_samples'])} samples]" if d.get("n_samples") else ""))
        s = met.get("search")
        if s:
            L.append(f"search: granularity {s.get('granularity')}, {s.get('n_trials')} trials "
                     f"(+{s.get('n_profile_evals', 0)} profile evaluations), seed {s.get('seed')}, chosen trial "
                     f"{s.get('trial')} ({s.get('source')})")
    imp = rep.get("importance")
    if imp:
        L.append("")
        r2 = f", forest OOB R2 {imp['oob_r2']:.2f}" if imp.get("oob_r2") is not None else ""
        L.append(f"consensus importance ({imp['n_trials']} trials; impurity + permutation + |SHAP|{r2}):")
        L.append("  K vs V: " + ", ".join(f"{k.upper()} {v:.1f}%" for k, v in imp["kind"].items()))
        if len(imp["modality"]) > 1:
            L.append("  modality: " + ", ".join(f"{k} {v:.1f}%" for k, v in imp["modality"].items()))
        top_layers = sorted(imp["layer"].items(), key=lambda kv: -kv[1])[:8]
        L.append("  layers: " + ", ".join(f"{k} {v:.1f}%" for k, v in top_layers))
        L.append("  heads: " + ", ".join(f"{k} {v:.1f}%" for k, v in list(imp["head"].items())[:8]))
        if imp["quantizer"]:
            L.append("  quantizer: " + ", ".join(f"{k} {v:.1f}%" for k, v in imp["quantizer"].items()))
        L.append("  top slots: " + ", ".join(f"{k} {v:.1f}%" for k, v in list(imp["top_slots"].items())[:8]))
    hist = rep.get("history") or {}
    if hist.get("pareto"):
        L.append("")
        L.append("Pareto front (KL vs bpv) of the trials: " + ", ".join(
            f"{p['bpv']:.3f}->{p['kl']:.4g}" for p in hist["pareto"][:10]))
        if hist.get("baselines"):
            L.append("baselines in the study: " + ", ".join(
                f"{p['source'][9:]} {p['bpv']:.3f} bpv KL {p['kl']:.4g}" for p in hist["baselines"][:8]))
    if rep.get("figures"):
        L.append("")
        L.append("figures: " + ", ".join(rep["figures"]))
    if rep["missing"]:
        L.append("")
        for msg in rep["missing"]:
            L.append(f"missing: {msg}")
    return "\n".join(L) + "\n"


def figures(rep: dict, plan_path: str, out_dir: str) -> list[str]:
    """Write PNG figures; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    plan = Plan.from_yaml(plan_path)
    table = plan.table()
    mods = list(plan.modalities)
    paths = []
    vmin, vmax = 2, 16
    fig, axes = plt.subplots(len(mods), 2, figsize=(8, 1.5 + 0.3 * table.shape[0] * len(mods)), squeeze=False,
                             constrained_layout=True)
    for i, m in enumerate(mods):
        for k, kind in enumerate(KINDS):
            ax = axes[i][k]
            im = ax.imshow(np.log2(table[:, :, k, i]), aspect="auto", cmap="viridis", vmin=np.log2(vmin),
                           vmax=np.log2(vmax))
            ax.set_title(f"{kind.upper()} bits — {m}")
            ax.set_xlabel("KV head")
            ax.set_ylabel("layer")
            ax.set_xticks(range(table.shape[1]))
            if table.shape[0] * table.shape[1] <= 400:
                for l in range(table.shape[0]):
                    for h in range(table.shape[1]):
                        ax.text(h, l, str(table[l, h, k, i]), ha="center", va="center", fontsize=5, color="w")
    cb = fig.colorbar(im, ax=axes, ticks=np.log2([2, 3, 4, 8, 16]))
    cb.ax.set_yticklabels(["2", "3", "4", "8", "16"])
    p = os.path.join(out_dir, "allocation.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    hist = rep.get("history") or {}
    if hist.get("points"):
        fig, ax = plt.subplots(figsize=(6, 4))
        pts = hist["points"]
        ax.scatter([q["bpv"] for q in pts], [q["kl"] for q in pts], s=8, alpha=0.4, label="trials")
        fr = hist["pareto"]
        ax.plot([q["bpv"] for q in fr], [q["kl"] for q in fr], "r.-", label="Pareto front")
        for bl in hist.get("baselines", []):
            ax.scatter([bl["bpv"]], [bl["kl"]], marker="x", color="k")
            ax.annotate(bl["source"][9:], (bl["bpv"], bl["kl"]), fontsize=6)
        b = rep["budget"]["bpv"]["total"]
        cal = (rep.get("metrics") or {}).get("calibration", {})
        if cal.get("kl") is not None:
            ax.scatter([b], [cal["kl"]], marker="*", s=120, color="gold", edgecolor="k", label="this plan")
        ax.set_yscale("log")
        ax.set_xlabel("honest bpv")
        ax.set_ylabel("mean KL (calibration)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = os.path.join(out_dir, "pareto.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    imp = rep.get("importance")
    if imp:
        fig, axes = plt.subplots(1, 3, figsize=(12, 4))
        groups = [("K vs V", {k.upper(): v for k, v in imp["kind"].items()}),
                  ("layers", dict(sorted(imp["layer"].items(), key=lambda kv: -kv[1])[:12])),
                  ("slots", dict(list(imp["top_slots"].items())[:12]))]
        if len(imp["modality"]) > 1:
            groups[0] = ("K/V and modality", {**{k.upper(): v for k, v in imp["kind"].items()},
                                              **imp["modality"]})
        for ax, (title, d) in zip(axes, groups):
            ax.barh(list(d)[::-1], list(d.values())[::-1])
            ax.set_title(f"consensus importance: {title}")
            ax.set_xlabel("%")
            ax.tick_params(axis="y", labelsize=7)
        fig.tight_layout()
        p = os.path.join(out_dir, "importance.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def explain(plan_path, format: str = "text", out_dir=None, importance: bool = True, seed: int = 0) -> str:
    """Explain a plan file: returns the text report, or JSON text with ``format="json"``.

    With ``out_dir`` PNG figures are written there (bit-allocation heatmaps, and with the
    trial history the Pareto front and importance bars) and listed in the report.
    """
    if format not in FORMATS:
        raise KVPlanError(f"format {format!r} is not one of {list(FORMATS)}")
    plan_path = os.fspath(plan_path)
    rep = report(plan_path, importance=importance, seed=seed)
    if out_dir is not None:
        rep["figures"] = figures(rep, plan_path, os.fspath(out_dir))
    if format == "json":
        rep = dict(rep)
        if rep.get("history"):
            rep["history"] = {k: v for k, v in rep["history"].items() if k != "points"}
        return json.dumps(rep, indent=1, default=float)
    return render_text(rep)


__all__ = ["explain", "report", "render_text", "figures"]
