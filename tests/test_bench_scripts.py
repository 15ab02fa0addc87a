"""The benchmark scripts that record the repository's numbers still run at this commit (tiny settings)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORDED = ROOT / "bench" / "results" / "search-2.5bpv.yaml"


def test_the_runtime_benchmark_decodes_the_recorded_plan(tmp_path):
    """bench/runtime.py made each kvplan cache before switching the model to kvplan's attention, which a plan
    that streams KV heads (the recorded one) needs: the decode table failed on the plan it exists to time."""
    cmd = [sys.executable, str(ROOT / "bench" / "runtime.py"), "--threads", "1", "--decode-cells", "256x1",
           "--prefill-cells", "", "--rounds", "1", "--steps", "1", "--configs", "dynamic-fp32",
           f"plan:{RECORDED}", "--plan-file", str(RECORDED), "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    table = (tmp_path / "runtime-cpu.md").read_text()
    assert "search-2.5bpv.yaml" in table and "256" in table
