"""The benchmark scripts that record the repository's numbers still run at this commit (tiny settings)."""

import os
import pathlib
import subprocess
import sys

from tests.runtime.routes import needs_triton

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


@needs_triton
def test_the_gpu_step_table_compares_the_searched_plans_kernel_with_a_reference_of_the_same_attention(tmp_path):
    """bench/gpu.sh's table compared the raw Triton kernel, which skips a streamed head's unstored positions, with
    a reference that attended to them as zeros: |triton - ref| read 0.68 on the searched plan (2e-7 on the others)
    in `bench/gpu.sh --cpu-smoke`, a number that would have been recorded from a GPU as a kernel error."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "bench" / "decode_kernels.py"), "--cpu-smoke", "--configs", "searched",
           "--steps", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    row = next(line for line in r.stdout.splitlines() if line.startswith("| 160 | 2 | searched |"))
    assert float(row.strip(" |").split("|")[-1]) < 1e-4, row


def test_the_feedback_cost_benchmark_writes_the_recorded_plan(tmp_path):
    """bench/feedback_cost.py made a cache of the recorded plan outside kvplan's attention, which a plan that
    streams KV heads is refused: the benchmark failed on the plan it times."""
    out = tmp_path / "feedback_cost.md"
    cmd = [sys.executable, str(ROOT / "bench" / "feedback_cost.py"), str(RECORDED), "--lengths", "128", "--repeats",
           "1", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| 128 |" in out.read_text()
