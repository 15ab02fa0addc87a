"""A kvplan study opens in optuna-dashboard (the ``dashboard`` extra): the dashboard is
started on the study's storage on a loopback port, and a trial is read back over its HTTP API
with the values and attributes kvplan stored."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import optuna
import optuna_dashboard  # noqa: F401  (the test extra installs it: missing, this file fails, not skips)
import pytest
from optuna.trial import TrialState

from kvplan.search import make_storage, search
from tests.search.synthetic import SyntheticScorer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read().decode())


def test_dashboard_reads_a_kvplan_trial(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    search(budget="3.0", n_trials=4, scorer=SyntheticScorer(), storage=url, study_name="dash", out=None,
           progress=False, profile=False, n_candidates=4, n_local=8)
    study = optuna.load_study(study_name="dash", storage=make_storage(url, heartbeat_interval=None))
    want = study.get_trials(states=(TrialState.COMPLETE,))[0]

    port = _free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "optuna-dashboard")
    proc = subprocess.Popen([exe, url, "--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline, studies = time.time() + 60, None
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"optuna-dashboard exited: {proc.stdout.read()[-2000:]}")
            try:
                studies = _get(f"{base}/api/studies")
                break
            except OSError:
                time.sleep(0.3)
        assert studies is not None, "optuna-dashboard did not answer within 60 s"
        (meta,) = [s for s in studies["study_summaries"] if s["study_name"] == "dash"]
        detail = _get(f"{base}/api/studies/{meta['study_id']}")
        (got,) = [t for t in detail["trials"] if t["number"] == want.number]
        assert got["state"] == "Complete"
        assert got["values"] == [pytest.approx(want.values[0])]
        attrs = {a["key"]: a["value"] for a in got["user_attrs"]}
        assert "kvplan.bpv" in attrs and "kvplan.owner" in attrs
        assert {p["name"] for p in got["params"]} == set(want.params)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
