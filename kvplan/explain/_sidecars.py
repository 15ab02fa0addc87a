"""Reading the search's sidecar files beside a plan, tolerantly.

A sidecar is optional: a corrupt one must not stop the report of the plan itself. Each
reader returns what it could use and a list of warnings, one line each, naming the file
and what is wrong with it (the report prints them).

- ``<stem>.trials.csv``: one row per trial (:func:`kvplan.search.write_history`); rows that
  cannot be used (non-numeric cells, a bit table of the wrong size, unknown format codes)
  are skipped and counted.
- ``<stem>.search.json``: a JSON object; known keys of the wrong type are dropped, unknown
  keys ignored.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..kernels.qtypes import GROUP_SIZES
from ..plans._checks import MAX_TOKENS
from ..plans._fields import PLAN_BITS
from ..plans import codes_error

MAX_SIDECAR_BYTES = 256 * 2**20  # larger files are refused rather than read into memory
REQUIRED_COLUMNS = ("kl", "bits")
INT_QUANTIZER_COLUMNS = ("group_size", "residual_length", "sink_length", "recent_length")  # non-negative integers
QUANTIZER_COLUMNS = (*INT_QUANTIZER_COLUMNS, "key_axis", "value_axis")
AXES = ("channel", "token")


def this_plans_measurements(rep: dict) -> list[dict]:
    """The report's measurements that are this plan's: none when the plan was edited since it was
    measured (they belong to the plan as searched; the text says so where it lists them)."""
    return [] if rep.get("measured_elsewhere") else list(rep.get("measured", []))


def number(v) -> float | None:
    """``v`` as a finite float, or ``None`` (strings that parse as numbers count; bools do not)."""
    if isinstance(v, bool) or v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return f if math.isfinite(f) else None


def show(v, limit: int = 60) -> str:
    """A bounded, escaped rendering of a value read from a file (for warning lines)."""
    s = repr(v)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def plain(v, limit: int = 60) -> str:
    """``v`` as text for a report line: no quotes, control characters escaped, at most ``limit`` characters."""
    s = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(v))
    return s if len(s) <= limit else s[: limit - 3] + "..."


@dataclass
class TrialHistory:
    """The usable trials of a ``.trials.csv``: format-code tables ``[N, L, H, 2, M]`` and per-trial fields."""

    path: str
    codes: np.ndarray
    kl: list[float]
    bpv: list[float | None]
    source: list[str]
    number: list[int | None]
    quantizer: dict[str, list] = field(default_factory=dict)
    n_rows: int = 0
    run_ids: set = field(default_factory=set)  # the export runs the rows come from ("" for older files)
    hosts: dict = field(default_factory=dict)  # host -> number of usable trials it measured

    def __len__(self) -> int:
        return len(self.kl)


def _read_text(path: str, what: str, warnings: list[str]) -> str | None:
    try:
        size = os.path.getsize(path)
        if size > MAX_SIDECAR_BYTES:
            warnings.append(f"{path}: ignored: {size} bytes, more than the {MAX_SIDECAR_BYTES} a {what} may have")
            return None
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except UnicodeDecodeError as e:
        warnings.append(f"{path}: ignored: not UTF-8 text (byte {e.start})")
    except OSError as e:
        warnings.append(f"{path}: ignored: cannot be read ({e.strerror or e})")
    return None


def _row_problem(r: dict, n_slots: int) -> str | None:
    """Why a trials.csv row cannot be used, or ``None``."""
    if None in r or any(v is None for v in r.values()):
        return "wrong number of cells"
    kl = number(r["kl"])
    if kl is None or kl < 0:
        return f"kl {show(r['kl'])} is not a non-negative number"
    if r.get("bpv") not in (None, "") and number(r["bpv"]) is None:
        return f"bpv {show(r['bpv'])} is not a number"
    cells = r["bits"].split()
    if len(cells) != n_slots:
        return f"bits has {len(cells)} entries, the plan has {n_slots} slots"
    try:
        codes = np.array([int(c) for c in cells], dtype=np.int64)
    except ValueError:
        return "bits holds a non-integer"
    bad = codes_error(codes, PLAN_BITS)
    if bad:
        return f"bits holds {bad}"
    for k in INT_QUANTIZER_COLUMNS:
        v = r.get(k)
        if v in (None, ""):
            continue
        f = number(v)
        if f is None or f != int(f) or not 0 <= f <= MAX_TOKENS or (k == "group_size" and int(f) not in GROUP_SIZES):
            return f"{k} {show(v)} is not a valid {k}"
    for k in ("key_axis", "value_axis"):
        if r.get(k) not in (None, "") and r[k] not in AXES:
            return f"{k} {show(r[k])} is not one of {list(AXES)}"
    return None


def read_trials(path: str, shape: tuple[int, ...], warnings: list[str]) -> TrialHistory | None:
    """Usable trials of ``path`` for a plan whose table has ``shape``; ``None`` if absent or unusable."""
    if not os.path.exists(path):
        return None
    text = _read_text(path, "trial history", warnings)
    if text is None:
        return None
    if "\x00" in text:
        warnings.append(f"{path}: ignored: contains NUL bytes (not a CSV file)")
        return None
    try:
        reader = csv.DictReader(io.StringIO(text, newline=""))
        header = reader.fieldnames or []
        rows = list(reader)
    except csv.Error as e:
        warnings.append(f"{path}: ignored: not a readable CSV file ({e})")
        return None
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    if missing:
        warnings.append(f"{path}: ignored: no column {', '.join(missing)} (columns: {show(header, 120)})")
        return None
    n_slots = int(np.prod(shape))
    codes, kl, bpv, src, num = [], [], [], [], []
    run_ids, hosts = set(), {}
    quant: dict[str, list] = {k: [] for k in QUANTIZER_COLUMNS}
    skipped: list[tuple[int, str]] = []
    for i, r in enumerate(rows):
        why = _row_problem(r, n_slots)
        if why is not None:
            skipped.append((i + 2, why))  # line number in the file (header is line 1)
            continue
        codes.append(np.array([int(c) for c in r["bits"].split()], dtype=np.int64).reshape(shape))
        kl.append(float(r["kl"]))
        bpv.append(number(r.get("bpv")))
        src.append(str(r.get("source") or ""))
        n = number(r.get("number"))
        num.append(int(n) if n is not None and n == int(n) else None)
        for k in INT_QUANTIZER_COLUMNS:
            # histories written before a column existed: 0 (sink, recent copies) or unknown
            v = r.get(k)
            quant[k].append(int(float(v)) if v not in (None, "") else 0)
        for k in ("key_axis", "value_axis"):
            quant[k].append(r.get(k) or "")
        run_ids.add(str(r.get("run_id") or ""))
        if r.get("host"):
            h = plain(r["host"], 60)
            hosts[h] = hosts.get(h, 0) + 1
    if skipped:
        line, why = skipped[0]
        warnings.append(f"{path}: skipped {len(skipped)} of {len(rows)} rows that cannot be used "
                        f"(line {line}: {why})")
    if not rows:
        warnings.append(f"{path}: ignored: no trial rows")
    if not kl:
        return None
    return TrialHistory(path, np.stack(codes), kl, bpv, src, num, quant, len(rows), run_ids, hosts)


def _is_num_list(v, width: int | None = None) -> bool:
    return isinstance(v, list) and all(number(x) is not None for x in v) and (width is None or len(v) == width)


def _is_point(v) -> bool:
    return isinstance(v, dict) and number(v.get("kl")) is not None and number(v.get("bpv")) is not None


# key -> (check, what it must be); keys not listed are ignored (the sidecar may gain keys)
SEARCH_KEYS = {
    "space": (lambda v: isinstance(v, dict), "an object"),
    "budgets": (lambda v: _is_num_list(v) and len(v) > 0, "a list of numbers"),
    "multi_objective": (lambda v: isinstance(v, bool), "true or false"),
    "reference": (lambda v: isinstance(v, dict), "an object"),
    "profile": (lambda v: isinstance(v, dict) and all(number(x) is not None for x in v.values()),
                "an object of numbers"),
    "curve": (lambda v: isinstance(v, list) and all(_is_num_list(x, 3) for x in v), "a list of [trial, kl, bpv]"),
    "pareto": (lambda v: isinstance(v, list) and all(_is_point(x) for x in v), "a list of {kl, bpv} points"),
    "baselines": (lambda v: isinstance(v, list) and all(_is_point(x) for x in v), "a list of {kl, bpv} points"),
    "seed": (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)), "an integer"),
    "study_name": (lambda v: v is None or isinstance(v, str), "a string"),
    "storage": (lambda v: v is None or isinstance(v, str), "a string"),
    "plans": (lambda v: isinstance(v, dict), "an object"),
    "run_id": (lambda v: isinstance(v, str), "a string"),
}


def match_run(plan_metrics, search: dict | None, hist: TrialHistory | None, paths: dict[str, str],
              warnings: list[str]) -> tuple[dict | None, TrialHistory | None]:
    """Drop the sidecars written by another search run than the plan (``metrics.search.run_id``),
    with a warning naming each: a plan beside another run's history would be explained with
    trials that never produced it. Files without run ids (older searches) are kept."""
    s = plan_metrics.get("search") if isinstance(plan_metrics, dict) else None
    run_id = s.get("run_id") if isinstance(s, dict) else None
    if not isinstance(run_id, str) or not run_id:
        return search, hist
    if search is not None and search.get("run_id", run_id) != run_id:
        warnings.append(f"{paths['search']}: ignored: written by another search run (run id "
                        f"{show(search['run_id'], 40)}, the plan's is {run_id}): the plan and its sidecars are "
                        "not one set")
        search = None
    if hist is not None and (hist.run_ids - {""}) and hist.run_ids != {run_id}:
        other = sorted(hist.run_ids - {run_id})
        warnings.append(f"{paths['trials']}: ignored: written by another search run (run id "
                        f"{show(other[0], 40)}, the plan's is {run_id}): the plan and its sidecars are not one set")
        hist = None
    return search, hist


def read_search(path: str, warnings: list[str]) -> dict[str, Any] | None:
    """The known, well-typed keys of a ``.search.json``; ``None`` if absent or unusable."""
    if not os.path.exists(path):
        return None
    text = _read_text(path, "search sidecar", warnings)
    if text is None:
        return None
    try:
        d = json.loads(text, parse_constant=lambda c: None)  # NaN / Infinity -> null
    except (ValueError, RecursionError) as e:
        warnings.append(f"{path}: ignored: not valid JSON ({show(str(e), 80)})")
        return None
    if not isinstance(d, dict):
        warnings.append(f"{path}: ignored: a JSON {type(d).__name__}, expected an object")
        return None
    out = {}
    for k, (ok, what) in SEARCH_KEYS.items():
        if k not in d or (d[k] is None and not ok(None)):  # null: none recorded (a search without a profile)
            continue
        if ok(d[k]):
            out[k] = d[k]
        else:
            warnings.append(f"{path}: key {k!r} ignored: must be {what} (got {show(d[k])})")
    return out
