"""kvplan imports and runs where Triton cannot be imported."""

import os
import subprocess
import sys

CODE = r'''
import sys

# as on a machine without Triton: `import triton` raises ImportError and
# importlib.util.find_spec("triton") is None (torch itself asks the latter on import)
sys.modules["triton"] = None
import torch
import kvplan
from kvplan.kernels import triton_available
assert not triton_available()
sys.path.insert(0, ".")
from tests.tiny_models import tiny_llama
model = tiny_llama()
ids = torch.tensor([[5, 6, 7, 8] * 24])
ref = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False)
kvplan.load(model, "fp16")  # attention="auto" on the CPU: the native kernel (a C compiler is here)
assert model._kvplan_attention_kernel.__name__ == "native_decode_attention"
out = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
assert torch.equal(out.sequences, ref)
kvplan.load(model, kvplan.baseline_plan("int2", kvplan.Geometry.of(model), residual_length=0))
out = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
assert out.cache.layers[0].committed == 96 and out.cache.bpv() < 8
try:
    kvplan.load(model, "int4", attention="triton")
except kvplan.PlanError as e:
    assert "Triton cannot be imported" in str(e)
else:
    raise AssertionError("attention='triton' without Triton must fail clearly")
print("ok")
'''


def test_runs_without_triton():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", CODE], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("ok")
