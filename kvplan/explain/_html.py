"""One self-contained HTML page of a report: the text, the figures as base64 PNG, the
plan's provenance. No script, no external stylesheet, font or image: it opens offline."""

from __future__ import annotations

import base64
import html

from ._figures import full_precision
from ._sidecars import this_plans_measurements
from ._text import render_text

CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #1a1a1a; background: #fafafa; }
header { background: #1f2a44; color: #fff; padding: 18px 28px; }
header h1 { margin: 0 0 4px; font-size: 24px; }
header p { margin: 0; color: #c9d3ea; }
main { padding: 16px 28px 40px; max-width: 1400px; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; margin: 8px 0 20px; }
.card { background: #fff; border: 1px solid #d9dde6; border-radius: 6px; padding: 10px 16px; min-width: 170px; }
.card b { display: block; font-size: 22px; color: #1f2a44; }
.card span { color: #555; font-size: 13px; }
figure { margin: 18px 0; background: #fff; border: 1px solid #d9dde6; border-radius: 6px; padding: 10px; }
figure img { max-width: 100%; height: auto; display: block; }
figcaption { color: #444; font-size: 13px; margin-top: 6px; }
pre { background: #fff; border: 1px solid #d9dde6; padding: 12px; overflow-x: auto; font-size: 12px; }
table { border-collapse: collapse; background: #fff; }
td, th { border: 1px solid #d9dde6; padding: 4px 10px; text-align: left; font-size: 13px; }
.warn { color: #8a4b00; }
"""

CAPTIONS = {
    "allocation": "Bits per (layer x KV head) slot, one panel per K/V and token modality; dots: key slots that "
                  "also store the key correction; hatching: protected slots.",
    "bpv_context": "Honest bits per value against context length, next to {fp} (the unquantized cache) and uniform "
                   "plans with the same quantizer; the star is the plan's reference point.",
    "pareto": "Calibration KL of every trial against honest bpv, the Pareto front, the study's baselines and this "
              "plan on calibration and test (held-out) samples; right: the search's progress.",
    "importance": "Consensus importance per component group and, for the top slots, which way their bits move "
                  "the predicted KL (SHAP).",
}


def _cards(rep: dict) -> list[tuple[str, str]]:
    b = rep["budget"]
    cards = [(f"{b['bpv']['total']:.3f} bpv", f"honest, at {b['reference']['context_len']} tokens")]
    if b["target_bpv"] is not None:
        cards.append((f"{b['target_bpv']:g} bpv", "budget"))
    for d in this_plans_measurements(rep):
        if d.get("kl") is not None:
            cards.append((f"{d['kl']:.4g}", f"mean KL, {d['label']}"))
    m = rep["memory"][-1]
    cards.append((f"{m['gib']:.3g} GiB", f"KV cache at {m['context_len']} tokens x {m['batch']} "
                                          f"({full_precision(rep)} {m['fp16_gib']:.3g} GiB)"))
    return cards


def _provenance(rep: dict) -> list[tuple[str, object]]:
    rows = [("plan file", rep["plan"]), ("plan name", rep.get("name")),
            ("model fingerprint", rep["model"]["fingerprint"])]
    rows += [(f"provenance.{k}", v) for k, v in (rep.get("provenance") or {}).items()]
    s = (rep.get("metrics") or {}).get("search")
    if isinstance(s, dict):
        rows += [(f"metrics.search.{k}", v) for k, v in s.items()]
    rows += [(f"{rep['plan']} sidecar: {k}", v) for k, v in (rep.get("search") or {}).items()
             if k in ("budgets", "seed", "study_name")]
    h = rep.get("history") or {}
    if h.get("trials_csv"):
        rows.append(("trial history", f"{h['trials_csv']} ({h.get('n_trials')} usable trials)"))
    return rows


def render_html(rep: dict, pngs: dict[str, bytes]) -> str:
    """The report as one HTML page with the figures ``{name: PNG bytes}`` embedded."""
    e = html.escape
    title = f"kvplan explain: {rep.get('name') or rep['plan']}"
    m = rep["model"]
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>{e(title)}</title><style>{CSS}</style></head><body>",
           f"<header><h1>{e(title)}</h1><p>{e(m['model_type'])}: {m['num_layers']} layers x {m['num_kv_heads']} "
           f"KV heads x head_dim {m['head_dim']} — {e(rep['plan'])}</p></header><main>",
           '<div class="cards">']
    out += [f'<div class="card"><b>{e(v)}</b><span>{e(k)}</span></div>' for v, k in _cards(rep)]
    out.append("</div>")
    for w in rep.get("warnings") or []:
        out.append(f'<p class="warn">warning: {e(w)}</p>')
    for name, data in pngs.items():
        b64 = base64.b64encode(data).decode("ascii")
        out.append(f'<figure id="{e(name)}"><img alt="{e(name)}" src="data:image/png;base64,{b64}">'
                   f"<figcaption>{e(CAPTIONS.get(name, name).format(fp=full_precision(rep)))}</figcaption>"
                   "</figure>")
    out.append("<h2>Report</h2><pre>" + e(render_text(rep)) + "</pre>")
    out.append("<h2>Provenance</h2><table>")
    out += [f"<tr><th>{e(str(k))}</th><td>{e(str(v))}</td></tr>" for k, v in _provenance(rep)]
    out.append("</table></main></body></html>")
    return "\n".join(out) + "\n"
