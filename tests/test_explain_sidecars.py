"""kvplan explain on corrupt sidecar files and odd metrics: the plan is still reported, each bad
sidecar is ignored with one warning line naming the file and what is wrong (issue 18)."""

import json
import os
import subprocess
import sys

import pytest

from kvplan.explain import explain, render_text
from tests.explain_helpers import copy_plan, searched_plan


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    return searched_plan(tmp_path_factory.mktemp("sc"))


def _lines(path):
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines(keepends=True)


def _rewrite(path, text: str | bytes):
    with open(path, "wb") as f:
        f.write(text if isinstance(text, bytes) else text.encode("utf-8"))


def _cell(path, row: int, col: str, value: str):
    head, *rows = _lines(path)
    cols = head.rstrip("\n").split(",")
    cells = rows[row].rstrip("\n").split(",")
    cells[cols.index(col)] = value
    rows[row] = ",".join(cells) + "\n"
    _rewrite(path, head + "".join(rows))


def _json(path, **changes):
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    d.update(changes)
    _rewrite(path, json.dumps(d))


# id -> (sidecar, corruption, text the warning must hold, usable trials left (None: history ignored))
CORRUPTIONS = {
    "csv-truncated": ("trials", lambda p: _rewrite(p, "".join(_lines(p))[:-40]), "skipped 1 of 20 rows", 19),
    "csv-empty": ("trials", lambda p: _rewrite(p, ""), "no column kl, bits", None),
    "csv-header-only": ("trials", lambda p: _rewrite(p, _lines(p)[0]), "no trial rows", None),
    "csv-wrong-columns": ("trials", lambda p: _rewrite(p, "".join(_lines(p)).replace("kl,", "loss,", 1)),
                          "no column kl", None),
    "csv-kl-not-a-number": ("trials", lambda p: _cell(p, 3, "kl", "abc"), "kl 'abc' is not a non-negative number",
                            19),
    "csv-kl-nan": ("trials", lambda p: _cell(p, 0, "kl", "nan"), "kl 'nan'", 19),
    "csv-bpv-text": ("trials", lambda p: _cell(p, 1, "bpv", "x"), "bpv 'x' is not a number", 19),
    "csv-bits-short": ("trials", lambda p: _cell(p, 2, "bits", "2 2 2"), "bits has 3 entries", 19),
    "csv-bits-text": ("trials", lambda p: _cell(p, 2, "bits", " ".join(["two"] * 48)), "non-integer", 19),
    "csv-bits-unknown-format": ("trials", lambda p: _cell(p, 2, "bits", " ".join(["5"] * 48)), "format codes", 19),
    "csv-bits-corrected-streamed": ("trials", lambda p: _cell(p, 2, "bits", " ".join(["100"] * 48)), "format codes",
                                    19),
    "csv-group-size": ("trials", lambda p: _cell(p, 4, "group_size", "48"), "group_size '48'", 19),
    "csv-extra-cells": ("trials", lambda p: _rewrite(p, "".join(_lines(p)) + "1,2,3" + ",9" * 20 + "\n"),
                        "wrong number of cells", 20),
    "csv-not-utf8": ("trials", lambda p: _rewrite(p, b"number,kl\n\xff\xfe\x00\x81"), "not UTF-8", None),
    "csv-nul-bytes": ("trials", lambda p: _rewrite(p, "".join(_lines(p)).replace("\n", "\x00\n", 3)), "NUL", None),
    "csv-is-a-directory": ("trials", lambda p: (os.unlink(p), os.mkdir(p)), "cannot be read", None),
    "json-truncated": ("search", lambda p: _rewrite(p, open(p).read()[:50]), "not valid JSON", 20),
    "json-a-list": ("search", lambda p: _rewrite(p, "[1, 2]"), "a JSON list, expected an object", 20),
    "json-budgets-string": ("search", lambda p: _json(p, budgets="2.5"), "key 'budgets' ignored", 20),
    "json-baselines-wrong": ("search", lambda p: _json(p, baselines=[1, 2]), "key 'baselines' ignored", 20),
    "json-curve-rows": ("search", lambda p: _json(p, curve=[[1, 2]]), "key 'curve' ignored", 20),
    "json-profile-nan": ("search", lambda p: _rewrite(p, '{"profile": {"L00.k": NaN}}'), "key 'profile' ignored", 20),
    "json-deep-nesting": ("search", lambda p: _rewrite(p, "[" * 200000), "not valid JSON", 20),
    "json-not-utf8": ("search", lambda p: _rewrite(p, b'{"seed": "\xff"}'), "not UTF-8", 20),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupt_sidecar_is_ignored_with_a_warning(searched, tmp_path, case):
    side, corrupt, needle, n_left = CORRUPTIONS[case]
    paths = copy_plan(searched, tmp_path)
    corrupt(paths[side])
    rep = json.loads(explain(paths["plan"], format="json", importance=False, out_dir=tmp_path / "figs"))
    assert rep["budget"]["bpv"]["total"] > 0 and os.path.exists(tmp_path / "figs" / "allocation.png")
    mine = [w for w in rep["warnings"] if w.startswith(paths[side] + ":")]
    assert len(mine) == 1 and needle in mine[0], rep["warnings"]
    assert all("\n" not in w for w in rep["warnings"])
    assert rep["history"].get("n_trials") == n_left
    if n_left is None:
        assert any("trial history" in m and "unusable" in m for m in rep["missing"])
    assert f"warning: {mine[0]}" in render_text(rep)


def test_unknown_search_keys_are_ignored(searched, tmp_path):
    paths = copy_plan(searched, tmp_path)
    _json(paths["search"], new_key={"anything": [1, "x"]}, another=3)
    rep = json.loads(explain(paths["plan"], format="json", importance=False))
    assert rep["warnings"] == [] and rep["search"]["budgets"] == [3.0]


def test_cli_reports_the_plan_and_the_warning(searched, tmp_path):
    paths = copy_plan(searched, tmp_path)
    _rewrite(paths["trials"], "garbage\n")
    r = subprocess.run([sys.executable, "-m", "kvplan.cli", "explain", paths["plan"], "--no-importance"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "honest bpv" in r.stdout and f"warning: {paths['trials']}: ignored: no column kl, bits" in r.stdout


def _edit_rows(path, change):
    """Rewrite the trials CSV with ``change(rows)`` (rows as dicts)."""
    import csv

    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    rows = change(rows)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


NO_SIGNAL = {  # id -> (rows change, text of the missing line)
    "constant-kl": (lambda rows: [{**r, "kl": "0.05"} for r in rows], "the calibration KL is 0.05 in all 20 trials"),
    "nothing-varies": (lambda rows: [{**rows[5], "number": str(i), "kl": str(0.08 + 0.001 * i)} for i in range(8)],
                       "no slot's bits and none of group_size, residual_length, key_axis, sink_length, recent_length "
                       "vary across the 8 trials"),
    # distinct KLs, all under the surrogate's log floor: it was told that no slot's bits varied
    "kl-under-the-floor": (lambda rows: [{**r, "kl": repr(1e-12 * (i + 1))} for i, r in enumerate(rows)],
                           "the calibration KL is at most the surrogate's floor 1e-09 in all 20 trials"),
}


@pytest.mark.parametrize("case", list(NO_SIGNAL))
def test_history_without_signal_ranks_nothing(searched, tmp_path, case):
    """A history whose KL or components never vary gets a missing line, not a ranking of equal or zero shares."""
    change, needle = NO_SIGNAL[case]
    paths = copy_plan(searched, tmp_path)
    _edit_rows(paths["trials"], change)
    rep = json.loads(explain(paths["plan"], format="json"))
    assert rep["history"]["n_trials"] == (8 if case == "nothing-varies" else 20)
    assert "importance" not in rep
    if case == "nothing-varies":  # 8 rows of the search's 20: said so (5b6a760)
        assert rep["warnings"] and all("holds 8 trial rows of the 20" in w or "is not among its rows" in w
                                       for w in rep["warnings"])
    else:
        assert rep["warnings"] == []
    assert rep["missing"] == [f"consensus importance ({needle}: nothing to rank)"]
    txt = render_text(rep)
    assert f"missing: consensus importance ({needle}" in txt and "% of consensus importance" not in txt


def test_hosts_print_as_plain_names(searched, tmp_path):
    """The "trials measured on" line names hosts as written (no repr quotes), long ones cut, odd ones escaped."""
    paths = copy_plan(searched, tmp_path)
    long = "node-" + "x" * 100
    hosts = ["gpu-1", long, "bad\nhost"]
    _edit_rows(paths["trials"], lambda rows: [{**r, "host": hosts[i % 3]} for i, r in enumerate(rows)])
    rep = json.loads(explain(paths["plan"], format="json", importance=False))
    short = long[:57] + "..."
    assert rep["history"]["measured_on"] == {"gpu-1": 7, short: 7, "bad\\nhost": 6}
    line = [l for l in render_text(rep).splitlines() if l.startswith("trials measured on")]
    assert line == [f"trials measured on (host: trials): gpu-1: 7, {short}: 7, bad\\nhost: 6"]
