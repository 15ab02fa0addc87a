"""Figures of a report (PNG bytes), drawn only from :func:`kvplan.explain.report`'s dict.

- ``allocation``: bits per (layer x KV head), one panel per (K/V x modality), a discrete
  colour per format the plan uses, corrected key slots dotted, protected slots hatched;
- ``bpv_context``: honest bpv against context length for the plan, full precision and uniform plans;
- ``pareto``: calibration KL vs bpv of the trials, the front, baselines, this plan on
  calibration and test (held-out), the budget; and the search's progress;
- ``importance``: consensus importance per component group and each slot's direction.
"""

from __future__ import annotations

import io
import os

import numpy as np

from ..plans import KINDS
from ._sidecars import this_plans_measurements

FIGURE_NAMES = ("allocation", "bpv_context", "pareto", "importance")
# one fixed colour per format, so two plans' figures compare at a glance
FORMAT_COLOURS = {2: "#3b0f70", 3: "#8c2981", 4: "#de4968", 8: "#fe9f6d", 16: "#fcfdbf"}
DARK_TEXT = {8, 16}  # formats whose colour needs dark text
SERIES_STYLE = {"this plan": dict(color="black", lw=1.8, zorder=5), "fp16": dict(color="#7f7f7f", lw=1.2),
                "fp32": dict(color="#7f7f7f", lw=1.2)}
UNIFORM_COLOURS = ("#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd")
DPI = 110


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    _plt().close(fig)
    return buf.getvalue()


def _title(rep: dict) -> str:
    m, b = rep["model"], rep["budget"]
    budget = f", budget {b['target_bpv']:g}" if b["target_bpv"] is not None else ""
    return (f"{rep.get('name') or os.path.basename(rep['plan'])} — {m['model_type']} ({m['num_layers']} layers x "
            f"{m['num_kv_heads']} KV heads) — honest {b['bpv']['total']:.3f} bpv at {b['reference']['context_len']} "
            f"tokens{budget}")


def full_precision(rep: dict) -> str:
    """The unquantized cache's name: ``fp16`` or ``fp32`` (the plan's ``full_precision_bits``)."""
    return f"fp{rep['budget']['reference']['full_precision_bits']}"


def bpv_title(rep: dict) -> str:
    """Second title line of the bpv figure: the quantizer and how tokens wait before a group fills."""
    q = rep["quantizer"]
    rb = q.get("residual_bits", 16)
    held = "in full precision" if rb == 16 else f"as {rb}-bit per-token codes"
    return (f"bpv vs context: group {q['group_size']}, residual {q['residual_length']}, sink {q['sink_length']} "
            f"(teeth: tokens waiting {held} until a group is full)")


def kl_label(rep: dict) -> str:
    """The Pareto figure's y axis: KL of the quantized model's next-token distribution from the full-precision one."""
    return f"mean KL(P_{full_precision(rep)} || P_quant)"


def allocation_figure(rep: dict) -> bytes:
    plt = _plt()
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch, Rectangle

    a = rep["allocation"]
    bits = np.asarray(a["bits"])  # [L, H, 2, M]
    corr = np.asarray(a["corrected"], dtype=bool)
    L, H, _, M = bits.shape
    used = a["bits_used"]
    cmap = ListedColormap([FORMAT_COLOURS.get(b, "#999999") for b in used])
    norm = BoundaryNorm(np.arange(len(used) + 1) - 0.5, len(used))
    index = np.searchsorted(used, bits)
    prot = {(p["layer"], p["head"], KINDS.index(p["kind"]), rep["modalities"].index(p["modality"]))
            for p in a["protected"]}
    panels = [(k, i) for k in range(2) for i in range(M)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8.0, 0.32 * L + 2.5), 0.9 + len(panels) * (0.3 * H + 0.75)),
                             squeeze=False, constrained_layout=True)
    for ax, (k, i) in zip(axes[:, 0], panels):
        ax.pcolormesh(np.arange(L + 1) - 0.5, np.arange(H + 1) - 0.5, index[:, :, k, i].T, cmap=cmap, norm=norm,
                      edgecolors="white", linewidth=0.6)
        small = L * H <= 600
        for l in range(L):
            for h in range(H):
                b = int(bits[l, h, k, i])
                if small:
                    ax.text(l, h, str(b), ha="center", va="center", fontsize=7,
                            color="black" if b in DARK_TEXT else "white")
                if corr[l, h, k, i]:
                    ax.plot(l + 0.3, h - 0.26, "o", ms=4.5, mfc="#00e0ff", mec="black", mew=0.5)
                if (l, h, k, i) in prot:
                    ax.add_patch(Rectangle((l - 0.5, h - 0.5), 1, 1, fill=False, hatch="////", edgecolor="black",
                                           lw=0))
        ax.set_title(f"{KINDS[k].upper()} — {rep['modalities'][i]} tokens", fontsize=9, loc="left")
        ax.set_yticks(range(H), [f"H{h}" for h in range(H)], fontsize=7)
        ax.set_xticks(range(L), [str(l) for l in range(L)], fontsize=7)
        ax.set_xlim(-0.5, L - 0.5)
        ax.set_ylim(H - 0.5, -0.5)
        ax.set_ylabel("KV head", fontsize=8)
    axes[-1, 0].set_xlabel("layer")
    handles = [Patch(facecolor=FORMAT_COLOURS.get(b, "#999999"), edgecolor="grey", label="streamed" if b == 0 else f"{b} bit") for b in used]
    if corr.any():
        q = rep["quantizer"]
        handles.append(Line2D([], [], ls="", marker="o", ms=5, mfc="#00e0ff", mec="black",
                              label=f"+ key correction (rank {q['key_correction_rank']}, {q['key_correction_bits']}-bit)"))
    if prot:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="////", label="protected (>= 8 bits)"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(_title(rep), fontsize=10)
    return _png(fig)


def bpv_figure(rep: dict) -> bytes:
    plt = _plt()
    c = rep["bpv_curve"]
    T = np.asarray(c["context_len"])
    fig, ax = plt.subplots(figsize=(9, 5), constrained_layout=True)
    for j, s in enumerate(c["series"]):
        style = SERIES_STYLE.get(s["label"], dict(lw=1.0, alpha=0.85, color=UNIFORM_COLOURS[j % len(UNIFORM_COLOURS)]))
        ax.plot(T, s["bpv"], label=s["label"], **style)
    r = c["reference"]
    ax.plot([r["context_len"]], [r["bpv"]], "*", ms=14, mfc="gold", mec="black", zorder=6,
            label=f"reference: {r['bpv']:.3f} bpv at {r['context_len']} tokens")
    if c.get("target_bpv") is not None:
        ax.axhline(c["target_bpv"], ls="--", color="grey", lw=0.8, label=f"budget {c['target_bpv']:g} bpv")
    ax.set_xscale("log")
    ax.set_xlim(1, T.max())
    ax.set_ylim(0, max(max(s["bpv"]) for s in c["series"]) * 1.05)
    ax.set_xlabel("context length (tokens, log scale)")
    ax.set_ylabel("honest bits per value")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title(f"{_title(rep)}\n{bpv_title(rep)}", fontsize=9)
    return _png(fig)


def _source_kind(s: str) -> str:
    return "baseline" if s.startswith("baseline:") else s.split("@")[0] or "trial"


def _log_y(ax) -> None:
    """Log y axis with enough labelled ticks to read values off (1, 2, 3, 5, 7 per decade)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0, 7.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def pareto_figure(rep: dict) -> bytes:
    plt = _plt()

    h = rep["history"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5.2), constrained_layout=True,
                                  gridspec_kw={"width_ratios": [3, 2]})
    pts = [p for p in h["points"] if not p["source"].startswith("baseline:")]
    kinds = sorted({_source_kind(p["source"]) for p in pts})
    for kind in kinds:
        sel = [p for p in pts if _source_kind(p["source"]) == kind]
        ax.scatter([p["bpv"] for p in sel], [p["kl"] for p in sel], s=14, alpha=0.6, label=f"trials: {kind}")
    fr = h["pareto"]
    ax.plot([p["bpv"] for p in fr], [p["kl"] for p in fr], "-", color="black", lw=1, drawstyle="steps-post",
            label="Pareto front (calibration)")
    for j, bl in enumerate(h.get("baselines", [])):
        ax.scatter([bl["bpv"]], [bl["kl"]], marker="X", s=60, color="black", zorder=5)
        ax.annotate(bl["label"], (bl["bpv"], bl["kl"]), xytext=(6, 8 - 14 * (j % 2)), textcoords="offset points",
                    fontsize=7)
    bpv = rep["budget"]["bpv"]["total"]
    marks = {"calibration": ("*", "gold"), "validation": ("s", "#2ca02c"), "test": ("D", "#1f77b4"),
             "heldout": ("D", "#1f77b4")}
    for d in this_plans_measurements(rep):  # an edited plan's were measured on the plan before the edit
        if d.get("kl") is None:
            continue
        lo, hi = d.get("kl_ci95_lo"), d.get("kl_ci95_hi")
        err = [[max(d["kl"] - lo, 0)], [max(hi - d["kl"], 0)]] if lo is not None and hi is not None else None
        m, col = marks[d["split"]]
        ax.errorbar([bpv], [d["kl"]], yerr=err, fmt=m, ms=11 if m == "*" else 7, mfc=col, mec="black",
                    ecolor=col, capsize=3, zorder=6, label=f"this plan, {d['label']}: KL {d['kl']:.4g}")
    tb = rep["budget"]["target_bpv"]
    for b in h.get("budgets") or ([tb] if tb is not None else []):
        ax.axvline(b, ls="--", color="grey", lw=0.9, label=f"budget {b:g} bpv")
    _log_y(ax)
    ax.set_xlabel("honest bpv (at the plan's reference)")
    ax.set_ylabel(kl_label(rep))
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="lower left")
    ax.set_title("trials, front and this plan (calibration; test = held-out samples)", fontsize=9)
    prog = h.get("progress") or []
    x = np.arange(len(prog))
    ax2.scatter(x, [p["kl"] for p in prog], s=10, alpha=0.6, color="#7f7f7f", label="trial (calibration KL)")
    ax2.plot(x, [p["best_kl"] for p in prog], color="#d62728", lw=1.4, drawstyle="steps-post", label="best so far")
    _log_y(ax2)
    ax2.set_xlabel("trial, in order")
    ax2.set_ylabel("mean KL (calibration)")
    ax2.grid(True, which="both", alpha=0.25)
    ax2.legend(fontsize=7)
    ax2.set_title("search progress", fontsize=9)
    fig.suptitle(_title(rep), fontsize=10)
    return _png(fig)


def _bars(ax, d: dict, title: str, units: str, colour="#4c72b0") -> None:
    names = list(d)[::-1]
    ax.barh(names, [d[n] for n in names], color=colour)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(units, fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    for y, n in enumerate(names):
        ax.text(d[n], y, f" {d[n]:.1f}", va="center", fontsize=6)


def importance_figure(rep: dict) -> bytes:
    plt = _plt()
    imp = rep["importance"]
    units = "% of consensus importance"
    fig = plt.figure(figsize=(14, 14), constrained_layout=True)
    gs = fig.add_gridspec(4, 4, height_ratios=[1, 1.1, 1.5, 1.1])
    _bars(fig.add_subplot(gs[0, 0]), {k.upper(): v for k, v in imp["kind"].items()}, "K vs V", units)
    _bars(fig.add_subplot(gs[0, 1]), imp["modality"], "modality", units)
    axq = fig.add_subplot(gs[0, 2])
    if imp["quantizer"]:
        _bars(axq, imp["quantizer"], "plan-wide quantizer fields", units)
    else:
        axq.axis("off")
        axq.text(0.5, 0.5, "no plan-wide quantizer field\nvaried in the trials", ha="center", va="center")
    _bars(fig.add_subplot(gs[0, 3]), imp["head"], "top KV heads (K+V, all modalities)", units)
    axl = fig.add_subplot(gs[1, :])
    layers = imp["layer"]
    axl.bar(range(len(layers)), list(layers.values()), color="#4c72b0")
    axl.set_xticks(range(len(layers)), list(layers), fontsize=7, rotation=90)
    axl.set_ylabel(units, fontsize=8)
    axl.set_title("per layer (K+V, all heads and modalities)", fontsize=9)
    _bars(fig.add_subplot(gs[2, :2]), imp["top_slots"], "top slots (layer.head.kind.modality)", units)
    d = imp.get("direction") or {}
    axd = fig.add_subplot(gs[2, 2:])
    slope = d.get("slope") or {}
    if slope:
        names = list(slope)[::-1]
        axd.barh(names, [slope[n] for n in names], color=["#2ca02c" if slope[n] < 0 else "#d62728" for n in names])
        axd.axvline(0, color="black", lw=0.8)
        axd.tick_params(axis="y", labelsize=7)
        axd.set_xlabel("d(predicted log-KL) / d(log2 bits): < 0 (green) = more bits help", fontsize=8)
    else:
        axd.axis("off")
    axd.set_title("direction: SHAP slope against bits, same slots", fontsize=9)
    for j, (s, sc) in enumerate(list((d.get("scatter") or {}).items())[:4]):
        ax = fig.add_subplot(gs[3, j])
        b = np.asarray(sc["bits"], dtype=float)
        c = np.asarray(sc["corrected"], dtype=bool)
        jitter = np.random.default_rng(j).uniform(-0.12, 0.12, len(b))
        ax.scatter(b[~c] + jitter[~c], np.asarray(sc["shap"])[~c], s=10, alpha=0.6, label="plain")
        if c.any():
            ax.scatter(b[c] + jitter[c], np.asarray(sc["shap"])[c], s=10, alpha=0.6, label="+ correction")
            ax.legend(fontsize=6)
        ax.axhline(0, color="black", lw=0.6)
        ax.set_xticks(sorted(set(b.astype(int))))
        ax.set_xlabel("bits in the trial", fontsize=8)
        ax.set_ylabel("SHAP (log-KL)", fontsize=8)
        ax.set_title(s, fontsize=8)
    r2 = f", forest OOB R² {imp['oob_r2']:.2f}" if imp.get("oob_r2") is not None else ""
    fig.suptitle(f"{_title(rep)}\nconsensus importance from {imp['n_trials']} trials{r2}: {imp['units']}",
                 fontsize=9)
    return _png(fig)


def render_figures(rep: dict) -> dict[str, bytes]:
    """``{name: PNG bytes}`` of every figure the report has data for (see :data:`FIGURE_NAMES`)."""
    out = {"allocation": allocation_figure(rep), "bpv_context": bpv_figure(rep)}
    if (rep.get("history") or {}).get("points"):
        out["pareto"] = pareto_figure(rep)
    if rep.get("importance"):
        out["importance"] = importance_figure(rep)
    return out


def file_mode() -> int:
    """The mode a plain ``open(path, "w")`` would give a new file (temporary files are 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_figures(out_dir: str, pngs: dict[str, bytes], also: dict[str, str] | None = None) -> list[str]:
    """Write ``<name>.png`` files into ``out_dir`` as one set (:func:`~kvplan.plans._files.write_file_set`:
    on any failure the earlier figures stay as they were, no temporary file is left, and the error names
    the figure), with the files of ``also`` (``path -> text``: the HTML page); figures of an earlier run
    that this report has no data for are removed."""
    from ..plans._files import write_file_set

    created = not os.path.isdir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"{name}.png") for name in pngs]
    try:
        write_file_set({**dict(zip(paths, pngs.values())), **(also or {})})
    except BaseException:
        if created and not os.listdir(out_dir):
            os.rmdir(out_dir)
        raise
    for name in FIGURE_NAMES:
        stale = os.path.join(out_dir, f"{name}.png")
        if name not in pngs and os.path.exists(stale):
            os.unlink(stale)
    return paths
