"""The kvplan console script, run for real in a subprocess."""

import os
import subprocess
import sys

import pytest

from kvplan import Geometry, baseline_plan

GEOM = Geometry(30, 3, 64, ("full",) * 30, "llama")


def _kvplan(*args, timeout=600):
    exe = os.path.join(os.path.dirname(sys.executable), "kvplan")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)


def test_validate_good_plan(tmp_path):
    path = tmp_path / "p.yaml"
    baseline_plan("k4v2", GEOM).to_yaml(path)
    r = _kvplan("validate", str(path))
    assert r.returncode == 0, r.stderr
    assert "valid kvplan plan for llama" in r.stdout and "honest bpv 4.3750" in r.stdout


@pytest.mark.parametrize("content,fragment", [
    ("schema_version: 1\nmodel: {}\nbits: {default: 4}\n", "model.model_type: missing required key"),
    ("not: [valid\n", "<yaml>: not valid YAML"),
    (None, "bits.default: must be one of"),
])
def test_validate_bad_plan_one_line_exit_2(tmp_path, content, fragment):
    path = tmp_path / "bad.yaml"
    if content is None:
        content = baseline_plan("int4", GEOM).to_yaml().replace("default: 4", "default: 5")
    path.write_text(content)
    r = _kvplan("validate", str(path))
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert lines[0].startswith(f"kvplan: error: {path}: ") and fragment in lines[0]


def test_missing_plan_file_exit_2(tmp_path):
    r = _kvplan("validate", str(tmp_path / "nope.yaml"))
    assert r.returncode == 2 and "cannot read plan file" in r.stderr


@pytest.mark.slow
def test_generate_on_default_model_prints_reply_and_bytes():
    r = _kvplan("generate", "--plan", "k4v2", "--max-new-tokens", "12")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "reply:" in r.stdout and "FP16 cache:" in r.stdout
    line = next(x for x in r.stdout.splitlines() if x.startswith("kvplan cache:"))
    assert "bits/value" in line


@pytest.mark.slow
def test_plan_for_other_model_rejected_with_field(tmp_path):
    path = tmp_path / "other.yaml"
    baseline_plan("int4", Geometry(30, 3, 64, ("full",) * 30, "qwen2")).to_yaml(path)
    r = _kvplan("validate", str(path), "--model", "smollm2-135m")
    assert r.returncode == 2
    assert "model.model_type: plan was made for 'qwen2' but the model has 'llama'" in r.stderr
