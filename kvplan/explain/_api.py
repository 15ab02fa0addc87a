"""``explain()``: the report, its figures and its HTML page, written safely."""

from __future__ import annotations

import json
import os
from typing import Sequence

from ..plans import atomic_write_text
from ..plans._files import check_not_inputs, check_writable, plan_sidecar_paths
from ._figures import file_mode, render_figures, write_figures
from ._html import render_html
from ._report import ExplainError, report
from ._text import render_text

FORMATS = ("text", "json")


def explain(plan_path, format: str = "text", out_dir=None, importance: bool = True, seed: int = 0, *,
            context_lengths: Sequence[int] | None = None, batch_sizes: Sequence[int] | None = None,
            html=None) -> str:
    """Explain a plan file: returns the text report, or JSON text with ``format="json"``.

    ``out_dir``: write PNG figures there (allocation, bpv vs context, and with the trial
    history the Pareto front and importance), as one set. ``html``: write one self-contained
    HTML page (text, figures, provenance) atomically. ``context_lengths`` / ``batch_sizes``:
    where the memory table is computed (bytes and GiB next to the unquantized fp16/fp32 cache).
    """
    if format not in FORMATS:
        raise ExplainError(f"format {format!r} is not one of {list(FORMATS)}")
    plan_path = os.fspath(plan_path)
    if out_dir is not None:
        out_dir = os.fspath(out_dir)
        check_writable(out_dir, "--figures", is_dir=True, error=ExplainError)
    if html is not None:
        html = os.fspath(html)
        check_writable(html, "--html", is_dir=False, error=ExplainError)
        side = plan_sidecar_paths(plan_path)
        check_not_inputs({"--html": html}, {"plan": plan_path, "trial history": side["trials"],
                                            "search record": side["search"]}, error=ExplainError)
    rep = report(plan_path, importance=importance, seed=seed, context_lengths=context_lengths,
                 batch_sizes=batch_sizes)
    if out_dir is not None or html is not None:
        pngs = render_figures(rep)
        try:
            also = {}  # the page goes with the figures as one set: neither is updated without the other
            if out_dir is not None:
                rep["figures"] = [os.path.join(out_dir, f"{name}.png") for name in pngs]
            if html is not None:
                rep["html"] = html
                also[html] = render_html(rep, pngs)
            if out_dir is not None:
                write_figures(out_dir, pngs, also=also)
            elif html is not None:
                atomic_write_text(html, also[html])
            if html is not None:
                os.chmod(html, file_mode())
        except OSError as e:
            raise ExplainError(f"{e.filename or out_dir or html}: cannot write ({e.strerror or e})") from None
    if format == "json":
        return json.dumps(rep, indent=1, default=float)
    return render_text(rep)
