"""The text rendering of :func:`kvplan.explain.report`'s dict."""

from __future__ import annotations

from ..models.modality import TOKEN_IDS_NAME
from ..plans import KINDS
from ._sidecars import number, show, this_plans_measurements

CURVE_TEXT_LENGTHS = (1, 1000, 4096, 32768, 131072)  # plus the first group boundary and the reference


def fmt_bytes(n: float) -> str:
    """``n`` bytes in B / KiB / MiB / GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def ci(d: dict, key: str) -> str:
    """``value (95% CI lo-hi)`` of a measured split's numeric metric, or ``n/a``."""
    v = d.get(key)
    if v is None:
        return "n/a"
    lo, hi, se = d.get(f"{key}_ci95_lo"), d.get(f"{key}_ci95_hi"), d.get(f"{key}_se")
    s = f"{v:.4g}"
    if lo is not None and hi is not None:
        s += f" (95% CI {lo:.4g}–{hi:.4g})"
    elif se is not None:
        s += f" ± {se:.2g} (s.e.)"
    return s


def _listing(items: list[str], limit: int = 24) -> str:
    return ", ".join(items[:limit]) + (f" (+{len(items) - limit} more)" if len(items) > limit else "")


def _curve_points(rep: dict) -> list[int]:
    c = rep["bpv_curve"]
    q = rep["quantizer"]
    first = q["residual_length"] + q["group_size"]
    want = sorted({*CURVE_TEXT_LENGTHS, first - 1, first, c["reference"]["context_len"]})
    have = set(c["context_len"])
    return [T for T in want if T in have]


def _header(rep: dict, L: list[str]) -> None:
    m = rep["model"]
    L.append(f"kvplan plan: {rep['plan']}" + (f"  ({rep['name']})" if rep.get("name") else ""))
    L.append(f"model: {m['model_type']}, {m['num_layers']} layers x {m['num_kv_heads']} KV heads x head_dim "
             f"{m['head_dim']}  [{m['fingerprint']}]")
    if "sliding" in m.get("layer_types", ()):
        n = m["layer_types"].count("sliding")
        L.append(f"layer types: {n} sliding-window (window {m.get('sliding_window') or 'not recorded'}; they store "
                 f"only the tokens it needs), {len(m['layer_types']) - n} full")
    p = rep.get("provenance") or {}
    L.append("provenance: " + ", ".join(f"{k} {v}" for k, v in p.items() if v is not None))
    if rep.get("labelling", TOKEN_IDS_NAME) != TOKEN_IDS_NAME:
        L.append(f"token labelling: {rep['labelling']} (searched with this kvplan.Labelling: pass the same one to "
                 f"kvplan.load; modalities {', '.join(rep['modalities'])})")
    q = rep["quantizer"]
    rb = q.get("residual_bits", 16)
    held = "as written (full precision)" if rb == 16 else f"as {rb}-bit per-token codes after their first forward"
    sb = q.get("sink_bits", 16)
    sink_held = "at full precision" if sb == 16 else f"as {sb}-bit per-token codes in the slots' rotated frame"
    L.append(f"quantizer: group {q['group_size']}, keys per {q['key_axis']}, values per {q['value_axis']}; the "
             f"{q['residual_length']} newest tokens and a group still filling wait uncommitted, held {held}; "
             + (f"the first {q['sink_length']} (attention-sink) tokens are held {sink_held}" if q.get("sink_length")
                else "no attention-sink tokens are kept apart"))
    if q.get("recent_length"):
        L.append(f"recent copies: the {q['recent_length']} newest committed tokens also keep their residual form "
                 f"({'full precision' if rb == 16 else f'{rb}-bit per-token codes'}), read instead of their slot codes "
                 "until newer tokens commit (counted as residual bytes)")
    if q.get("heavy_length"):
        L.append(f"heavy-hitter copies: each KV head of a full-attention layer also keeps its {q['heavy_length']} "
                 "committed tokens a prompt's last queries attend to most in their residual form, read instead of "
                 "their slot codes (counted as residual bytes, with their positions and scores)")
    if q.get("stream_window"):
        L.append(f"streamed KV heads (the slots at 0 bits): no codes; each attends to the sink tokens, copies of its "
                 f"{q['stream_window']} newest committed tokens in their residual form and the uncommitted tokens, "
                 "never to older ones (the copies counted as residual bytes)")
    if rep.get("error_feedback"):
        L.append("error feedback: slot codes are chosen coordinate by coordinate, each rounding error pushed onto "
                 "the coordinates not yet coded under the plan's per-head metrics (queries for keys, the output "
                 "projection for values): the same formats and bytes as nearest-level codes")
    if q.get("key_correction_rank"):
        L.append(f"key correction: key slots marked 'correct' also store a rank-{q['key_correction_rank']} "
                 f"{q['key_correction_bits']}-bit code of their error in per-head query bases learned on the "
                 "calibration data (HeadQ-style)")
    v1 = "minmax-fp16"
    if q.get("key_scaling", v1) != v1 or q.get("value_scaling", v1) != v1 or q.get("codebooks"):
        # schema-2 slot formats (kvplan.kernels.formats); v1 plans say nothing new
        books = q.get("codebooks") or ()  # ((kind, bits, levels), ...) as in QuantizerSettings
        bits_of = {k: sorted(b for kk, b, _ in books if kk == k) for k in ("k", "v")}
        L.append("slot formats: " + "; ".join(
            f"{name} {q.get(kind + '_scaling', 'minmax-fp16')}"
            + (f", Lloyd-Max codebooks at {bits_of[kind[0]]} bits" if bits_of[kind[0]] else ", uniform levels")
            for kind, name in (("key", "keys"), ("value", "values"))))
    rot = [w for w, on in (("a Hadamard rotation of quantized K and V", q.get("rotation") == "hadamard"),
                           ("keys rotated back to the pre-RoPE frame", q.get("key_pre_rope"))) if on]
    if rot:
        L.append(f"rotations before quantization (undone on read, no bpv): {' and '.join(rot)}")


def _memory(rep: dict, L: list[str]) -> None:
    b = rep["budget"]
    mix = ", ".join(f"{k} {v:.1%}" for k, v in b["reference"]["modality_mix"].items())
    L.append("")
    L.append(f"budget: {b['target_bpv'] if b['target_bpv'] is not None else 'none'} bpv at context "
             f"{b['reference']['context_len']} ({mix})")
    bp = b["bpv"]
    L.append(f"honest bpv: {bp['total']:.4f} = payload {bp['payload']:.4f} + scales/zeros "
             f"{bp['scales_zeros']:.4f} + residual {bp['residual']:.4f}"
             + (f" + key correction {bp['correction']:.4f}" if bp.get("correction") else ""))
    fp = b["reference"]["full_precision_bits"]
    L.append(f"memory (KV cache of this model, reference mix; fp{fp} = the unquantized cache):")
    for r in rep["memory"]:
        L.append(f"  {r['context_len']:>7} tokens x batch {r['batch']:<3}: {r['bpv']:.3f} bpv, {r['bytes']:>14,} B "
                 f"= {r['gib']:.4f} GiB ({fmt_bytes(r['bytes'])}) vs fp{fp} {r['fp16_bytes']:,} B = "
                 f"{r['fp16_gib']:.4f} GiB  (saves {r['saved_fraction']:.1%})")
    mixes = rep["bpv_by_mix"]["mixes"]
    if len(mixes) > 1:
        names = list(mixes)
        L.append("bpv by modality mix (reference = " + ", ".join(f"{k} {v:.1%}" for k, v in mixes["reference"].items())
                 + "): " + " | ".join(names))
        for r in rep["bpv_by_mix"]["rows"]:
            L.append(f"  {r['context_len']:>7} tokens: " + " | ".join(f"{r[n]:.3f}" for n in names))
    c = rep["bpv_curve"]
    Ts = _curve_points(rep)
    idx = {T: i for i, T in enumerate(c["context_len"])}
    L.append("bpv vs context length (figure bpv_context): " + ", ".join(f"{T}" for T in Ts) + " tokens")
    for s in c["series"]:
        L.append(f"  {s['label']:<32} " + "  ".join(f"{s['bpv'][idx[T]]:7.3f}" for T in Ts))
    plan = c["series"][0]["bpv"]
    for lo, hi in ((256, 1024), (1024, 4096)):
        sel = [v for T, v in zip(c["context_len"], plan) if lo <= T <= hi]
        if sel:
            L.append(f"  between group boundaries, {lo}-{hi} tokens: this plan {min(sel):.3f}-{max(sel):.3f} bpv")


def _allocation(rep: dict, L: list[str]) -> None:
    a = rep["allocation"]
    mods = rep["modalities"]
    L.append("")
    streamed = " (streamed heads count 0)" if 0 in a["bits_used"] else ""
    L.append(f"allocation: mean bits K {a['mean_bits']['k']:.2f}, V {a['mean_bits']['v']:.2f}{streamed}; "
             f"formats used: {', '.join('streamed' if b == 0 else str(b) for b in a['bits_used'])} bits")
    for kind in KINDS:
        h = ", ".join(f"{bits}b x{n}" for bits, n in a["histogram"][kind].items() if n)
        L.append(f"  {kind.upper()} slots: {h}")
    if len(a["per_modality"]) > 1:
        for mname, d in a["per_modality"].items():
            L.append(f"  modality {mname}: K {d['k']:.2f}, V {d['v']:.2f} bits")
    hybrid = any(r.get("type") == "sliding" for r in a["per_layer"])
    L.append("  per layer (mean K / V bits" + (", S = sliding-window layer, F = full):" if hybrid else "):"))
    row = []
    for r in a["per_layer"]:
        tag = ("S " if r.get("type") == "sliding" else "F ") if hybrid else ""
        row.append(f"L{r['layer']:02d} {tag}{r['k']:.1f}/{r['v']:.1f}")
        if len(row) == 6:
            L.append("    " + "  ".join(row))
            row = []
    if row:
        L.append("    " + "  ".join(row))
    prot = {(p["layer"], p["head"], KINDS.index(p["kind"]), mods.index(p["modality"])) for p in a["protected"]}
    L.append("  bits per KV head (figure allocation; c = key correction, * = protected), "
             + " | ".join(f"{k.upper()} {m}" for k in KINDS for m in mods) + ":")
    for l, heads in enumerate(a["bits"]):
        cells = []
        for k in range(2):
            for i in range(len(mods)):
                cells.append(" ".join(
                    f"{heads[h][k][i]}{'c' if a['corrected'][l][h][k][i] else ''}"
                    f"{'*' if (l, h, k, i) in prot else ''}" for h in range(len(heads))))
        L.append(f"    L{l:02d}  " + " | ".join(cells))
    if a["corrected_keys"]:
        heads = sorted({(c["layer"], c["head"]) for c in a["corrected_keys"]})
        L.append(f"  key correction on {len(a['corrected_keys'])} key slots ({len(heads)} KV heads): "
                 + _listing([f"L{l}.H{h}" for l, h in heads]))
    if a["protected"]:
        heads = sorted({(p["layer"], p["head"], p["kind"]) for p in a["protected"]})
        L.append(f"  protected (>= 8 bits, above the median {a['median_bits']:g}): "
                 + _listing([f"L{l}.H{h}.{k.upper()}" for l, h, k in heads]))
    else:
        L.append("  protected heads: none (no slot at >= 8 bits above the median)")


def _measured(rep: dict, L: list[str]) -> None:
    if not rep.get("measured") and not (rep.get("metrics") or {}).get("search"):
        return
    L.append("")
    for d in rep.get("measured", []):
        extra = ""
        if d.get("acc") is not None:
            fp = f" (FP {d['acc_fp']:.3g})" if d.get("acc_fp") is not None else ""
            extra = f", accuracy {ci(d, 'acc')}{fp}"
        nll = f", NLL {ci(d, 'nll')}" if d.get("nll") is not None else ""
        n = f" [{int(d['n_samples'])} samples]" if d.get("n_samples") else ""
        before = " (the plan as searched, before it was edited)" if rep.get("measured_elsewhere") else ""
        L.append(f"measured on {d['label']}{before}: KL {ci(d, 'kl')}{nll}{extra}{n}")
    s = (rep.get("metrics") or {}).get("search")
    if isinstance(s, dict):
        def g(k, default="?"):
            v = s.get(k, default)
            return v if isinstance(v, (int, float, str)) and not isinstance(v, bool) else show(v)

        L.append(f"search: granularity {g('granularity')}, {g('n_trials')} trials (+{g('n_profile_evals', 0)} "
                 f"profile evaluations), seed {g('seed')}, chosen trial {g('trial')} ({g('source')})")
    profile = (rep.get("search") or {}).get("profile") or {}
    scale = number(profile.get("streaming.scale"))
    if scale is not None:
        def kl(key: str) -> str:
            v = number(profile.get(key))
            return "?" if v is None else f"{v:.4g}"

        L.append(f"streamed heads chosen with the streaming damages scaled by {scale:.3g}, calibrated by scoring the "
                 f"damage model's optimum in two parts: quantized slots KL {kl('streaming.quantized_part')}, "
                 f"streamed heads KL {kl('streaming.streamed_part')}")


def _importance(rep: dict, L: list[str]) -> None:
    imp = rep.get("importance")
    if not imp:
        return
    L.append("")
    r2 = f", forest OOB R2 {imp['oob_r2']:.2f}" if imp.get("oob_r2") is not None else ""
    L.append(f"consensus importance ({imp['n_trials']} trials; impurity + held-out permutation + |SHAP|{r2}), "
             "in % of consensus importance:")
    if imp.get("no_fit"):
        L.append("  caution: the forest predicts out-of-bag trials no better than their mean KL (OOB R2 <= 0): "
                 "this ranking rests on no learned relation")
    fixed = imp.get("not_varied") or {}
    if fixed.get("slots"):
        heads = f"; every slot of heads {', '.join(fixed['heads'])}" if fixed.get("heads") else ""
        L.append(f"  not varied in the trials (no data: counted 0 and not ranked): {fixed['slots']} of "
                 f"{fixed['of']} slots{heads}")
    L.append("  K vs V: " + ", ".join(f"{k.upper()} {v:.1f}%" for k, v in imp["kind"].items()))
    if len(imp["modality"]) > 1:
        L.append("  modality: " + ", ".join(f"{k} {v:.1f}%" for k, v in imp["modality"].items()))
    L.append("  layers: " + ", ".join(f"{k} {v:.1f}%" for k, v in imp["layer"].items()))
    L.append("  heads: " + ", ".join(f"{k} {v:.1f}%" for k, v in imp["head"].items()))
    if imp["quantizer"]:
        L.append("  quantizer: " + ", ".join(f"{k} {v:.1f}%" for k, v in imp["quantizer"].items()))
    L.append("  top slots: " + ", ".join(f"{k} {v:.1f}%" for k, v in imp["top_slots"].items()))
    d = imp.get("direction") or {}
    if d.get("slope"):
        L.append(f"  effect of bits ({d['units']}): "
                 + ", ".join(f"{k} {v:+.3g}" for k, v in d["slope"].items()))


def _pareto(rep: dict, L: list[str]) -> None:
    hist = rep.get("history") or {}
    if not hist.get("pareto"):
        return
    L.append("")
    L.append(f"Pareto front (calibration KL vs bpv) of {hist['n_trials']} trials (figure pareto): " + ", ".join(
        f"{p['bpv']:.4f}->{p['kl']:.4g}" for p in hist["pareto"]))
    if hist.get("measured_on"):  # host -> trials, from each trial's provenance (several workers / machines)
        L.append("trials measured on (host: trials): " + ", ".join(f"{h}: {n}" for h, n in hist["measured_on"].items()))
    if hist.get("baselines"):
        L.append("baselines in the study (calibration): " + ", ".join(
            f"{p['label']} {p['bpv']:.4f} bpv KL {p['kl']:.4g}" for p in hist["baselines"]))
    bpv = rep["budget"]["bpv"]["total"]
    for d in this_plans_measurements(rep):
        if number(d.get("kl")) is not None:
            L.append(f"this plan on {d['label']}: {bpv:.4f} bpv, KL {ci(d, 'kl')}")
    if rep["budget"]["target_bpv"] is not None:
        L.append(f"budget line: {rep['budget']['target_bpv']:g} bpv")


def render_text(rep: dict) -> str:
    """The report as text: every number the figures show (their data are in the JSON too)."""
    L: list[str] = []
    _header(rep, L)
    _memory(rep, L)
    _allocation(rep, L)
    _measured(rep, L)
    _importance(rep, L)
    _pareto(rep, L)
    if rep.get("figures"):
        L.append("")
        L.append("figures: " + ", ".join(rep["figures"]))
    if rep.get("html"):
        L.append(f"HTML report: {rep['html']}")
    if rep.get("warnings"):
        L.append("")
        for msg in rep["warnings"]:
            L.append(f"warning: {msg}")
    if rep["missing"]:
        L.append("")
        for msg in rep["missing"]:
            L.append(f"missing: {msg}")
    return "\n".join(L) + "\n"
