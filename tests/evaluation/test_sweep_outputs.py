"""The sweep's CSV and JSON are written as one set (kvplan.plans._files.write_file_set)."""

import json
import os

from kvplan.evaluation import sweep


def test_sweep_csv_and_json_written_as_one_set(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "plot_sweep", lambda rows, path, title="": open(path, "wb").close())
    row = {k: None for k in sweep.CSV_FIELDS}
    paths = sweep.write_sweep({"rows": [row], "ratios": {}, "results": {}}, str(tmp_path), {"title": "t"})
    assert json.load(open(paths["json"]))["meta"] == {"title": "t"}
    assert open(paths["csv"]).read().splitlines()[0] == ",".join(sweep.CSV_FIELDS)

    def fail(files):  # a failure before the renames leaves the previous pair untouched
        raise OSError("disk full")

    before = {p: open(paths[p]).read() for p in ("csv", "json")}
    monkeypatch.setattr(sweep, "write_file_set", fail)
    try:
        sweep.write_sweep({"rows": [], "ratios": {"x": 1}, "results": {}}, str(tmp_path), {})
    except OSError:
        pass
    assert {p: open(paths[p]).read() for p in ("csv", "json")} == before
    assert sorted(os.listdir(tmp_path)) == ["sweep.csv", "sweep.json", "sweep.png"]
