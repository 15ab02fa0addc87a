"""``kvplan explain``: why a plan looks the way it does.

Works on the plan file alone (model, budget, honest bpv breakdown, memory in bytes and GiB
at chosen context lengths and batch sizes, bpv between group boundaries and at other
modality mixes, allocation, protected heads, measured metrics). When the search's trial
history sits beside the plan (``<stem>.trials.csv``, ``<stem>.search.json``, written by
:func:`kvplan.search.search`) it adds the consensus importance (random-forest impurity +
permutation + mean |SHAP|; see :mod:`kvplan.surrogates.importance`), each slot's direction
and the Pareto front. A corrupt sidecar is ignored with a warning naming it.

>>> print(explain("plan.yaml"))                                   # text report
>>> explain("plan.yaml", format="json", out_dir="figs")            # JSON text, PNG figures in figs/
>>> explain("plan.yaml", html="report.html", context_lengths=[4096, 32768], batch_sizes=[1, 8])
"""

from ._api import FORMATS, explain
from ._figures import FIGURE_NAMES, render_figures, write_figures
from ._html import render_html
from ._report import BATCH_SIZES, CONTEXT_LENGTHS, ExplainError, report
from ._text import render_text

__all__ = ["BATCH_SIZES", "CONTEXT_LENGTHS", "ExplainError", "FIGURE_NAMES", "FORMATS", "explain", "render_figures",
           "render_html", "render_text", "report", "write_figures"]
