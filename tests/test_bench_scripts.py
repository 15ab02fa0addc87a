"""The benchmark scripts that record the repository's numbers still run at this commit (tiny settings)."""

import os
import pathlib
import subprocess
import sys

import pytest

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


NO_STREAM = ROOT / "bench" / "results" / "no-stream" / "plan.yaml"  # the plan heavy_copies.md etc. were measured on
# (script, plan, the script's smallest settings, a line its stdout must hold): each failed at e81d45f on an empty
# plan name (codec_baselines and the scripts that import its baselines), a streamed slot's bits 0
# overwritten (one_bit_probe, recent_tokens), heavy-hitter copies beside streamed heads (heavy_copies), or a
# PackedBlock.encode wrapper without grid_origin (headq_probe, token_protection_probe)
SMOKE = [
    ("codec_baselines.py", RECORDED, ["--samples", "1"], "| HeadGuard-style: "),
    ("allocation_ceiling.py", RECORDED, ["--samples", "1"], "the damage model's optimum"),
    ("one_bit_probe.py", RECORDED, ["--samples", "1"], "| all 1 bit |"),
    ("recent_tokens.py", RECORDED, ["--samples", "1"], "| 16 | 8-bit per-token codes |"),
    ("heavy_copies.py", NO_STREAM, ["--samples", "1"], "| searched (the recorded plan) |"),
    ("headq_probe.py", None, ["--calibration-samples", "1", "--samples", "1"], "| 4 | int4 |"),
    ("token_protection_probe.py", RECORDED, ["--samples", "1"], "| kv | 0.03 | newest |"),
    ("attention_protection_probe.py", NO_STREAM, ["--samples", "1", "--rows", "3"], "| searched, repaired to "),
]


@pytest.mark.parametrize("script, plan, settings, line", SMOKE, ids=[s[0] for s in SMOKE])
def test_the_benchmark_script_runs_at_its_smallest_settings(tmp_path, script, plan, settings, line):
    out = tmp_path / "out.md"
    cmd = [sys.executable, str(ROOT / "bench" / script), *([str(plan)] if plan else []), *settings, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KVPLAN_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert line in r.stdout, r.stdout[-3000:]
    assert "Wall time" in out.read_text()
    if script == "headq_probe.py":  # the side code reaches the scored attention (the dequantize route reads it)
        kl = {row.split("|")[1].strip(): float(row.split("|")[4].split()[0]) for row in r.stdout.splitlines()
              if row.startswith("| 0 | — |") or row.startswith("| 4 | fp32 |")}
        assert kl["4"] < kl["0"], kl


REFUSING = ["heavy_copies.py", "attention_protection_probe.py", "streaming_heads_probe.py"]


def test_a_script_measured_on_a_plan_without_streamed_heads_refuses_the_recorded_plan_at_once():
    """These scripts model a plan without streamed heads (heavy-hitter copies cannot go beside them); given the
    recorded plan, which streams 16, they failed deep in the run (streaming_heads_probe after ~450 s).
    One subprocess runs the three (one torch import): run in the test process, their torch.set_num_threads(2)
    outlived them and moved the in-process KLs of later tests off the 1-thread KLs the searches recorded."""
    code = ("import runpy, sys\n"
            f"sys.path.insert(0, {str(ROOT / 'bench')!r})\n"
            f"for script in {REFUSING!r}:\n"
            f"    sys.argv = [script, {str(RECORDED)!r}, '--out', {os.devnull!r}]\n"
            "    try:\n"
            f"        runpy.run_path({str(ROOT / 'bench')!r} + '/' + script, run_name='__main__')\n"
            "    except SystemExit as e:\n"
            "        print(script, '->', e.code)\n"
            "    else:\n"
            "        print(script, '-> ran')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert [line.split(" -> ")[0] for line in lines] == REFUSING, r.stdout
    for line in lines:
        assert "bench/results/no-stream/plan.yaml" in line, line
