#!/usr/bin/env bash
# One command for the GPU checks of the packed-cache kernels (issue 15):
#
#   bench/gpu.sh              # on a CUDA machine: < 8 minutes on one GPU
#   bench/gpu.sh --cpu-smoke  # no GPU: the same two phases, tiny shapes, TRITON_INTERPRET=1 on CPU
#
# 1. correctness: tests/kernels/test_triton_kernels.py compiled on CUDA, every Triton kernel
#    (quantize, dequantize, error-feedback codes, fused decode attention) against the pure-PyTorch reference
#    encode/decode: fp16/bf16/fp32, 2/3/4/8 bits, GQA, padded batches, mixed per-head bits,
#    Hadamard / pre-RoPE / corrected blocks, and the large `gpu`-marked shapes;
# 2. speed: bench/decode_kernels.py --step-table: decode attention of all 30 layers and a whole decode
#    step on a random-weight SmolLM2-135M-config model, for sdpa/DynamicCache and kvplan int4,
#    int2, k4v2 and the default searched plan (bench/results/search-2.5bpv.yaml) at 4k/16k/64k
#    history, batch 1 and 8; writes bench/results/gpu-<gpu>.md stamped with commit, command,
#    GPU and the test summary of phase 1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python
CMD="bench/gpu.sh $*"
if [ "${1:-}" = "--cpu-smoke" ]; then
    export TRITON_INTERPRET=1
    TESTS=(tests/kernels/test_triton_kernels.py -k "dequantize_matches_reference and int2 and g32 or packed_decode_attention and (searched or kivi) or feedback_codes and lloyd2")
    STEP=(--cpu-smoke)
    T_TESTS=300 T_STEP=600
else
    unset TRITON_INTERPRET
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'bench/gpu.sh: no CUDA GPU (use --cpu-smoke)')"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    TESTS=(tests/kernels/test_triton_kernels.py)
    STEP=(--contexts 4096 16384 65536 --batches 1 8 --iters 10 --steps 8)
    T_TESTS=240 T_STEP=220
fi
echo "== 1/2 kernel tests: ${TESTS[*]}"
LOG=$(mktemp)
set +e
timeout "$T_TESTS" "$PY" -m pytest -q -x -p no:cacheprovider "${TESTS[@]}" 2>&1 | tee "$LOG"
RC=${PIPESTATUS[0]}
set -e
SUMMARY=$(grep -E "(passed|failed|error)" "$LOG" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
rm -f "$LOG"
if [ "$RC" -ne 0 ]; then
    echo "bench/gpu.sh: kernel tests failed (rc $RC): $SUMMARY" >&2
    exit "$RC"
fi
echo "== 2/2 decode attention and decode step table"
timeout "$T_STEP" "$PY" bench/decode_kernels.py --step-table "${STEP[@]}" --command "$CMD" \
    --tests "$SUMMARY" --tests-command "pytest -q ${TESTS[*]}"
